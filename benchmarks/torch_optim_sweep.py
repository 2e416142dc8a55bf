"""Every ``torch.optim`` optimizer and option of torch's own test database, fused.

For each CPU configuration that ``torch.testing._internal.common_optimizers.optim_db``
lists (its ``optim_inputs_func``; SparseAdam left out: it needs sparse gradients), the
seed perceptron is fitted ``steps`` steps by `stepfuse.torch.fuse` in ``calls`` calls
and by the plain loop ``optimizer.zero_grad(); loss.backward(); optimizer.step()`` (with
a closure for LBFGS), and the losses, parameters and whole ``optimizer.state`` compared.

Each configuration is one of:

- ``exact``: fused, within 1e-6 relative (1e-7 absolute) of the plain loop;
- ``3x-f64``: fused, further apart, but the fused error against a float64 plain loop is at
  most 3x the plain float32 loop's (the project's rule for rounding differences);
- ``fallback``: ran stepwise with a warning; its reason is printed;
- ``WRONG``: fused and neither of the above, or stepwise and not equal to the plain loop.

Run: ``python benchmarks/torch_optim_sweep.py [--only NAME ...] [--steps 6 --calls 2]``;
Needs ``expecttest`` (torch's test database imports it). Each fused configuration
compiles one program.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import stepfuse.torch as sft
from stepfuse.problems import blobs, perceptron_init

RTOL, ATOL = 1e-6, 1e-7


class Config(NamedTuple):
    cls: type
    desc: str
    kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.cls.__name__}[{self.desc}]"


def configs(only: tuple[str, ...] = ()) -> list[Config]:
    """The CPU configurations of torch's ``optim_db`` (SparseAdam left out)."""
    from torch.testing._internal.common_optimizers import optim_db

    out = []
    for info in optim_db:
        cls = info.optim_cls
        if cls is torch.optim.SparseAdam or (only and cls.__name__ not in only):
            continue
        fn = info.optim_inputs_func
        kw: dict[str, Any] = {"device": "cpu"}
        if "dtype" in inspect.signature(fn).parameters:
            kw["dtype"] = torch.float32
        for oi in fn(**kw):
            if oi.params is None:
                out.append(Config(cls, oi.desc, dict(oi.kwargs)))
    return out


def _model(dtype: torch.dtype) -> nn.Module:
    init = perceptron_init()
    m = nn.Linear(2, 2).to(dtype)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(init["kernel"].T))
        m.bias.copy_(torch.from_numpy(init["bias"]))
    return m


def problem(config: Config, dtype: torch.dtype = torch.float32):
    """(model, optimizer, loss_fn, batch): Muon, for 2-D parameters only, holds the
    weight (the bias enters the loss as a constant)."""
    x_np, y_np = blobs()
    x, y = torch.from_numpy(x_np).to(dtype), torch.from_numpy(y_np).long()
    model = _model(dtype)
    params = [model.weight] if config.cls is torch.optim.Muon else list(model.parameters())
    kwargs = {
        k: (v.to(dtype) if isinstance(v, torch.Tensor) and dtype == torch.float64 else v)
        for k, v in copy.deepcopy(config.kwargs).items()
    }
    optimizer = config.cls(params, **kwargs)

    def loss_fn(x, y):
        return F.cross_entropy(model(x), y)

    return model, optimizer, loss_fn, (x, y)


def plain_loop(model, optimizer, loss_fn, batch, steps: int) -> list[float]:
    """torch's own loop: zero_grad / backward / step (step(closure) where it needs one)."""
    losses = []
    for _ in range(steps):

        def closure():
            optimizer.zero_grad()
            loss = loss_fn(*batch)
            loss.backward()
            return loss

        if isinstance(optimizer, torch.optim.LBFGS):
            loss = closure()
            optimizer.step(closure)
        else:
            loss = closure()
            optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def flat(model, optimizer) -> dict[str, np.ndarray]:
    """Parameters and the whole optimizer state, by name, as float64 arrays."""
    out = {
        f"param{i}": p.detach().double().numpy().copy() for i, p in enumerate(model.parameters())
    }
    for i, p in enumerate(model.parameters()):
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"state{i}.{k}"] = v.detach().double().cpu().numpy().copy()
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"state{i}.{k}"] = np.asarray(v, np.float64)
            else:  # LBFGS's history lists and the like: compared as their repr
                out[f"state{i}.{k}"] = np.asarray(hash(repr(v)) % 1000, np.float64)
    return out


