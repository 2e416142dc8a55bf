"""TensorFlow side-by-side benchmark on the seed problem (2->2 perceptron, SGD 0.01, 50 blobs).

Contenders (one process, interleaved by `stepfuse.bench._timing.measure`):
  TF1 graph mode: one ``sess.run`` per step; the seed's N chained copies (N=10, 100);
  ``stepfuse.tf.v1`` (one while loop, XLA inner loop).
  TF2: a ``tf.function`` step called per step; ``stepfuse.tf`` with XLA and without;
  Keras 3 ``model.fit`` with ``steps_per_execution``.
Ratios are per-step time / stepfuse TF2+XLA per-step time.

    python benchmarks/bench_tf.py [--steps 20000] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import stepfuse.tf as sf  # noqa: E402
import stepfuse.tf.v1 as sf1  # noqa: E402
from stepfuse.bench._timing import measure, print_table, write_json  # noqa: E402
from stepfuse.problems import SEED_LR, blobs, perceptron_init  # noqa: E402

tf1 = tf.compat.v1
X, Y = blobs(50)
P = perceptron_init()


def _ce(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def _graph(build):
    """A fresh TF1 graph with the seed's placeholders and variables; ``build(loss_fn)``."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2])
        y = tf1.placeholder(tf.int32, [None])

        def loss_fn():
            k = tf1.get_variable("kernel", initializer=P["kernel"])
            b = tf1.get_variable("bias", initializer=P["bias"])
            return _ce(y, tf.matmul(x, k) + b)

        op = build(loss_fn)
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=g)
    sess.run(init)
    return sess, op, {x: X, y: Y}, g


def sess_run_per_step():
    sess, op, feed, _ = _graph(lambda f: tf1.train.GradientDescentOptimizer(SEED_LR).minimize(f()))
    return lambda n: [sess.run(op, feed) for _ in range(n)]


def n_copies(N):
    def build():
        sess, op, feed, _ = _graph(lambda f: sf1.copies_train_op(f, tf1.train.GradientDescentOptimizer(SEED_LR), N)[0])
        return lambda n: [sess.run(op, feed) for _ in range(max(1, n // N))]
    return build


def stepfuse_v1(steps):
    def build():
        holder = {}

        def make(f):
            holder["fused"] = sf1.fuse(f, tf1.train.GradientDescentOptimizer(SEED_LR), steps=steps)
            return holder["fused"].train_op

        sess, op, feed, _ = _graph(make)
        fused = holder["fused"]

        def run(n):
            sess.run(op, {**feed, fused.steps: n})
        return run
    return build


def _tf2_vars():
    return tf.Variable(P["kernel"]), tf.Variable(P["bias"])


def tf_function_per_step():
    k, b = _tf2_vars()
    opt = keras.optimizers.SGD(SEED_LR)
    x, y = tf.constant(X), tf.constant(Y)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _ce(y, tf.matmul(x, k) + b)
        opt.apply_gradients(zip(tape.gradient(loss, [k, b]), [k, b]))
        return loss

    def run(n):
        for _ in range(n):
            loss = step(x, y)
        loss.numpy()
    return run


def stepfuse_tf2(steps, jit):
    def build():
        k, b = _tf2_vars()
        x, y = tf.constant(X), tf.constant(Y)
        fit = sf.fuse(lambda x, y: _ce(y, tf.matmul(x, k) + b), keras.optimizers.SGD(SEED_LR), [k, b],
                      steps=steps, jit_compile=jit)
        return lambda n: fit(x, y, steps=n)
    return build


def keras_fit(spe):
    def build():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
        model.set_weights([P["kernel"], P["bias"]])
        model.compile(optimizer=keras.optimizers.SGD(SEED_LR),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=spe, jit_compile=True)
        data = tf.data.Dataset.from_tensors((X, Y)).repeat()

        def run(n):
            model.fit(data, epochs=1, steps_per_epoch=n, verbose=0, shuffle=False)
        return run
    return build


def build_times(ns=(10, 100, 300)):
    """Graph build time (construction + first run) against N: N-copies grow, stepfuse v1 does not."""
    rows = []
    for N in ns:
        t0 = time.perf_counter()
        sess, op, feed, g = _graph(lambda f: sf1.copies_train_op(f, tf1.train.GradientDescentOptimizer(SEED_LR), N)[0])
        sess.run(op, feed)
        t_copies, ops_copies = time.perf_counter() - t0, len(g.get_operations())
        t0 = time.perf_counter()
        holder = {}

        def make(f):
            holder["f"] = sf1.fuse(f, tf1.train.GradientDescentOptimizer(SEED_LR), steps=N)
            return holder["f"].train_op

        sess, op, feed, g = _graph(make)
        sess.run(op, feed)
        rows.append((N, t_copies, ops_copies, time.perf_counter() - t0, len(g.get_operations())))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000, help="steps per timed call for the fused contenders")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    n = args.steps
    slow = min(n, 2000)
    contenders = {
        "stepfuse": stepfuse_tf2(n, True),
        "stepfuse TF2 no XLA": stepfuse_tf2(n, False),
        "tf.function per step": tf_function_per_step,
        "keras fit spe=1000": keras_fit(1000),
        "TF1 sess.run per step": sess_run_per_step,
        "TF1 N-copies N=10": n_copies(10),
        "TF1 N-copies N=100": n_copies(100),
        "stepfuse.tf.v1": stepfuse_v1(n),
    }
    steps_for = {"stepfuse TF2 no XLA": slow, "tf.function per step": slow, "TF1 sess.run per step": slow,
                 "TF1 N-copies N=10": slow, "TF1 N-copies N=100": slow, "keras fit spe=1000": max(10000, min(n, 20000))}
    results = measure(contenders, n, backend="tf", problem="seed perceptron", repeats=args.repeats,
                      steps_for=steps_for)
    for r in results:
        r.note = "TF1 graph mode" if "TF1" in r.contender or "v1" in r.contender else "TF2 eager/tf.function"
    print_table(results, title=f"stepfuse TF benchmark (seed problem, {n} steps)")
    by = {r.contender: r for r in results}
    sf_us, v1_us = by["stepfuse"].us_per_step, by["stepfuse.tf.v1"].us_per_step
    print("\nTargets:")
    print(f"  stepfuse TF2+XLA vs per-step sess.run : {by['TF1 sess.run per step'].us_per_step / sf_us:8.1f}x faster (target >= 100x)")
    print(f"  stepfuse TF2+XLA vs Keras fit spe=1000: {by['keras fit spe=1000'].us_per_step / sf_us:8.1f}x faster (target >= 50x)")
    print(f"  stepfuse.tf.v1 vs per-step sess.run   : {by['TF1 sess.run per step'].us_per_step / v1_us:8.1f}x faster")
    for N in (10, 100):
        print(f"  stepfuse.tf.v1 vs N-copies N={N:<4}     : {by[f'TF1 N-copies N={N}'].us_per_step / v1_us:8.1f}x faster per step")
    print("\nBuild (graph construction + first run) against N:")
    print(f"  {'N':>5} {'N-copies s':>11} {'ops':>7} {'stepfuse.v1 s':>14} {'ops':>6}")
    rows = build_times()
    for N, tc, oc, tv, ov in rows:
        print(f"  {N:>5} {tc:>11.2f} {oc:>7} {tv:>14.2f} {ov:>6}")
    if args.json:
        write_json(results, args.json, steps=n, build_vs_n=[
            {"N": N, "copies_build_s": tc, "copies_ops": oc, "v1_build_s": tv, "v1_ops": ov}
            for N, tc, oc, tv, ov in rows])
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
