"""The torch program with and without `stepfuse.torch._scalars.RealizeScalars`, side by side.

Two fits of the same model, optimizer and `Epochs` in one process: one compiled with the
pass (the default: a step's scalars, Adam's bias corrections, computed once a step), one
without (inductor inlines them into every parameter's update loop). Calls alternate; the
best of ``--rounds`` is printed in microseconds a step, with the losses and parameters of
the two compared (the pass moves where the scalars are computed, not what they are).

Usage:
  python benchmarks/torch_scalars.py [--problems small mnist] [--steps 1024] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import stepfuse as sf  # noqa: E402
import stepfuse.torch as sft  # noqa: E402
from stepfuse.bench import data as bench_data  # noqa: E402
from stepfuse.torch import _program  # noqa: E402

PASS = "post_grad_custom_post_pass"


def build(name: str, steps: int, with_pass: bool) -> tuple[Any, nn.Module, Any]:
    """A compiled fit (the first call compiles it) with or without the pass."""
    xn, yn, bs, (d, h, k) = bench_data.dataset(f"data-{name}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, k))
    opt = torch.optim.Adam(model.parameters(), lr=bench_data.LR)
    fit = sft.fuse(lambda a, b: F.cross_entropy(model(a), b), opt, steps=steps, model=model)
    data = sf.Epochs(torch.from_numpy(xn), torch.from_numpy(yn).long(), batch_size=bs, seed=0)
    kept = _program.INDUCTOR_OPTIONS.pop(PASS)
    try:
        if with_pass:
            _program.INDUCTOR_OPTIONS[PASS] = kept
        fit(data)
    finally:
        _program.INDUCTOR_OPTIONS[PASS] = kept
    return fit, model, data


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", nargs="+", default=["small", "mnist"], choices=["small", "mnist"])
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    rows = []
    print(f"{'problem':8} {'program':18} {'us/step':>9}  note")
    for name in args.problems:
        runs = {
            who: build(name, args.steps, who == "with the pass")
            for who in ("with the pass", "without")
        }
        best, last = dict.fromkeys(runs, float("inf")), {}
        for _ in range(args.rounds):
            for who, (fit, _, data) in runs.items():
                t0 = time.perf_counter()
                last[who] = fit(data).loss
                best[who] = min(best[who], (time.perf_counter() - t0) / args.steps)
        (_, a, _), (_, b, _) = runs.values()
        same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        same = same and bool((last["with the pass"] == last["without"]).all())
        for who, s in best.items():
            note = f"{best['without'] / s:.2f}x faster" if who == "with the pass" else ""
            print(f"{name:8} {who:18} {s * 1e6:9.1f}  {note}")
            rows.append(
                {"problem": name, "program": who, "us_per_step": s * 1e6, "mode": runs[who][0].mode}
            )
        print(f"{name:8} losses and parameters bitwise equal: {same}")
        rows[-1]["bitwise_equal"] = rows[-2]["bitwise_equal"] = same
    return rows


if __name__ == "__main__":
    main()
