"""PyTorch: stepfuse vs eager steps vs torch.compile of one step (side by side).

The contenders live in `stepfuse.bench.torch` (shared with ``stepfuse bench``); this
script runs them on one size for a few N and prints the table. All contenders train
the same problem (tanh MLP / the seed perceptron, cross-entropy, SGD lr 0.01) in one
process, timed side by side by `stepfuse.bench._timing.measure`; ``build s`` is the
first call (compile included; compiled programs are reused across N of one size).

Usage:
  python benchmarks/bench_torch.py [--size seed] [--steps 1000 10000] [--json FILE] [--chunk 4]

``--size cnn`` / ``lstm`` take any N (``stepfuse bench`` stops those at its ``MAX_STEPS``).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

import stepfuse.bench.torch as bt  # noqa: E402
from stepfuse.bench._timing import measure, print_table, write_json  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--size", default="seed", choices=("seed", "mlp", "wide", "cnn", "lstm"))
    ap.add_argument("--chunk", type=int, default=None, help="steps per compiled loop iteration")
    ap.add_argument(
        "--eager-steps",
        type=int,
        default=None,
        help="most steps per timed eager call (default: stepfuse.bench.torch.MAX_TIMED)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads for every contender"
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="time samples by wall clock or by the thread's CPU time (robust to a loaded "
        "machine; with --threads 1 it is all the work a contender does)",
    )
    ap.add_argument("--min-seconds", type=float, default=0.0, help="per contender and N")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.eager_steps is not None:
        bt.MAX_TIMED[args.size]["eager per step"] = args.eager_steps
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.manual_seed(0)
    results = []
    for n in args.steps:
        builders, steps_for = bt.contenders(args.size, n, chunk=args.chunk)
        results += measure(
            builders,
            n,
            backend="torch",
            problem=args.size,
            steps_for=steps_for,
            repeats=args.repeats,
            min_seconds=args.min_seconds,
            clock=clock,
        )
    chunk = args.chunk or "default"
    print_table(
        results,
        title=f"stepfuse.torch, {args.size} (chunk={chunk}, {torch.get_num_threads()} threads, "
        f"{args.clock} clock)",
    )
    if args.json:
        write_json(
            results,
            args.json,
            command="python benchmarks/bench_torch.py",
            torch=torch.__version__,
            chunk=args.chunk,
            threads=torch.get_num_threads(),
            clock=args.clock,
            notes=bt.NOTES,
        )


if __name__ == "__main__":
    main()
