"""A 1,000,000-step fused call on the seed perceptron: memory stays flat, the trace is thinned.

For each backend, one fit call runs every step inside the compiled loop; with
``record_every=1000`` the trace holds 1,000 losses (4 kB) whatever the number of steps.
Prints the peak RSS (``resource.getrusage``) before and after the call, the wall time
of the call (compiled beforehand by a short call) and the time per step; exits 1 if a
check fails. Each backend runs in its own process so that the RSS is its own.

Run:  python benchmarks/long_run.py [--steps 1000000] [--record-every 1000] [--backends jax tf torch]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up log off the report


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def run_one(backend: str, n: int, k: int) -> bool:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    from stepfuse import Stop
    from stepfuse.bench.seed import seed_fit

    run = seed_fit(backend, n, record_every=k)
    t0 = time.perf_counter()
    run(2)  # traces / compiles the one program used below
    compile_s = time.perf_counter() - t0
    rss_before = peak_rss_mib()
    t0 = time.perf_counter()
    trace = run()  # the long call: same program
    wall = time.perf_counter() - t0
    rss_after = peak_rss_mib()
    expected = -(-n // k)
    ok = (
        len(trace.loss) == expected
        and trace.steps == n
        and trace.stop is Stop.STEPS
        and bool(np.all(np.isfinite(trace.loss)))
        and list(trace.index[:2]) == [0, k]
    )
    print(
        f"{backend:6s} {n:,} steps in one call (record_every={k}): compile {compile_s:.2f} s, "
        f"wall {wall:.3f} s = {wall / n * 1e6:.3f} us/step; peak RSS {rss_before:.1f} -> "
        f"{rss_after:.1f} MiB (+{rss_after - rss_before:.1f}); trace points {len(trace.loss)} "
        f"(expected {expected}), last loss {trace.loss[-1]:.6f}: {'OK' if ok else 'FAILED'}"
    )
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--record-every", type=int, default=1000)
    ap.add_argument("--backends", nargs="+", default=None)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process of one backend
    args = ap.parse_args(argv)
    if args.one:
        return 0 if run_one(args.one, args.steps, args.record_every) else 1
    from stepfuse.bench.seed import BACKENDS
    from stepfuse.demo import available_backends

    backends = args.backends or [b for b in available_backends() if b in BACKENDS]
    codes = [
        subprocess.call(
            [
                sys.executable,
                __file__,
                "--one",
                b,
                "--steps",
                str(args.steps),
                "--record-every",
                str(args.record_every),
            ]
        )
        for b in backends
    ]
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
