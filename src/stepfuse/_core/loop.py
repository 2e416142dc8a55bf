"""The semantics of one loop step, written once for every loop stepfuse runs.

Every loop (each backend's compiled loop and the stepwise reference in
`stepfuse._core.stepwise`) carries the same bookkeeping, a `Flow`, and moves it on
with `advance` after each evaluated step. Whether the loop goes on (`running`), why it
ended (`stop_code`), how many updates it applied (`applied`), where a step's loss is
recorded (`record_slot`) and when ``tol`` is met (`within_tol`) are derived from the
`Flow` by the functions below, never written out again in a backend.

They are written over a tiny array namespace, `Ops`: each framework passes its own
(``where``, ``isfinite``, ``logical_not``, a cast), so the same function runs inside a
``jax.lax.while_loop``, a ``tf.while_loop``, a compiled ``torch`` ``while_loop`` and
as plain Python on the host. Arithmetic and comparisons are the operators every
framework's tensors have.

The order of events of one step, which every loop keeps:

1. evaluate the loss and the gradient at the current parameters and propose the update;
2. record the loss if the step's index is a multiple of ``record_every``;
3. if the loss, a gradient or the proposed state is non-finite, refuse the update and
   stop (`Stop.NONFINITE`);
4. otherwise apply it; then stop if ``abs(loss - previous loss) <= tol`` (`Stop.TOL`),
   or once the call's steps have run (`Stop.STEPS`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NamedTuple, Protocol

import numpy as np

from .trace import Stop

__all__ = [
    "Flow",
    "FunctionOps",
    "HOST",
    "Ops",
    "advance",
    "applied",
    "converged",
    "live",
    "masked",
    "record_slot",
    "refused",
    "running",
    "stop_code",
    "within_tol",
]


class Ops(Protocol):
    """The few array functions the shared semantics need from a framework.

    Everything else is Python's operators (``+``, ``//``, ``%``, ``<``, ``<=``, ``&``,
    ``|``), which the tensors of every framework overload (``==`` is `equal`: a TF1
    graph's tensors compare by identity).
    """

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """Elementwise ``a if cond else b``."""
        ...

    def isfinite(self, x: Any) -> Any:
        """Elementwise: neither NaN nor inf."""
        ...

    def logical_not(self, x: Any) -> Any:
        """Elementwise ``not`` of a boolean (``~`` is not ``not`` for a Python bool)."""
        ...

    def equal(self, a: Any, b: Any) -> Any:
        """Elementwise ``a == b`` (a TF1 graph's ``==`` compares the tensors' identity)."""
        ...

    def to_int(self, x: Any) -> Any:
        """A boolean as the loop's integer type (0 or 1)."""
        ...

    def cast(self, x: Any, dtype: np.dtype) -> Any:
        """``x`` as a float of ``dtype`` (``np.float32`` or ``np.float64``)."""
        ...

    def false(self) -> Any:
        """A boolean ``False`` the loop can combine with its own booleans."""
        ...


@dataclasses.dataclass(frozen=True)
class FunctionOps:
    """An `Ops` made of a framework's functions (each backend builds one, with its own)."""

    where: Callable[[Any, Any, Any], Any]
    isfinite: Callable[[Any], Any]
    logical_not: Callable[[Any], Any]
    equal: Callable[[Any, Any], Any]
    to_int: Callable[[Any], Any]
    cast: Callable[[Any, np.dtype], Any]
    false: Callable[[], Any]


class _HostOps:
    """`Ops` over Python scalars: the stepwise reference loop on the host."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    @staticmethod
    def isfinite(x: Any) -> bool:
        return math.isfinite(x)

    @staticmethod
    def logical_not(x: Any) -> bool:
        return not x

    @staticmethod
    def equal(a: Any, b: Any) -> Any:
        return a == b

    @staticmethod
    def to_int(x: Any) -> int:
        return int(x)

    @staticmethod
    def cast(x: Any, dtype: np.dtype) -> Any:
        return np.dtype(dtype).type(x)  # a NumPy scalar: its arithmetic rounds in `dtype`

    @staticmethod
    def false() -> bool:
        return False


HOST: Ops = _HostOps()
"""`Ops` for plain Python numbers (the stepwise reference)."""


class Flow(NamedTuple):
    """The bookkeeping every loop carries from step to step.

    Attributes:
      i: steps evaluated in this call so far (a refused one included).
      probe: the last evaluated step's finite probe: 0 if its loss, gradients and
        proposed state were all finite, NaN if not (then the loop stops and the update
        is not applied). A float, so a backend can carry the sum of ``x * 0`` over the
        checked values as it is: that sum is 0 exactly when every value is finite.
      last: the loss of the last evaluated step (NaN before the first). ``None`` where a
        backend does not carry it (a loop without ``tol`` whose notifications read the
        loss from the trace).
      before: the loss of the step before ``last``, for ``tol``; ``None`` without ``tol``.
    """

    i: Any
    probe: Any
    last: Any = None
    before: Any = None


def advance(flow: Flow, loss: Any, probe: Any) -> Flow:
    """The `Flow` after one more evaluated step, whose loss is ``loss`` and whose finite
    probe is ``probe`` (0 or NaN). Fields a backend does not carry stay ``None``."""
    return Flow(
        flow.i + 1,
        probe,
        None if flow.last is None else loss,
        None if flow.before is None else flow.last,
    )


def masked(ops: Ops, active: Any, new: Flow, old: Flow) -> Flow:
    """``new`` where ``active``, else ``old``: a loop that runs a fixed number of steps
    (a chunk, a reverse-differentiable scan) and masks those past the call's end."""
    return Flow(*(None if a is None else ops.where(active, a, b) for a, b in zip(new, old)))


def refused(ops: Ops, flow: Flow) -> Any:
    """Whether the last evaluated step was non-finite (its update is not applied)."""
    return ops.logical_not(ops.isfinite(flow.probe))


def applied(ops: Ops, flow: Flow) -> Any:
    """Updates applied so far: every evaluated step but a refused last one (the loop
    stops at a refused step, so no counter is needed)."""
    return flow.i - ops.to_int(refused(ops, flow))


Met = Callable[[Any, Any], Any]
"""``met(a, b)``: whether two consecutive losses are within ``tol`` (`within_tol`)."""


def converged(ops: Ops, flow: Flow, met: Met | None) -> Any:
    """Whether the last two losses met ``tol`` (``met`` is None without ``tol``).

    Read from the carried losses at the loop's test, not inside the step: there a
    compiler may fuse the loss's last operation into the comparison and round that copy
    apart from the recorded one (an FMA), so a ``tol`` within an ulp of a recorded
    difference would stop a step early or late. ``before`` is NaN until two steps ran,
    and NaN meets no ``tol``.
    """
    if met is None:
        return ops.false()
    return met(flow.last, flow.before)


def live(ops: Ops, flow: Flow, met: Met | None) -> Any:
    """Whether nothing has stopped the loop yet (no refused step, no ``tol`` met)."""
    stopped = refused(ops, flow)
    if met is not None:
        stopped = stopped | converged(ops, flow, met)
    return ops.logical_not(stopped)


def running(ops: Ops, flow: Flow, n: Any, met: Met | None) -> Any:
    """The loop's test: fewer than ``n`` steps evaluated and nothing stopped it."""
    return (flow.i < n) & live(ops, flow, met)


def stop_code(ops: Ops, flow: Flow, met: Met | None) -> Any:
    """Why the loop ended, as the integer code of a `Stop` (``NONFINITE`` before ``TOL``:
    a refused step's loss is no converged one)."""
    code = int(Stop.STEPS)
    if met is not None:
        code = ops.where(converged(ops, flow, met), int(Stop.TOL), code)
    return ops.where(refused(ops, flow), int(Stop.NONFINITE), code)


def record_slot(i: Any, record_every: int, first: Any, spare: Any, ops: Ops = HOST) -> Any:
    """Where step ``i`` of a call writes its loss: slot ``i // record_every - first`` of
    the buffer when it is recorded (``i`` a multiple of ``record_every``), else ``spare``
    (a slot the trace never reads). ``first`` is the buffer's first slot's record index."""
    if record_every == 1:
        return i - first
    return ops.where(ops.equal(i % record_every, 0), i // record_every - first, spare)


def _floor(x: Fraction, dtype: np.dtype) -> np.ndarray:
    """The largest value of ``dtype`` not above the exact number ``x``."""
    t = np.asarray(float(x), dtype)
    return np.nextafter(t, dtype.type(-np.inf)) if Fraction(float(t)) > x else t


def within_tol(ops: Ops, tol: float, dtype: Any) -> Met:
    """``met(a, b)``: whether ``abs(a - b) <= tol`` holds exactly, for losses of ``dtype``.

    This is the host's test on the recorded losses (float64, in which the difference of
    two recorded losses is as exact as the losses themselves). On a device, ``a - b``
    rounded in the loss dtype can cross ``tol`` when the losses are more than 2x apart,
    and a float32 ``tol`` may round above the float64 one: either would stop a step early
    or late. So the difference is kept exactly as ``s + e`` (TwoSum: ``s`` the rounded
    difference, ``e`` its rounding error, both exact in the dtype; additions only, which
    compilers do not reassociate) and compared with ``tol`` split at the two values of the
    dtype around it. Losses narrower than float32 are compared in float32 (exactly).
    The stepwise reference runs the same test on the host (`HOST`, in float64: exact for
    the recorded losses of every dtype).
    """
    dt = np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    if tol == math.inf:

        def not_nan(a: Any, b: Any) -> Any:  # abs(a - b) <= inf: any difference but NaN
            d = ops.cast(a, dt) - ops.cast(b, dt)
            return ops.equal(d, d)

        return not_nan
    lo = _floor(Fraction(tol), dt)  # lo <= tol < hi, neighbours in the dtype
    hi = np.nextafter(lo, dt.type(np.inf))
    room_lo = _floor(Fraction(tol) - Fraction(float(lo)), dt)  # >= 0
    room_hi = (
        _floor(Fraction(tol) - Fraction(float(hi)), dt)
        if np.isfinite(hi)
        else np.asarray(-np.inf, dt)
    )  # < 0
    # Python floats (each a value of `dt`, so exact in its arithmetic): a NumPy scalar would
    # be a tensor input of a compiled torch program, converted at every call.
    lo_f, hi_f, room_lo_f, room_hi_f = (float(v) for v in (lo, hi, room_lo, room_hi))

    def met(a: Any, b: Any) -> Any:
        a, b = ops.cast(a, dt), ops.cast(b, dt)
        s = a - b
        z = s - a
        e = (a - (s - z)) + (-b - z)  # a - b == s + e exactly
        neg = s < 0
        s, e = ops.where(neg, -s, s), ops.where(neg, -e, e)
        # s < lo: s + e < lo's neighbour above s, at most lo. s > hi: s + e > hi > tol.
        eq = ops.equal
        return (s < lo_f) | (eq(s, lo_f) & (e <= room_lo_f)) | (eq(s, hi_f) & (e <= room_hi_f))

    if ops is HOST:  # NumPy scalars warn where a loss is inf or NaN: such a loss meets no tol

        def host_met(a: Any, b: Any) -> Any:
            with np.errstate(invalid="ignore", over="ignore"):
                return met(a, b)

        return host_met
    return met
