"""TensorFlow 2 / Keras contenders: stepfuse's fused call against the loops a TF2 user would write.

Every contender trains the same problem (`stepfuse.bench.problems.problem`: tanh MLP,
softmax cross-entropy, SGD lr 0.01, full batch) with the Keras 3 optimizer's own update.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from .. import tf as sf  # noqa: E402
from .problems import problem  # noqa: E402

CONTENDERS = (
    "stepfuse",
    "stepfuse (no XLA)",
    "tf.function per step",
    "tf.while_loop in tf.function",
    "Keras fit (steps_per_execution)",
)

NOTES = {
    "stepfuse": "stepfuse.tf, one tf.function call, XLA inner loop, trace of every loss",
    "stepfuse (no XLA)": "stepfuse.tf with jit_compile=False",
    "tf.function per step": "one tf.function(GradientTape + apply_gradients) call per step",
    "tf.while_loop in tf.function": "hand-written tf.while_loop, jit_compile=True, no trace/guards",
    "Keras fit (steps_per_execution)": "model.fit, steps_per_execution=min(N, 1000), jit_compile=True",
}


def mlp_logits(variables, x):
    """The benchmark MLP on ``variables = [k0, b0, k1, b1, ...]``: tanh between layers."""
    h = x
    pairs = list(zip(variables[0::2], variables[1::2]))
    for k, b in pairs[:-1]:
        h = tf.tanh(tf.matmul(h, k) + b)
    k, b = pairs[-1]
    return tf.matmul(h, k) + b


def ce(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def make_variables(layers):
    out = []
    for layer in layers:
        out += [tf.Variable(layer["kernel"]), tf.Variable(layer["bias"])]
    return out


def keras_model(layers):
    """A Keras Sequential with the same weights and activations as `mlp_logits`."""
    stack = [keras.Input((layers[0]["kernel"].shape[0],))]
    for i, layer in enumerate(layers):
        act = "tanh" if i < len(layers) - 1 else None
        stack.append(keras.layers.Dense(layer["kernel"].shape[1], activation=act))
    model = keras.Sequential(stack)
    model.set_weights([w for layer in layers for w in (layer["kernel"], layer["bias"])])
    return model


def contenders(size: str, n: int, lr: float = 0.01) -> Any:
    """Builders (see `stepfuse.bench._timing.measure`) for every TF2 contender on ``size``."""
    layers, xn, yn = problem(size)
    x, y = tf.constant(xn), tf.constant(yn)

    def stepfuse(jit=True):
        def build():
            variables = make_variables(layers)
            fit = sf.fuse(
                lambda x, y: ce(y, mlp_logits(variables, x)),
                keras.optimizers.SGD(lr),
                variables,
                steps=n,
                jit_compile=jit,
            )
            return lambda m: fit(x, y, steps=m)  # returns a host Trace: blocks

        return build

    def tf_function_per_step():
        variables = make_variables(layers)
        opt = keras.optimizers.SGD(lr)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = ce(y, mlp_logits(variables, x))
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        def run(m):
            for _ in range(m):
                loss = step(x, y)
            return loss.numpy()

        return run

    def while_loop_xla():
        variables = make_variables(layers)
        opt = keras.optimizers.SGD(lr)
        opt.build(variables)

        def loop(m, x, y):
            def body(i, _):
                with tf.GradientTape() as tape:
                    loss = ce(y, mlp_logits(variables, x))
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
                return i + 1, loss

            return tf.while_loop(lambda i, _: i < m, body, (tf.constant(0), tf.constant(0.0)))[1]

        fn = tf.function(loop, jit_compile=True, autograph=False)
        return lambda m: fn(tf.constant(m, tf.int32), x, y).numpy()

    def keras_fit():
        model = keras_model(layers)
        spe = min(n, 1000)
        model.compile(
            optimizer=keras.optimizers.SGD(lr),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=spe,
            jit_compile=True,
        )
        data = tf.data.Dataset.from_tensors((xn, yn)).repeat()

        def run(m):
            model.fit(data, epochs=1, steps_per_epoch=m, verbose=0, shuffle=False)

        return run

    builders = {
        "stepfuse": stepfuse(True),
        "stepfuse (no XLA)": stepfuse(False),
        "tf.function per step": tf_function_per_step,
        "tf.while_loop in tf.function": while_loop_xla,
        "Keras fit (steps_per_execution)": keras_fit,
    }
    slow = min(n, 1000)
    return builders, {"stepfuse (no XLA)": slow, "tf.function per step": slow}
