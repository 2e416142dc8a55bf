"""`fuse`: the PyTorch backend's entry point, checking its arguments and building a `Fit`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._core import check_int, check_options
from .._core.options import shared_doc
from ._fit import Fit
from ._probe import check_arguments, check_clip
from ._schedule import check_scheduler

__all__ = ["fuse"]

_MODES = ("fused", "stepwise")


@shared_doc
def fuse(
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    model: nn.Module | None = None,
    tol: float | None = None,
    record_every: int = 1,
    callback: Callable[[int, float], Any] | None = None,
    every: int | None = None,
    progress: bool = False,
    on_nonfinite: str = "stop",
    mode: str = "fused",
    eval_fn: Callable[..., Any] | None = None,
    eval_every: int | None = None,
    chunk: int | None = None,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    lr_scheduler: Any = None,
) -> Fit:
    """Build a fused fit that runs ``steps`` ``torch.optim`` updates per call.

    Args:
      loss_fn: ``loss_fn(*batch) -> scalar tensor``; it uses the model (e.g. a closure).
      optimizer: a ``torch.optim.Optimizer`` over the model's parameters. The fused mode
        runs every ``torch.optim`` optimizer but LBFGS and SparseAdam with
        torch's own update functions; those, and optimizers from elsewhere, run stepwise
        with a warning that says why.
      model: the ``nn.Module`` holding the parameters; found automatically when
        ``loss_fn`` closes over it (or reads it as a global).
      {options}
      chunk: steps per iteration of the compiled loop, i.e. copies of the step in the
        compiled program (fixed, whatever ``steps`` is). Compile time grows with it, the
        loop's per-step overhead shrinks, and the steps of the last iteration after the
        call's end are computed and discarded. None (default): 4 for a tiny step (a few
        microseconds: the seed's perceptron), 1 otherwise, chosen on the first call by
        counting one forward pass (``fit.plan`` says which and why; measurements: the
        docs' torch internals page); 4 on CUDA, whose graphs replay many chunks at once.
        A ``loss_fn`` that draws random numbers (dropout) runs with ``chunk=1``: every
        step of a chunk runs its forward pass, so the masked steps after a call's last
        one would draw masks the plain loop never draws.
      clip_grad_norm: clip the gradients at each step as ``torch.nn.utils.clip_grad_norm_(
        params, clip_grad_norm)`` between ``backward()`` and ``step()`` (both modes).
      clip_grad_value: likewise ``clip_grad_value_(params, clip_grad_value)`` (after the
        norm's clipping where both are given). None (default): no clipping.
      lr_scheduler: a ``torch.optim.lr_scheduler`` scheduler over ``optimizer`` to step
        after every update, as the plain loop's ``optimizer.step(); scheduler.step()``
        (a per-batch schedule: warm-up, ``OneCycleLR``, ``LambdaLR`` ...): the fused
        program reads each step's ``lr`` from a table the scheduler fills, and the
        scheduler ends each call stepped once per update applied. None (default): the
        ``lr`` of each call is the groups' ``lr`` at its start (a scheduler stepped by hand
        between calls changes it: no compile either way). One that changes other
        hyper-parameters than ``lr`` (``cycle_momentum``) runs stepwise, saying why.

    Returns:
      A `Fit`; ``trace = fit(*batch, steps=None)``.

    Example:
      >>> model = torch.nn.Linear(2, 2)
      >>> def loss_fn(x, y):
      ...     return torch.nn.functional.cross_entropy(model(x), y)
      >>> fit = fuse(loss_fn, torch.optim.SGD(model.parameters(), lr=0.01), steps=3)
      >>> trace = fit(x, y)            # 3 updates, one compiled call
    """
    shared = (steps, tol, record_every, callback, every, progress, on_nonfinite, mode)
    opts = check_options(*shared, _MODES, eval_fn, eval_every)
    check_arguments(loss_fn, optimizer, model)
    clip = (
        check_clip(clip_grad_norm, "clip_grad_norm"),
        check_clip(clip_grad_value, "clip_grad_value"),
    )
    if chunk is not None:
        chunk = check_int(
            chunk, "chunk", "Pass the steps per compiled loop iteration, e.g. chunk=4."
        )
    if lr_scheduler is not None:
        check_scheduler(lr_scheduler, optimizer)
    return Fit(loss_fn, optimizer, opts, model, chunk, clip, lr_scheduler)
