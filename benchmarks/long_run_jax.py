"""A 1,000,000-step fused call on the seed perceptron: memory stays flat, the trace is thinned.

One ``fit(state, x, y)`` call runs every step inside a single ``lax.while_loop``; with
``record_every=1000`` the trace buffer holds 1,000 float32 losses (4 kB), whatever the
number of steps. Prints the peak RSS (``resource.getrusage``) before and after the
call, the wall time of the call (compiled beforehand) and the time per step.

Run:  python benchmarks/long_run_jax.py [--steps 1000000] [--record-every 1000]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import jax
import numpy as np
import optax

import stepfuse.jax as sf
from stepfuse import Stop
from stepfuse.problems import SEED_LR, blobs, perceptron_init


def seed_loss(params, x, y):
    logits = x @ params["kernel"] + params["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--record-every", type=int, default=1000)
    args = ap.parse_args(argv)
    n, k = args.steps, args.record_every

    x, y = blobs()
    fit = sf.fuse(seed_loss, optax.sgd(SEED_LR), steps=n, record_every=k)
    state = fit.init(perceptron_init())

    t0 = time.perf_counter()
    warm, _ = fit(state, x, y, steps=1)  # compiles the one program used below
    jax.block_until_ready(warm)
    compile_s = time.perf_counter() - t0
    rss_before = peak_rss_mib()

    t0 = time.perf_counter()
    final, trace = fit(state, x, y)  # the 1M-step call: same program, one device call
    jax.block_until_ready(final)
    wall = time.perf_counter() - t0
    rss_after = peak_rss_mib()

    expected = -(-n // k)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; seed perceptron, sgd({SEED_LR})")
    print(f"steps              {n:,} in one fused call (record_every={k})")
    print(f"compile + 1 step   {compile_s:.2f} s")
    print(f"wall time          {wall:.3f} s")
    print(f"per step           {wall / n * 1e6:.3f} us")
    print(f"peak RSS before    {rss_before:.1f} MiB")
    print(f"peak RSS after     {rss_after:.1f} MiB  (+{rss_after - rss_before:.1f} MiB)")
    print(f"trace              {trace!r}")
    print(f"trace points       {len(trace.loss)} (expected {expected}); index "
          f"{trace.index[0]}, {trace.index[1]}, ..., {trace.index[-1]}")
    print(f"loss               first {trace.loss[0]:.6f}, last {trace.loss[-1]:.6f}; "
          f"state.step {int(final.step):,}")
    ok = (len(trace.loss) == expected and trace.steps == n and trace.stop is Stop.STEPS
          and int(final.step) == n and np.all(np.isfinite(trace.loss))
          and list(trace.index[:2]) == [0, k])
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
