"""Evaluation inside the loop, defined once: when it runs, what it returns, its checks.

``fuse(..., eval_fn=f, eval_every=k)`` evaluates ``f`` on the device after every update
that brings the fit's step count (updates applied since ``init``) to a multiple of ``k``,
between that update and the next step, with no host round trip. Each call passes the
evaluation's arguments as ``eval_batch=`` (a held-out set, say); ``f`` returns a scalar
or a dict of scalars, and the call's `Trace` carries the results as ``trace.eval``
(an `EvalTrace`: the step of each evaluation and the value series).

The schedule is global (the fit's step, not the call's), as `stepfuse.Epochs`' minibatch
order is: calls of any length see the same evaluations as one long call, and a fit
resumed from a checkpoint evaluates where an uninterrupted one would. A refused
(``NONFINITE``) update applies nothing, so it brings no evaluation; a call that stops on
``tol`` evaluates up to its last applied update.

What ``eval_fn`` is called with differs by backend (JAX: ``eval_fn(params, *eval_batch)``,
with ``has_state``: ``eval_fn(params, model_state, *eval_batch)``; TF2 and torch:
``eval_fn(*eval_batch)`` reading the model's variables; TF1: ``eval_fn()`` builds the
evaluation from the graph's tensors, and a run's ``feed_dict`` feeds it); everything else
is here.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .options import Described, a_type, fail

if TYPE_CHECKING:
    from .trace import Trace

__all__ = [
    "SCALAR",
    "EvalTrace",
    "check_eval",
    "check_eval_batch",
    "eval_due",
    "eval_names",
    "eval_values",
    "host_evals",
    "named_evals",
]

SCALAR = "value"
"""The name of the series when ``eval_fn`` returns a scalar (``trace.eval.value``)."""


@dataclasses.dataclass(frozen=True)
class EvalTrace:
    """The evaluations one call ran, read on the host (``trace.eval``).

    Attributes:
      step: the fit's step count (updates applied since ``init``) at each evaluation: an
        int64 array, ascending; every entry a multiple of ``eval_every``.
      values: each series ``eval_fn`` returned, by name (``"value"`` for a scalar ``eval_fn``),
        one entry per ``step``.

    ``trace.eval["accuracy"]`` is ``values["accuracy"]``; ``trace.eval.value`` the one series
    of a scalar ``eval_fn``. A call that evaluated nothing has empty series (and
    ``len(trace.eval) == 0``). Inside ``jax.jit`` / ``jax.vmap`` the JAX backend returns the
    same class with padded arrays (``step`` -1 and values NaN past the evaluations run).
    """

    step: Any
    values: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        if name in self.values:
            return self.values[name]
        if len(self) == 0:  # nothing evaluated (a fit's stepwise mode has seen no names yet)
            return np.zeros(0, np.float32)
        raise KeyError(
            f"eval_fn returned no value named {name!r}; it returned {sorted(self.values)}"
        )

    @property
    def value(self) -> Any:
        """The series of an ``eval_fn`` that returns a scalar."""
        return self[SCALAR]

    def __len__(self) -> int:
        return int(np.shape(self.step)[-1])

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __repr__(self) -> str:
        return f"EvalTrace(evaluations={len(self)}, values={list(self.values)})"


def check_eval(eval_fn: Any, eval_every: Any, steps: int) -> tuple[Callable | None, int | None]:
    """``(eval_fn, eval_every)`` validated; ``eval_every`` defaults to ``steps``."""
    if eval_fn is None:
        if eval_every is not None:
            fail(
                ValueError,
                "eval_every",
                eval_every,
                "used with `eval_fn`",
                "Pass eval_fn=... (the evaluation to run), or drop `eval_every`.",
            )
        return None, None
    if not callable(eval_fn):
        fail(
            TypeError,
            "eval_fn",
            eval_fn,
            "a function returning a scalar or a dict of scalars, or None",
            "Pass e.g. eval_fn=lambda x, y: loss_of(x, y) and eval_batch=(x_val, y_val) per call.",
        )
    if eval_every is None:
        return eval_fn, steps
    if not isinstance(eval_every, numbers.Integral) or isinstance(eval_every, bool):
        fail(TypeError, "eval_every", eval_every, "an int >= 1", "Pass e.g. eval_every=100.")
    if eval_every < 1:
        fail(ValueError, "eval_every", eval_every, "an int >= 1", "Pass e.g. eval_every=100.")
    return eval_fn, int(eval_every)


def check_eval_batch(eval_batch: Any, eval_fn: Callable | None) -> tuple:
    """A call's ``eval_batch=`` as the tuple of ``eval_fn``'s arguments: a tuple is the
    arguments, anything else one argument, None none."""
    if eval_batch is None:
        return ()
    if eval_fn is None:
        fail(
            ValueError,
            "eval_batch",
            Described(a_type(eval_batch), eval_batch),
            "passed only to a fit built with `eval_fn`",
            "Build with fuse(..., eval_fn=..., eval_every=...) to evaluate inside the loop.",
        )
    return eval_batch if isinstance(eval_batch, tuple) else (eval_batch,)


def eval_due(step: Any, eval_every: int, ops_equal: Callable[[Any, Any], Any] | None = None) -> Any:
    """Whether the fit's step count ``step`` (after an applied update) is an evaluation's
    (an int or a framework's integer tensor; ``ops_equal``: `stepfuse._core.loop.Ops.equal`
    for tensors whose ``==`` is not elementwise)."""
    r = step % eval_every
    return r == 0 if ops_equal is None else ops_equal(r, 0)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and tuple(shape) == ()


def eval_values(out: Any) -> dict[str, Any]:
    """What ``eval_fn`` returned, as ``{name: scalar}`` (a scalar under `SCALAR`), or a
    TypeError naming ``eval_fn`` and what it returned."""
    fix = (
        "Return a scalar (e.g. the loss on eval_batch) or a dict of scalars "
        "(e.g. {'loss': ..., 'accuracy': ...})."
    )
    if isinstance(out, Mapping):
        if not out:
            fail(TypeError, "eval_fn", out, "a scalar or a non-empty dict of scalars", fix)
        values = {}
        for name, v in out.items():
            if not isinstance(name, str):
                fail(TypeError, "eval_fn", out, "a dict with str keys", fix)
            if not _is_scalar(v):
                shape = getattr(v, "shape", None)
                what = f"shape {tuple(shape)}" if shape is not None else type(v).__name__
                got = Described(f"a dict whose {name!r} is of {what}", out)
                fail(TypeError, "eval_fn", got, "a dict of scalars", fix)
            values[name] = v
        return values
    if not _is_scalar(out):
        got = (
            Described(f"a value of shape {tuple(out.shape)}", out) if hasattr(out, "shape") else out
        )
        fail(TypeError, "eval_fn", got, "a scalar or a dict of scalars", fix)
    return {SCALAR: out}


def eval_names(out: Any) -> tuple[str, ...]:
    """The series names of an ``eval_fn`` output (`eval_values`' keys)."""
    return tuple(eval_values(out))


def _series(values: Any) -> np.ndarray:
    a = np.asarray(values)
    if a.dtype.kind == "f" and a.dtype != np.float64:
        a = a.astype(np.float32)
    return a


def host_evals(step: Any, values: Mapping[str, Any], count: Any) -> EvalTrace:
    """An `EvalTrace` of the first ``count`` entries of a backend's buffers (copies)."""
    n = int(count)
    return EvalTrace(
        step=np.asarray(step, dtype=np.int64)[:n].copy(),
        values={k: _series(v)[:n].copy() for k, v in values.items()},
    )


def named_evals(trace: Trace, dtypes: Mapping[str, Any]) -> Trace:
    """``trace`` with empty series of ``dtypes`` (name -> dtype) where it ran no evaluation
    and names none: the stepwise reference learns the names from an evaluation, and a
    backend that knows them (from tracing ``eval_fn``) gives its stepwise trace the series
    its fused trace has."""
    if trace.eval is None or len(trace.eval) or trace.eval.values:
        return trace
    empty = {name: np.zeros(0, np.dtype(d)) for name, d in dtypes.items()}
    return dataclasses.replace(trace, eval=host_evals([], empty, 0))
