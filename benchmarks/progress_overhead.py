"""Cost of `progress=True` (a rich bar updated from inside the fused loop).

Times, in one process per backend, a 100,000-step fused call on the seed perceptron
with and without ``progress=True, every=1000`` and prints the slowdown, in wall time and
in the process's CPU time (all threads; a busy neighbour disturbs it less). A no-op
``callback`` with the same ``every`` is timed too: the cost of reaching the host from the
loop, without the bar's drawing.

Each variant is built ``--instances`` times (each its own compiled program) and the
report takes, per variant, the median over instances of each one's best time.

Run:  python benchmarks/progress_overhead.py [--steps 100000] [--repeats 5] [--instances 9]
      [--backends jax tf torch] [--variants callback progress]
"""

from __future__ import annotations

import argparse
import io
import time

from stepfuse.bench.seed import BACKENDS, seed_fit
from stepfuse.demo import available_backends


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--instances",
        type=int,
        default=9,
        help="fits built per variant (one compiled program each: on a VM, two "
        "identical ones can differ by ~10%%, so the report takes the median "
        "over instances of each one's best time; with five or fewer, runs "
        "swing by several percent)",
    )
    ap.add_argument(
        "--backends", nargs="+", default=[b for b in available_backends() if b in BACKENDS]
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["plain", "callback", "progress"],
        choices=["plain", "callback", "progress"],
        help="what to time (plain is always timed: the others are against it)",
    )
    args = ap.parse_args(argv)
    import contextlib
    import statistics

    variants = {
        "plain": {},
        "callback": {"callback": lambda step, loss: None, "every": 1000},
        "progress": {"progress": True, "every": 1000},
    }
    variants = {name: v for name, v in variants.items() if name == "plain" or name in args.variants}
    for backend in args.backends:
        runs = [
            (name, seed_fit(backend, args.steps, **options))
            for _ in range(args.instances)
            for name, options in variants.items()
        ]
        cpu = [float("inf")] * len(runs)
        wall = list(cpu)
        with contextlib.redirect_stdout(io.StringIO()):  # keep the bars off the report
            for _, run in runs:
                run()
            for _ in range(args.repeats):
                for k, (_, run) in enumerate(runs):
                    t0, w0 = time.process_time(), time.perf_counter()
                    run()
                    cpu[k] = min(cpu[k], time.process_time() - t0)
                    wall[k] = min(wall[k], time.perf_counter() - w0)
        for label, best in (("wall", wall), ("cpu", cpu)):
            us = {
                name: 1e6
                * statistics.median(b for (n, _), b in zip(runs, best) if n == name)
                / args.steps
                for name in variants
            }
            line = f"{backend} ({label} time): {args.steps} steps, plain {us['plain']:.3f} us/step"
            if "progress" in us:
                line += (
                    f", progress(every=1000) {us['progress']:.3f} us/step, "
                    f"slowdown {100 * (us['progress'] / us['plain'] - 1):+.1f}%"
                )
            if "callback" in us:
                line += f" (no-op callback: {100 * (us['callback'] / us['plain'] - 1):+.1f}%)"
            print(line)


if __name__ == "__main__":
    main()
