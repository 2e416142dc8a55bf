"""TensorFlow 1 graph-mode contenders (``sess.run``): stepfuse.tf.v1 against the seed's loops.

Each contender builds its own ``tf.Graph`` (eager execution stays on in the process)
with the problem's placeholders and ``tf1.get_variable`` weights, and trains with
``tf.compat.v1.train.GradientDescentOptimizer(lr)``.

"N copies (seed answer)" is the seed's accepted answer: N chained copies of
loss -> gradients -> update in one graph. Its graph (and build time) grows with N, so
it is built for ``min(N, 100)`` copies and run ``ceil(m / copies)`` times for ``m`` steps.
Every contender fetches the per-step losses along with the update, as stepfuse does.
"""

from __future__ import annotations

import math
import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from ..tf import v1 as sf1  # noqa: E402
from .problems import problem  # noqa: E402

tf1 = tf.compat.v1

CONTENDERS = ("stepfuse", "sess.run per step", "N copies (seed answer)")
MAX_COPIES = 100

NOTES = {
    "stepfuse": "stepfuse.tf.v1: fused.run(sess, feed), one sess.run calling one XLA-compiled tf.while_loop",
    "sess.run per step": "optimizer.minimize, one sess.run per step (fetching the loss)",
    "N copies (seed answer)": (
        f"graph of min(N, {MAX_COPIES}) chained copies, run ceil(m/copies) "
        "times (larger N takes too long to build)"
    ),
}


def ce(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def graph(layers, xn, yn, build):
    """A fresh graph with the problem's placeholders and variables; ``build(loss_fn)``.

    Returns ``(sess, built, feed, graph)``; ``loss_fn()`` may be called several times
    (variables are created on the first call, reused after).
    """
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, xn.shape[1]], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")

        def loss_fn():
            with tf1.variable_scope("mlp", reuse=tf1.AUTO_REUSE):
                h = x
                for i, layer in enumerate(layers):
                    k = tf1.get_variable(f"kernel{i}", initializer=layer["kernel"])
                    b = tf1.get_variable(f"bias{i}", initializer=layer["bias"])
                    h = tf.matmul(h, k) + b
                    if i < len(layers) - 1:
                        h = tf.tanh(h)
                return ce(y, h)

        built = build(loss_fn)
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=g)
    sess.run(init)
    return sess, built, {x: xn, y: yn}, g


def contenders(size: str, n: int, lr: float = 0.01) -> Any:
    """Builders (see `stepfuse.bench._timing.measure`) for every TF1 contender on ``size``."""
    layers, xn, yn = problem(size)

    def opt():
        return tf1.train.GradientDescentOptimizer(lr)

    def stepfuse():
        sess, fused, feed, _ = graph(layers, xn, yn, lambda f: sf1.fuse(f, opt(), steps=n))

        def run(m):  # as a user would: one sess.run through `run`, which returns the Trace
            return fused.run(sess, feed, steps=m).loss

        return run

    def per_step():
        def build(f):
            loss = f()
            return [loss, opt().minimize(loss)]

        sess, fetches, feed, _ = graph(layers, xn, yn, build)

        def run(m):
            return [sess.run(fetches, feed)[0] for _ in range(m)]

        return run

    def copies():
        c = min(n, MAX_COPIES)
        sess, (op, losses), feed, _ = graph(
            layers, xn, yn, lambda f: sf1.copies_train_op(f, opt(), c)
        )

        def run(m):
            return [sess.run([losses, op], feed)[0] for _ in range(math.ceil(m / c))]

        return run

    builders = {
        "stepfuse": stepfuse,
        "sess.run per step": per_step,
        "N copies (seed answer)": copies,
    }
    return builders, {"sess.run per step": min(n, 1000)}
