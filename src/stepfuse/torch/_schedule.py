"""An lr scheduler stepped after every update inside a call (``fuse(lr_scheduler=...)``).

The plain loop steps a per-batch scheduler after each update: ``optimizer.step();
scheduler.step()``. torch's schedulers are Python objects, so the fused program cannot call
them; it reads each step's ``lr`` from a table instead (`stepfuse.torch._program.Body.rates`).
`Schedule.ahead` fills the table for a segment's steps by stepping a copy of the scheduler
(``copy.deepcopy`` with the optimizer kept, not copied: only the scheduler's own state is
copied) and puts the groups' ``lr`` back; after the segment, `Schedule.advance` steps the
user's scheduler once per update applied (a call stopped early by ``tol`` or a non-finite
step steps it as often as the plain loop would have). The stepwise mode steps it after each
applied update (`advance(1)`), so both modes leave it as the plain loop does.

A scheduler that changes other hyper-parameters than ``lr`` (``OneCycleLR`` / ``CyclicLR``
with ``cycle_momentum``) cannot run inside the program, whose other hyper-parameters are
constants: `Schedule.ahead` returns why, and the fit runs stepwise.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import torch

from .._core.options import Described, a_type, fail
from ._rules import rates

__all__ = ["Schedule", "check_scheduler"]


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Raise for an ``lr_scheduler`` the fit cannot step after each update."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if isinstance(scheduler, ReduceLROnPlateau):
        fail(
            TypeError,
            "lr_scheduler",
            Described("ReduceLROnPlateau", scheduler),
            "a scheduler stepped without arguments after each update (LambdaLR, "
            "OneCycleLR, CosineAnnealingLR, SequentialLR ...)",
            "ReduceLROnPlateau steps on a metric: leave it out of fuse and step it between "
            "calls yourself, e.g. scheduler.step(float(trace.loss[-1])); the fit reads each "
            "call's lr.",
        )
    if not isinstance(scheduler, LRScheduler):
        fail(
            TypeError,
            "lr_scheduler",
            Described(a_type(scheduler), scheduler),
            "a torch.optim.lr_scheduler.LRScheduler (LambdaLR, OneCycleLR, ...)",
            "Pass a scheduler built over the fit's optimizer, or None.",
        )
    if scheduler.optimizer is not optimizer:
        fail(
            ValueError,
            "lr_scheduler",
            Described(f"a {type(scheduler).__name__} over another optimizer", scheduler),
            "a scheduler over the optimizer given to fuse",
            "Build it over the same optimizer: Scheduler(optimizer, ...).",
        )


def _others(groups: list[dict]) -> list[dict]:
    """Each group's entries but ``lr`` and the parameters (what the program compiles in)."""
    return [
        {
            k: (v.tolist() if isinstance(v, torch.Tensor) else v)
            for k, v in g.items()
            if k not in ("params", "lr")
        }
        for g in groups
    ]


class Schedule:
    """``scheduler`` over ``optimizer``, stepped after every update of the fit."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer):
        self.scheduler, self.optimizer = scheduler, optimizer

    def ahead(self, m: int) -> np.ndarray | str:
        """The ``lr`` of each group at each of the next ``m`` steps (``(m, groups)``,
        float64), read from a copy of the scheduler; the user's scheduler and the groups
        are left as they were. A string: why the steps cannot run in the program."""
        groups = self.optimizer.param_groups
        held = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in groups]
        before = _others(groups)
        rows = [rates(groups)]
        try:
            if m > 1:
                try:
                    twin = copy.deepcopy(self.scheduler, {id(self.optimizer): self.optimizer})
                except Exception as e:  # noqa: BLE001 - any: it cannot be read ahead
                    return (
                        f"lr_scheduler ({type(self.scheduler).__name__}) could not be copied "
                        f"to read its lr ahead ({type(e).__name__}: {e}), so the fit steps it "
                        "stepwise, after each update, as the plain loop does."
                    )
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # ("before optimizer.step()")
                    for _ in range(m - 1):
                        twin.step()
                        rows.append(rates(groups))
                        if _others(groups) != before:
                            return self._why(before, _others(groups))
        finally:
            for g, v in zip(groups, held):
                if isinstance(g["lr"], torch.Tensor) and isinstance(v, torch.Tensor):
                    g["lr"].copy_(v)
                else:
                    g["lr"] = v
            for g, o in zip(groups, before):
                g.update({k: o[k] for k in o if not isinstance(g.get(k), torch.Tensor)})
        return np.asarray(rows, dtype=np.float64)

    def _why(self, before: list[dict], now: list[dict]) -> str:
        changed = sorted({k for b, n in zip(before, now) for k in n if b.get(k) != n[k]})
        name = type(self.scheduler).__name__
        return (
            f"lr_scheduler ({name}) changes {', '.join(changed)} at its steps, not only lr; "
            "the fused program reads each step's lr from a table but compiles the other "
            "hyper-parameters in, so the fit steps it stepwise, after each update, as the "
            "plain loop does. OneCycleLR and CyclicLR change momentum (or Adam's betas) "
            "unless given cycle_momentum=False."
        )

    def advance(self, k: int) -> None:
        """Step the user's scheduler once per update applied (``k``), as the plain loop's
        ``scheduler.step()`` after each ``optimizer.step()``."""
        if k:
            self.optimizer._opt_called = True  # type: ignore[attr-defined]  # (it stepped)
            for _ in range(k):
                self.scheduler.step()
