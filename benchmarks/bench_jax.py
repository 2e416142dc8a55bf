"""JAX on the seed problem: stepfuse's fused call against the hand-written loops.

Contenders, timed side by side in this one process (best of interleaved repeats):
  stepfuse            sf.fuse(...)(state, x, y): the fused while loop with trace and checks
  fori_loop           a hand-written lax.fori_loop of optax steps, no trace
  fori_loop (loss each step)
                      the same loop taking value_and_grad, keeping the last loss: the floor
                      for any loop that reports a loss per step (nothing recorded)
  fori_loop (recording losses)
                      the same loop writing each loss into a buffer at its step: the
                      per-step losses a stepfuse trace holds, recorded by hand
  scan (with losses)  a hand-written lax.scan of optax steps returning per-step losses
  jit per step        jax.jit of one step, called N times from Python

Run:  python benchmarks/bench_jax.py [--steps 10000] [--size seed|mlp|wide|deep]
      [--optimizer sgd|momentum|adam] [--json FILE]
      [--xla-option NAME=VALUE ...]   (XLA options for every contender's jax.jit alike,
      e.g. --xla-option xla_cpu_experimental_ynn_fusion_type= ; stepfuse gets them
      through fuse(..., compiler_options=...))
(`stepfuse bench --backends jax` runs the same contenders for every size and N.)
"""

from __future__ import annotations

import argparse

from stepfuse.bench._timing import measure, print_table, write_json
from stepfuse.bench.jax import OPTIMIZERS, contenders
from stepfuse.bench.problems import SIZES


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--size", default="seed", choices=SIZES)
    ap.add_argument("--optimizer", default="sgd", choices=tuple(OPTIMIZERS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--xla-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an XLA compiler option for every contender (repeatable)",
    )
    args = ap.parse_args(argv)
    options = dict(o.split("=", 1) for o in args.xla_option)
    builders, steps_for = contenders(
        args.size, args.steps, compiler_options=options or None, optimizer=args.optimizer
    )
    results = measure(
        builders,
        args.steps,
        backend="jax",
        problem=args.size,
        repeats=args.repeats,
        steps_for=steps_for,
    )
    print_table(
        results,
        title=f"JAX, {args.size}, {args.optimizer}, N={args.steps} "
        "(x stepfuse = us/step / stepfuse's)",
    )
    r = {x.contender: x for x in results}
    sf = r["stepfuse"].us_per_step
    print(
        f"stepfuse / fori_loop = {sf / r['fori_loop'].us_per_step:.2f}x   "
        f"stepfuse / fori_loop (loss each step) = {sf / r['fori_loop (loss each step)'].us_per_step:.2f}x   "
        f"stepfuse / fori_loop (recording losses) = {sf / r['fori_loop (recording losses)'].us_per_step:.2f}x   "
        f"stepfuse / scan (with losses) = {sf / r['scan (with losses)'].us_per_step:.2f}x   "
        f"jit per step / stepfuse = {r['jit per step'].ratio:.1f}x"
    )
    if args.json:
        write_json(
            results,
            args.json,
            command="python benchmarks/bench_jax.py",
            steps=args.steps,
            optimizer=args.optimizer,
            compiler_options=options,
        )


if __name__ == "__main__":
    main()
