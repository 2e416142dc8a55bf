"""The plain loop's step, eagerly: ``loss.backward(); optimizer.step()``.

It runs the stepwise mode, a fused call's first step (torch creates the optimizer state in
its first ``step()``) and the check of a program that draws random numbers
(`stepfuse.torch._probe.check_draws`). A step is proposed and undone (`propose`); the
driver commits it (`stepfuse.torch.Fit._commit`) only when it is finite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ._probe import hold_buffers
from ._state import all_finite, host_loss, put_back, restore, snapshot

__all__ = ["host_losses", "loss_and_grads", "propose"]


def loss_and_grads(
    loss_fn: Callable[..., torch.Tensor],
    params: Sequence[torch.Tensor],
    clip: tuple[float | None, float | None],
    batch: tuple,
) -> torch.Tensor:
    """The loss at the current parameters, their ``.grad`` set to its gradient (clipped as
    ``clip = (max_norm, clip_value)`` says, between ``backward()`` and ``step()``)."""
    with torch.enable_grad():
        for p in params:
            p.grad = None
        loss = loss_fn(*batch)
        loss.backward()
    norm, value = clip  # between backward() and step(), as a plain loop clips
    if norm is not None:
        torch.nn.utils.clip_grad_norm_(params, norm)
    if value is not None:
        torch.nn.utils.clip_grad_value_(params, value)
    return loss.detach()


def propose(
    loss_fn: Callable[..., torch.Tensor],
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    modules: Sequence[nn.Module],
    clip: tuple[float | None, float | None],
    closure: bool,
    batch: tuple,
) -> tuple[np.generic, bool, Any]:
    """One step of the plain loop, undone: ``(loss, finite, (new params, new state))``;
    the modules' buffers stay as the step left them unless it is refused (non-finite).
    ``closure``: ``optimizer.step`` takes one (`stepfuse.torch._probe.needs_closure`)."""
    held = hold_buffers(modules)
    loss = loss_and_grads(loss_fn, params, clip, batch)
    finite = bool(torch.isfinite(loss)) and all_finite(p.grad for p in params)
    if not finite:  # refused: the buffers too stay as before the step
        put_back(held)
        return host_loss(loss), False, None
    old_p = [p.detach().clone() for p in params]
    old_s = snapshot(opt, params)

    def undo():  # parameters and state as before this step
        with torch.no_grad():
            for p, v in zip(params, old_p):
                p.copy_(v)
        restore(opt, params, old_s)

    try:
        if closure:  # e.g. LBFGS, which re-evaluates the loss within its step
            opt.step(lambda: loss_and_grads(loss_fn, params, clip, batch))  # type: ignore[arg-type,return-value]
        else:
            opt.step()
    except BaseException:
        undo()
        raise
    new_p = [p.detach().clone() for p in params]
    new_s = snapshot(opt, params)
    finite = all_finite(new_p) and all_finite(v for d in new_s.values() for v in d.values())
    undo()
    if not finite:
        put_back(held)
    return host_loss(loss), finite, (new_p, new_s)


def host_losses(buf: torch.Tensor, kept: int) -> np.ndarray:
    """The first ``kept`` losses of a program's loss buffer on the host: float64 stays,
    any other float (bfloat16 too) as float32 (a CPU buffer of either is read in place:
    `host_trace` copies what it keeps)."""
    if buf.device.type == "cpu" and buf.dtype in (torch.float32, torch.float64):
        return buf.numpy()[:kept]
    wide = buf.dtype == torch.float64
    return buf[:kept].detach().to("cpu", torch.float64 if wide else torch.float32).numpy()
