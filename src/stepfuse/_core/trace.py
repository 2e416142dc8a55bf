"""The result of one fused call, shared by every backend: `Trace`, `Stop`, `NonFiniteError`."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .evaluation import EvalTrace

__all__ = ["Stop", "Trace", "NonFiniteError", "ceil_div", "host_trace", "n_recorded"]


class Stop(enum.IntEnum):
    """Why a fused call ended.

    An ``IntEnum``: inside a compiled program (or under ``jax.vmap``) a backend
    carries the plain integer code, and ``trace.stop == Stop.TOL`` still works.
    """

    STEPS = 0
    """Ran every requested step."""
    TOL = 1
    """Converged: ``abs(loss[i] - loss[i-1]) <= tol``; update ``i`` was applied, then the loop stopped."""
    NONFINITE = 2
    """The loss, a gradient, or the proposed parameters / optimizer state were NaN or inf.

    That update was *not* applied: parameters and optimizer state are those of the
    last finite point, and ``trace.steps`` counts only the updates that were applied.
    """

    @property
    def message(self) -> str:
        return _MESSAGES[self]

    def __str__(self) -> str:  # print(trace.stop) says which, not the bare code
        return f"Stop.{self.name}"


_MESSAGES = {
    Stop.STEPS: "Ran all requested steps.",
    Stop.TOL: "Converged: two consecutive losses differed by at most `tol`.",
    Stop.NONFINITE: (
        "Stopped before applying a non-finite update (NaN/inf in the loss, a gradient, "
        "the parameters or the optimizer state); the state is that of the last finite step. "
        "Lower the learning rate, clip gradients, or check the data for NaN/inf (and for "
        "labels or ids out of range, which XLA does not raise on: a loss reading them may "
        "be NaN)."
    ),
}


_STOPS = tuple(Stop)  # code -> Stop; `Stop(code)` costs ~0.8 us a call


@dataclasses.dataclass(frozen=True)
class Trace:
    """What one fused call did, read on the host.

    Attributes:
      loss: the recorded losses. ``loss[j]`` is the loss at the parameters *before*
        update ``j * record_every`` of this call. When the call stopped with
        ``Stop.NONFINITE`` the refused update's loss (possibly NaN/inf) is the last one,
        if its index is a multiple of ``record_every`` (always with the default 1).
      steps: the number of updates actually applied in this call.
      stop: why the call ended (a `Stop`).
      record_every: the thinning factor the losses were recorded with.
      eval: the evaluations run inside the loop (an `EvalTrace`) when the fit was built
        with ``eval_fn``; None otherwise.

    Inside ``jax.jit`` / ``jax.vmap`` the JAX backend returns the same class with
    arrays in every field (``loss`` padded with NaN to the call's capacity).
    """

    loss: Any
    steps: Any
    stop: Any
    record_every: int = 1
    eval: EvalTrace | None = None

    @property
    def index(self) -> np.ndarray:
        """The step number (within this call) of each recorded loss."""
        return np.arange(np.shape(self.loss)[-1]) * self.record_every

    @property
    def last_loss(self) -> float:
        """The last recorded loss (NaN when nothing was recorded)."""
        loss = np.asarray(self.loss)
        return float(loss[-1]) if loss.size else float("nan")

    def __repr__(self) -> str:
        stop = self.stop.name if isinstance(self.stop, Stop) else self.stop
        n = np.shape(self.loss)[-1] if np.ndim(self.loss) else 0
        evals = "" if self.eval is None else f", evaluations={len(self.eval)}"
        return (
            f"Trace(steps={self.steps}, stop={stop}, losses recorded={n}, "
            f"record_every={self.record_every}{evals})"
        )


def ceil_div(a: Any, b: Any) -> Any:
    """``ceil(a / b)`` for non-negative integers (Python ints or integer tensors)."""
    return -(-a // b)


def n_recorded(evaluated: int, record_every: int) -> int:
    """How many of ``evaluated`` losses are kept when every ``record_every``-th one is."""
    return ceil_div(evaluated, record_every)


def host_trace(
    losses: Any, steps: Any, stop: Any, record_every: int, evals: EvalTrace | None = None
) -> Trace:
    """Build a host `Trace` from a backend's raw loss buffer and counters.

    ``losses`` holds at least the recorded entries; the number kept follows from the
    number of losses evaluated (``steps``, plus the refused one after ``NONFINITE``).
    ``evals``: the call's evaluations (`stepfuse._core.evaluation.host_evals`), if any.
    """
    steps, stop = int(steps), _STOPS[int(stop)]
    evaluated = steps + (1 if stop == Stop.NONFINITE else 0)
    kept = n_recorded(evaluated, record_every)
    loss = np.asarray(losses)
    loss = loss[:kept].astype(np.float64 if loss.dtype == np.float64 else np.float32)  # a copy
    return Trace(loss=loss, steps=steps, stop=stop, record_every=record_every, eval=evals)


class NonFiniteError(FloatingPointError):
    """Raised with ``on_nonfinite="raise"`` when a fused call met a non-finite update.

    The state (parameters, optimizer state) is that of the last finite step, as with
    ``Stop.NONFINITE``; ``error.step`` is the global index of the refused update and
    ``error.trace`` the call's trace. ``error.state``: in JAX, the `FitState` the call
    reached (its updates up to the refused one; the caller still holds the state it
    passed in); None where the backend updates the variables in place (TF, torch).
    """

    def __init__(self, step: int, trace: Trace, state: Any = None):
        self.step = step
        self.trace = trace
        self.state = state
        super().__init__(
            f"non-finite loss or update at step {step} (update not applied; "
            f"{trace.steps} updates of this call were applied). {Stop.NONFINITE.message}"
        )
