"""TF1 at small N, where one ``sess.run`` is all there is: stepfuse against the seed's answer.

At N = 1 a run has nothing to fuse, and a few microseconds decide the comparison, less
than the spread between two identical graphs on a shared VM. So each contender is built
``--instances`` times (separate graphs and sessions), every instance is timed in
interleaved rounds (the order reversed every other round), and a contender's figure is
the median over its instances of each instance's best round. Contenders are those of
``stepfuse bench --backends tf1`` (`stepfuse.bench.tf1`: stepfuse through
``fused.run(sess, feed)``, the N-copies graph fetching its losses and update), plus a
``sess.run`` fetching a constant with the same feed: the fixed cost under every run.

    python benchmarks/tf1_small_n.py [--steps 1 10] [--size seed] [--instances 3] [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from stepfuse.bench import tf1 as bench_tf1  # noqa: E402
from stepfuse.bench._timing import interleaved_best  # noqa: E402
from stepfuse.bench.problems import problem  # noqa: E402

tf1 = tf.compat.v1
TIMED = ("stepfuse", "N copies (seed answer)")
FLOOR = "sess.run of a constant"


def floor_builder(size):
    """A run with the contenders' feed that does nothing: ``sess.run``'s own cost."""
    layers, xn, yn = problem(size)

    def build():
        sess, const, feed, _ = bench_tf1.graph(layers, xn, yn, lambda f: tf.constant(0.0))
        return lambda m: [sess.run(const, feed) for _ in range(m)]

    return build


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 10], help="steps per run (N)")
    ap.add_argument("--size", default="seed", help="benchmark size: seed, mlp or wide")
    ap.add_argument("--instances", type=int, default=3, help="graphs built per contender")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    ap.add_argument("--runs", type=int, default=100, help="runs per timed sample")
    args = ap.parse_args(argv)
    for n in args.steps:
        builders, _ = bench_tf1.contenders(args.size, n)
        builders = {name: builders[name] for name in TIMED}
        builders[FLOOR] = floor_builder(args.size)
        runs = {}
        for name, build in builders.items():
            for i in range(args.instances):
                run = build()
                for _ in range(10):
                    run(1 if name == FLOOR else n)
                runs[(name, i)] = run
        calls = {
            key: (lambda run=run, m=1 if key[0] == FLOOR else n: run(m))
            for key, run in runs.items()
        }
        best = interleaved_best(calls, args.rounds, per_sample=args.runs)
        med = {}
        print(f"\n{args.size}, N = {n}: us per sess.run (best round of each instance; median)")
        for name in builders:
            mins = [1e6 * best[(name, i)] for i in range(args.instances)]
            med[name] = statistics.median(mins)
            print(f"  {name:24s} {' '.join(f'{t:8.1f}' for t in mins)}   median {med[name]:8.1f}")
        ratio = med["stepfuse"] / med["N copies (seed answer)"]
        above = [med[k] - med[FLOOR] for k in TIMED]
        print(
            f"  stepfuse / N copies: {ratio:.3f}x; above the constant fetch: "
            f"stepfuse {above[0]:.1f} us, N copies {above[1]:.1f} us"
        )


if __name__ == "__main__":
    main()
