"""TensorFlow side-by-side benchmark on the seed problem (2->2 perceptron, SGD 0.01, 50 blobs).

A thin entry point over `stepfuse.bench.tf` (TF2 / Keras contenders) and
`stepfuse.bench.tf1` (TF1 graph mode, ``sess.run``), the modules ``stepfuse bench``
uses, plus a table of graph build time against N (the seed's N chained copies grow,
stepfuse.tf.v1 does not). Ratios are per-step time / that backend's stepfuse per-step time.

    python benchmarks/bench_tf.py [--steps 20000] [--size seed] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import stepfuse.tf.v1 as sf1  # noqa: E402
from stepfuse.bench import tf as bench_tf  # noqa: E402
from stepfuse.bench import tf1 as bench_tf1  # noqa: E402
from stepfuse.bench._timing import measure, print_table, write_json  # noqa: E402
from stepfuse.bench.problems import problem  # noqa: E402
from stepfuse.problems import SEED_LR  # noqa: E402

tf1 = tf.compat.v1


def build_times(ns=(10, 100, 300), size="seed"):
    """Graph build time (construction + first run) against N: N-copies grow, stepfuse v1 does not."""
    layers, xn, yn = problem(size)
    rows = []
    for N in ns:
        t0 = time.perf_counter()
        sess, op, feed, g = bench_tf1.graph(
            layers,
            xn,
            yn,
            lambda f: sf1.copies_train_op(f, tf1.train.GradientDescentOptimizer(SEED_LR), N)[0],
        )
        sess.run(op, feed)
        t_copies, ops_copies = time.perf_counter() - t0, len(g.get_operations())
        t0 = time.perf_counter()
        sess, fused, feed, g = bench_tf1.graph(
            layers,
            xn,
            yn,
            lambda f: sf1.fuse(f, tf1.train.GradientDescentOptimizer(SEED_LR), steps=N),
        )
        sess.run(fused.train_op, feed)
        rows.append((N, t_copies, ops_copies, time.perf_counter() - t0, len(g.get_operations())))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps", type=int, default=20000, help="steps per timed call for the fused contenders"
    )
    ap.add_argument("--size", default="seed", help="benchmark size: seed, mlp or wide")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    n = args.steps
    results = []
    for backend, module in (("tf", bench_tf), ("tf1", bench_tf1)):
        builders, steps_for = module.contenders(args.size, n)
        rs = measure(
            builders,
            n,
            backend=backend,
            problem=args.size,
            repeats=args.repeats,
            steps_for=steps_for,
        )
        for r in rs:
            r.note = module.NOTES.get(r.contender, "")
        results += rs
    print_table(results, title=f"stepfuse TF benchmark ({args.size}, {n} steps)")
    by = {(r.backend, r.contender): r.us_per_step for r in results}
    sf_us, v1_us = by["tf", "stepfuse"], by["tf1", "stepfuse"]
    print("\nTargets:")
    print(
        f"  stepfuse TF2+XLA vs per-step sess.run : {by['tf1', 'sess.run per step'] / sf_us:8.1f}x faster (target >= 100x)"
    )
    print(
        f"  stepfuse TF2+XLA vs Keras fit         : {by['tf', 'Keras fit (steps_per_execution)'] / sf_us:8.1f}x faster (target >= 50x)"
    )
    print(
        f"  stepfuse.tf.v1 vs per-step sess.run   : {by['tf1', 'sess.run per step'] / v1_us:8.1f}x faster"
    )
    print(
        f"  stepfuse.tf.v1 vs N copies (N<=100)   : {by['tf1', 'N copies (seed answer)'] / v1_us:8.1f}x faster per step"
    )
    print("\nBuild (graph construction + first run) against N:")
    print(f"  {'N':>5} {'N-copies s':>11} {'ops':>7} {'stepfuse.v1 s':>14} {'ops':>6}")
    rows = build_times(size=args.size)
    for N, tc, oc, tv, ov in rows:
        print(f"  {N:>5} {tc:>11.2f} {oc:>7} {tv:>14.2f} {ov:>6}")
    if args.json:
        write_json(
            results,
            args.json,
            steps=n,
            build_vs_n=[
                {"N": N, "copies_build_s": tc, "copies_ops": oc, "v1_build_s": tv, "v1_ops": ov}
                for N, tc, oc, tv, ov in rows
            ],
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
