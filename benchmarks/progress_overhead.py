"""Cost of `progress=True` (a rich bar updated from inside the fused loop).

Times, in one process per backend, a 100,000-step fused call on the seed perceptron
with and without ``progress=True, every=1000`` and prints the slowdown, in wall time and
in the process's CPU time (all threads; a busy neighbour disturbs it less). A no-op
``callback`` with the same ``every`` is timed too: the cost of reaching the host from the
loop, without the bar's drawing.

Run:  python benchmarks/progress_overhead.py [--steps 100000] [--backends jax tf torch]
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
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=[b for b in available_backends() if b in BACKENDS])
    args = ap.parse_args(argv)
    import contextlib

    for backend in args.backends:
        runs = {"plain": seed_fit(backend, args.steps),
                "callback": seed_fit(backend, args.steps, callback=lambda step, loss: None, every=1000),
                "progress": seed_fit(backend, args.steps, progress=True, every=1000)}
        cpu = {name: float("inf") for name in runs}
        wall = dict(cpu)
        with contextlib.redirect_stdout(io.StringIO()):  # keep the bars off the report
            for run in runs.values():
                run()
            for _ in range(args.repeats):
                for name, run in runs.items():
                    t0, w0 = time.process_time(), time.perf_counter()
                    run()
                    cpu[name] = min(cpu[name], time.process_time() - t0)
                    wall[name] = min(wall[name], time.perf_counter() - w0)
        for label, best in (("wall", wall), ("cpu", cpu)):
            us = {k: 1e6 * v / args.steps for k, v in best.items()}
            print(f"{backend} ({label} time): {args.steps} steps, plain {us['plain']:.3f} us/step, "
                  f"progress(every=1000) {us['progress']:.3f} us/step, "
                  f"slowdown {100 * (us['progress'] / us['plain'] - 1):+.1f}% "
                  f"(no-op callback: {100 * (us['callback'] / us['plain'] - 1):+.1f}%)")


if __name__ == "__main__":
    main()
