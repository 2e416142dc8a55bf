"""A 1,000,000-step fused call on the seed perceptron (PyTorch): memory stays flat, the trace is thinned.

One ``fit(x, y)`` call runs every step in the compiled program (as segments of at most
``stepfuse.torch._SEGMENT`` steps per program call, see `FusedFit._cap`); with
``record_every=1000`` the trace holds 1,000 float32 losses (4 kB) whatever the number of
steps. Prints the peak RSS (``resource.getrusage``) before and after the call, the wall
time of the call (compiled beforehand) and the time per step; exits 1 if a check fails.

Run:  python benchmarks/long_run_torch.py [--steps 1000000] [--record-every 1000]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import stepfuse.torch as sf  # noqa: E402
from stepfuse import Stop  # noqa: E402
from stepfuse.problems import SEED_LR, blobs, perceptron_init  # noqa: E402


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

    xn, yn = blobs()
    x, y = torch.from_numpy(xn), torch.from_numpy(yn).long()
    init = perceptron_init()
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(init["kernel"].T))
        model.bias.copy_(torch.from_numpy(init["bias"]))
    opt = torch.optim.SGD(model.parameters(), lr=SEED_LR)
    fit = sf.fuse(lambda x, y: F.cross_entropy(model(x), y), opt, steps=n, record_every=k)

    t0 = time.perf_counter()
    warm = fit(x, y, steps=2)  # compiles the one program used below
    compile_s = time.perf_counter() - t0
    with torch.no_grad():  # back to the seed's start so the trace starts at ln 2
        model.weight.copy_(torch.from_numpy(init["kernel"].T))
        model.bias.zero_()
    opt.state.clear()
    start = fit.step
    rss_before = peak_rss_mib()

    t0 = time.perf_counter()
    trace = fit(x, y)  # the 1M-step call: same program
    wall = time.perf_counter() - t0
    rss_after = peak_rss_mib()

    expected = -(-n // k)
    print(f"torch {torch.__version__} on cpu ({torch.get_num_threads()} threads); seed perceptron, "
          f"SGD({SEED_LR}); mode={fit.mode}, compiles={fit.compiles}")
    print(f"steps              {n:,} in one fused call (record_every={k})")
    print(f"compile + 2 steps  {compile_s:.2f} s")
    print(f"wall time          {wall:.3f} s")
    print(f"per step           {wall / n * 1e6:.3f} us")
    print(f"peak RSS before    {rss_before:.1f} MiB")
    print(f"peak RSS after     {rss_after:.1f} MiB  (+{rss_after - rss_before:.1f} MiB)")
    print(f"trace              {trace!r}")
    print(f"trace points       {len(trace.loss)} (expected {expected}); index "
          f"{trace.index[0]}, {trace.index[1]}, ..., {trace.index[-1]}")
    print(f"loss               first {trace.loss[0]:.6f}, last {trace.loss[-1]:.6f}; "
          f"fit.step {fit.step - start:,}")
    ok = (warm.steps == 2 and fit.mode == "fused" and fit.compiles == 1
          and len(trace.loss) == expected and trace.steps == n and trace.stop is Stop.STEPS
          and fit.step - start == n and bool(np.all(np.isfinite(trace.loss)))
          and list(trace.index[:2]) == [0, k] and abs(trace.loss[0] - np.log(2)) < 1e-6
          and rss_after - rss_before < 50)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
