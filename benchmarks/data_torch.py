"""PyTorch data streams: stepfuse over `Epochs` vs the eager loop over a shuffling DataLoader.

Both train the same tanh MLP with Adam (lr 1e-3) on the same 8192 resident synthetic rows,
in one process, side by side:

- ``stepfuse Epochs``: ``fit(sf.Epochs(x, y, batch_size=B), steps=N)``, one fused call
  (the dataset on the device once, reshuffled on the device every epoch); the first call,
  which compiles, is not timed;
- ``eager DataLoader``: ``for xb, yb in DataLoader(TensorDataset(x, y), batch_size=B,
  shuffle=True, drop_last=True): zero_grad(); loss.backward(); step()``, epoch after epoch.

Problems: ``small`` (MLP 32-64-10, batch 32) and ``mnist`` (MLP 784-256-10, batch 128).
Prints microseconds per step and each one's time over stepfuse's, best of ``--repeats``.

Seen on the 2-core shared CPU VM (torch 2.13 CPU, 2 threads), 2048 steps (eager timed over
512), best of 3, 2026-12-05:
  small: stepfuse 69.2 us/step, eager DataLoader 858.8 us/step (12.4x)
  mnist: stepfuse 1523.9 us/step, eager DataLoader 2904.9 us/step (1.9x)
(an earlier run, 2026-12-04: small 45.8 against 480.2, 10.5x; this VM's timings vary by tens
of percent from run to run, compare ratios within one run). On mnist the time is the fused
step's own: its forward and backward pass alone took 873 us a step (2026-12-04), so 3x over
today's DataLoader loop (968 us a step) would leave ~95 us for Adam's update of the 200k
parameters and the finite check: not reached.

Usage:
  python benchmarks/data_torch.py [--problems small mnist] [--steps 2048] [--eager-steps 512]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import stepfuse as sf  # noqa: E402
import stepfuse.torch as sft  # noqa: E402

PROBLEMS = {"small": ((32, 64, 10), 32), "mnist": ((784, 256, 10), 128)}
"""name -> ((inputs, hidden, classes), batch size)."""
ROWS = 8192


def _problem(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, int]:
    (d, h, k), bs = PROBLEMS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, d, generator=g)
    y = torch.randint(0, k, (ROWS,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, k))
    return model, x, y, bs


def stepfuse_epochs(name: str, n: int) -> tuple[Callable[[int], Any], Any]:
    """``run(m)``: ``m`` steps in one fused call over `Epochs` (compiled by the first call)."""
    model, x, y, bs = _problem(name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    fit = sft.fuse(lambda a, b: F.cross_entropy(model(a), b), opt, steps=n, model=model)
    data = sf.Epochs(x, y, batch_size=bs, seed=0)

    def run(m: int) -> Any:
        return fit(data, steps=m).loss[-1]

    return run, fit


def eager_dataloader(name: str) -> Callable[[int], Any]:
    """``run(m)``: ``m`` eager steps over a shuffling DataLoader, epoch after epoch."""
    model, x, y, bs = _problem(name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=bs, shuffle=True, drop_last=True
    )

    def run(m: int) -> Any:
        done, loss = 0, None
        while done < m:
            for xb, yb in loader:
                opt.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
                done += 1
                if done == m:
                    break
        return float(loss.detach())  # type: ignore[union-attr]

    return run


def _best(run: Callable[[int], Any], m: int, repeats: int) -> float:
    """Best seconds per step of ``run(m)`` over ``repeats`` timed calls."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(m)
        best = min(best, (time.perf_counter() - t0) / m)
    return best


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    ap.add_argument("--steps", type=int, default=2048, help="steps per timed stepfuse call")
    ap.add_argument("--eager-steps", type=int, default=512, help="steps per timed eager call")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    rows = []
    print(
        f"stepfuse.torch data streams, {ROWS} rows, Adam 1e-3 ({torch.get_num_threads()} threads)"
    )
    print(f"{'problem':8} {'contender':18} {'us/step':>10} {'/stepfuse':>9}  note")
    for name in args.problems:
        run, fit = stepfuse_epochs(name, args.steps)
        t0 = time.perf_counter()
        run(args.steps)  # compiles
        build = time.perf_counter() - t0
        fused = _best(run, args.steps, args.repeats)
        eager = _best(eager_dataloader(name), args.eager_steps, args.repeats)
        note = f"mode={fit.mode}, compiles={fit.compiles}, first call {build:.1f} s"
        for who, s, extra in (("stepfuse Epochs", fused, note), ("eager DataLoader", eager, "")):
            print(f"{name:8} {who:18} {s * 1e6:10.1f} {s / fused:8.1f}x  {extra}")
            rows.append({"problem": name, "contender": who, "us_per_step": s * 1e6})
        rows[-2]["mode"] = fit.mode
        rows[-1]["slower_than_stepfuse"] = eager / fused
    return rows


if __name__ == "__main__":
    main()
