"""torch lr schedules: stepfuse with an ``lr_scheduler`` against the plain loop, side by side.

One process, the data issue's ``small`` and ``mnist`` problems on one resident minibatch
(MLP, Adam 1e-3, a warm-up ``LambdaLR`` over the first 100 steps), timed in interleaved
rounds, the best of ``--rounds`` printed in microseconds a step:

- ``plain loop``: ``zero_grad; backward; optimizer.step(); scheduler.step()`` per step;
- ``stepfuse lr_scheduler=``: the scheduler stepped after every update inside the call
  (`stepfuse.torch._schedule`);
- ``stepfuse, scheduler between calls``: no ``lr_scheduler``, the scheduler stepped by
  hand after each call (each call's lr an input of the program);
- ``stepfuse, no scheduler``: the floor.

It also prints each fit's compiles after all rounds (one each: a new lr compiles nothing)
and the largest parameter difference of the scheduled fit from the plain loop after the
same steps.

Usage:
  python benchmarks/torch_lr_schedule.py [--problems small mnist] [--steps 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import stepfuse.torch as sft  # noqa: E402
from stepfuse.bench import data as bench_data  # noqa: E402


def _setup(name: str):
    xn, yn, bs, (d, h, k) = bench_data.dataset(f"data-{name}")
    x, y = torch.from_numpy(xn[:bs]), torch.from_numpy(yn[:bs]).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, k))
    opt = torch.optim.Adam(model.parameters(), lr=bench_data.LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    return model, opt, sched, x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", nargs="+", default=["small", "mnist"])
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.steps
    for name in args.problems:
        runs = {}
        m0, o0, s0, x, y = _setup(name)

        def plain(m0=m0, o0=o0, s0=s0, x=x, y=y):
            for _ in range(n):
                o0.zero_grad()
                F.cross_entropy(m0(x), y).backward()
                o0.step()
                s0.step()

        runs["plain loop"] = plain
        fits = {}
        for label, inside, by_hand in [
            ("stepfuse lr_scheduler=", True, False),
            ("stepfuse, scheduler between calls", False, True),
            ("stepfuse, no scheduler", False, False),
        ]:
            m, o, s, _, _ = _setup(name)
            fit = sft.fuse(
                lambda a, b, m=m: F.cross_entropy(m(a), b),
                o,
                steps=n,
                model=m,
                lr_scheduler=s if inside else None,
            )
            fit(x, y)  # compile
            fits[label] = (fit, m)

            def run(fit=fit, s=s, by_hand=by_hand):
                fit(x, y)
                if by_hand:
                    s.step()

            runs[label] = run
        plain()  # the plain loop's first steps (and its lazily built state)
        best = {k: float("inf") for k in runs}
        for _ in range(args.rounds):
            for label, run in runs.items():
                t = time.perf_counter()
                run()
                best[label] = min(best[label], (time.perf_counter() - t) / n * 1e6)
        base = best["stepfuse lr_scheduler="]
        print(f"== {name}: {n} steps a call, best of {args.rounds} rounds, us/step")
        for label, us in best.items():
            print(f"  {label:36s} {us:10.1f}  ({us / base:.2f}x the lr_scheduler fit)")
        for label, (fit, _) in fits.items():
            print(f"  {label:36s} mode={fit.mode} compiles={fit.compiles}")
        fm = fits["stepfuse lr_scheduler="][1]
        diff = max((a - b).abs().max().item() for a, b in zip(fm.parameters(), m0.parameters()))
        print(f"  lr_scheduler fit against the plain loop, same steps: max |dparam| {diff:.2e}")


if __name__ == "__main__":
    main()
