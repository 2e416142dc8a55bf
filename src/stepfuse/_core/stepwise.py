"""The stepwise reference loop: the shared semantics as a plain Python loop of single steps.

A backend's ``mode="stepwise"`` supplies two functions and `run_stepwise` runs them:

* ``propose()`` evaluates the loss and gradient at the current parameters and
  computes the update *without* applying it; it returns ``(loss, finite, token)``
  where ``loss`` is a NumPy scalar (a float64 loss is recorded as float64, any other
  float as float32, as the fused loops record it) and ``finite`` says whether the loss,
  the gradients and the proposed parameters and optimizer state are all finite;
* ``commit(token)`` applies the proposed update;

and, for a fit built with ``eval_fn``, ``evaluate()``, which runs ``eval_fn`` on the call's
``eval_batch`` at the current parameters and returns what it returned (a scalar or a dict of
scalars, as NumPy or Python numbers), after each update that brings the fit's step count to
a multiple of ``eval_every`` (`stepfuse._core.evaluation`).

It moves the same `Flow` with the same functions (`stepfuse._core.loop`) as every
fused loop, over Python numbers, so fused == stepwise is one definition run two ways.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from . import loop
from .driver import user_stacklevel
from .evaluation import eval_due, eval_values, host_evals
from .loop import HOST, Flow
from .options import Options
from .trace import NonFiniteError, Stop, Trace, host_trace

__all__ = ["run_stepwise", "finish"]


def run_stepwise(
    propose: Callable[[], tuple[Any, bool, Any]],
    commit: Callable[[Any], None],
    n: int,
    opts: Options,
    start_step: int,
    notify: Callable[[int, float], None] | None = None,
    evaluate: Callable[[], Any] | None = None,
) -> Trace:
    """Run ``n`` single steps with the shared semantics; returns the host `Trace`
    (``evaluate``: the fit's evaluation, run at the steps `eval_due` names)."""
    met = None if opts.tol is None else loop.within_tol(HOST, opts.tol, np.float64)
    losses: list[float] = []
    flow, wide = Flow(0, 0.0, math.nan, math.nan), False
    eval_steps: list[int] = []
    eval_series: dict[str, list[Any]] = {}
    while loop.running(HOST, flow, n, met):
        loss, finite, token = propose()
        wide = wide or np.asarray(loss).dtype == np.float64
        value = float(loss)
        if flow.i % opts.record_every == 0:
            losses.append(value)
        flow = loop.advance(flow, value, 0.0 if finite else math.nan)
        if loop.refused(HOST, flow):
            break
        commit(token)
        step = start_step + loop.applied(HOST, flow)
        if evaluate is not None and opts.eval_every and eval_due(step, opts.eval_every):
            eval_steps.append(step)
            for name, v in eval_values(evaluate()).items():
                eval_series.setdefault(name, []).append(v)
        if notify is not None and step % (opts.every or 1) == 0:
            notify(step, value)
    evals = None
    if evaluate is not None:
        evals = host_evals(eval_steps, eval_series, len(eval_steps))
    return host_trace(
        np.asarray(losses, dtype=np.float64 if wide else np.float32),
        loop.applied(HOST, flow),
        loop.stop_code(HOST, flow, met),
        opts.record_every,
        evals,
    )


def finish(trace: Trace, opts: Options, start_step: int, state: Any = None) -> Trace:
    """Apply ``on_nonfinite="raise"`` once a call has returned with a consistent state
    (``state``: what a pure backend's call reached, handed to the error)."""
    if opts.on_nonfinite == "raise" and trace.stop == Stop.NONFINITE:
        raise NonFiniteError(start_step + int(trace.steps), trace, state)
    if trace.stop == Stop.NONFINITE and int(trace.steps) == 0:
        stuck(trace, start_step)
    return trace


def stuck(trace: Trace, step: int) -> None:
    """Warn that a call applied no update: its first was refused as non-finite, so the
    fit stays where it was (a call on the same data refuses it again). Only the trace's
    ``stop`` said so, and a loop reading the losses saw training stall."""
    loss = float(trace.loss[-1]) if len(trace.loss) else math.nan
    which = (
        "a gradient or the update itself was NaN/inf, the loss before it finite (float16 "
        "state, say: Adam's eps=1e-8 rounds to 0 there)"
        if math.isfinite(loss)
        else "the loss before it was NaN/inf"
    )
    warnings.warn(
        f"stepfuse: this call applied no update: its first, at the fit's step {step}, was "
        f"refused as non-finite ({which}: {loss:.6g}), so the parameters and optimizer "
        "state are as the call found them, and a call on the same data refuses it again. "
        f"{Stop.NONFINITE.message} Pass on_nonfinite='raise' to get a NonFiniteError "
        "instead of this warning.",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