def _max_diff(a: dict, b: dict) -> tuple[float, bool]:
    """(max |a - b|, whether all within RTOL / ATOL); differing keys or shapes: inf."""
    if set(a) != set(b):
        return float("inf"), False
    worst, ok = 0.0, True
    for k in a:
        if a[k].shape != b[k].shape:
            return float("inf"), False
        d = np.abs(a[k] - b[k])
        worst = max(worst, float(d.max(initial=0.0)))
        ok &= bool(np.all(d <= ATOL + RTOL * np.abs(b[k])))
    return worst, ok


def _err(a: dict, ref: dict) -> float:
    return max(float(np.abs(a[k] - ref[k]).max(initial=0.0)) for k in ref)


class Row(NamedTuple):
    name: str
    verdict: str
    mode: str
    diff: float
    reason: str
    compiles: int
    seconds: float


def check(config: Config, steps: int = 6, calls: int = 2, chunk: int = 1) -> Row:
    """One configuration: fused over ``calls`` calls against the plain loop."""
    t0 = time.perf_counter()
    model, opt, loss_fn, batch = problem(config)
    ref_losses = plain_loop(model, opt, loss_fn, batch, steps)
    ref = flat(model, opt)

    model, opt, loss_fn, batch = problem(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fit = sft.fuse(loss_fn, opt, steps=steps // calls, model=model, chunk=chunk)
            losses = [float(v) for _ in range(calls) for v in fit(*batch).loss]
        except Exception as e:  # noqa: BLE001 - a configuration that errors is reported
            msg = f"{type(e).__name__}: {e}".splitlines()[0]
            return Row(config.name, "ERROR", "-", float("nan"), msg, 0, time.perf_counter() - t0)
    reason = fit.fallback_reason or "; ".join(
        str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
    )
    got = flat(model, opt)
    got["losses"], ref["losses"] = np.asarray(losses), np.asarray(ref_losses)
    diff, ok = _max_diff(got, ref)
    if ok:
        verdict = "exact" if fit.mode == "fused" else "fallback"
    elif fit.mode == "fused" and diff < float("inf"):
        m64, o64, l64, b64 = problem(config, torch.float64)
        l64s = plain_loop(m64, o64, l64, b64, steps)
        ref64 = flat(m64, o64)
        ref64["losses"] = np.asarray(l64s)
        ref.pop("losses")
        got_err, eager_err = (
            _err(got, ref64),
            _err({**ref, "losses": np.asarray(ref_losses)}, ref64),
        )
        verdict = "3x-f64" if got_err <= 3 * eager_err else "WRONG"
    else:
        verdict = "WRONG"
    return Row(
        config.name, verdict, fit.mode, diff, reason or "", fit.compiles, time.perf_counter() - t0
    )


def main(argv: list[str] | None = None, out: Callable[[str], Any] = print) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=(), help="optimizer class names")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1)
    args = ap.parse_args(argv)
    return _sweep(args, out)


def _sweep(args: argparse.Namespace, out: Callable[[str], Any]) -> list[Row]:
    rows = []
    out(f"{'config':<62} {'verdict':<9} {'mode':<9} {'max|diff|':>10} compiles  reason")
    for config in configs(tuple(args.only)):
        row = check(config, args.steps, args.calls, args.chunk)
        rows.append(row)
        reason = row.reason.replace("\n", " ")
        out(
            f"{row.name:<62} {row.verdict:<9} {row.mode:<9} {row.diff:>10.2e} "
            f"{row.compiles:>8}  {reason[:160]}"
        )
        sys.stdout.flush()
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    out("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return rows


if __name__ == "__main__":
    main()
