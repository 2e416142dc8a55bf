"""Evaluation inside the JAX loop (the shared semantics: `stepfuse._core.evaluation`).

`Evaluation` is ``eval_fn`` traced once for the call being traced and checked before
anything runs: it must trace with the call's ``eval_batch`` and return a scalar or a dict of
scalars (`stepfuse._core.eval_values`). The fused loop carries its results in `EvalBuffers`
of ``opts.eval_capacity`` slots (the fit's step count of each evaluation and one series per
value), written on the device by `evaluate`, a ``lax.cond`` on the due step: no host round
trip. The loop runs it between its chunks of steps, never inside a step (see
`stepfuse.jax._program`), so a fit built without ``eval_fn`` compiles the program it
compiled before, and one with a large ``eval_every`` pays a ``cond`` per chunk.

``eval_fn`` gets the parameters ``loss_fn`` gets (``params.fast`` for ``optax.lookahead``)
behind ``stop_gradient``: an evaluation adds nothing to what ``jax.grad`` differentiates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import EvalTrace, eval_due, eval_values, host_evals

__all__ = [
    "EvalBuffers",
    "Evaluation",
    "evaluate",
    "host_eval_trace",
    "traced_eval_trace",
]


class EvalBuffers(NamedTuple):
    """What the fused loop carries for the evaluations of a call.

    Attributes:
      used: int32, the evaluations run so far in the call (the slots used).
      step: int32 ``(capacity + 1,)``: the fit's step count at each evaluation, -1 past
        them (the last slot a spare one: see `evaluate`).
      values: name -> ``(capacity + 1,)``: each value's series, NaN past the evaluations
        (0 for an integer value, False for a bool).
    """

    used: jax.Array
    step: jax.Array
    values: dict[str, jax.Array]


def _buffer_dtype(dtype: Any) -> np.dtype:
    """The dtype a value is kept in: float64 stays, any other float is float32 (as the
    losses are recorded), integers and bools keep theirs."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(np.float64 if dtype == np.float64 else np.float32)
    return dtype


def _pad(dtype: np.dtype) -> Any:
    return np.nan if jnp.issubdtype(dtype, jnp.inexact) else 0


class Evaluation:
    """``eval_fn`` traced and checked for a call: ``evaluation(params, model_state,
    eval_batch)`` is the dict of its values, each a scalar of the buffer's dtype.

    Raises a TypeError or ValueError naming ``eval_fn`` when it fails to trace with the
    call's ``eval_batch``, and a TypeError when it returns anything but a scalar or a
    non-empty dict of scalars.
    """

    def __init__(
        self,
        eval_fn: Callable[..., Any],
        has_state: bool,
        params: Any,
        model_state: Any,
        eval_batch: tuple,
    ):
        self.eval_fn, self.has_state = eval_fn, has_state
        try:
            out = jax.eval_shape(self._call, params, model_state, *eval_batch)
        except (TypeError, ValueError) as e:
            shapes = jax.tree_util.tree_map(lambda a: tuple(np.shape(a)), eval_batch)
            args = "params, model_state, *eval_batch" if has_state else "params, *eval_batch"
            # The plain type: JAX's own subclasses (ConcretizationTypeError ...) take a tracer.
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"`eval_fn({args})` failed while tracing with eval_batch shapes {shapes}: {e} "
                "-- Pass the arguments eval_fn takes after params as fit(..., eval_batch=(...)) "
                "(a tuple is the arguments, any other value one argument)."
            ) from e
        self.dtypes = {name: _buffer_dtype(v.dtype) for name, v in eval_values(out).items()}

    def _call(self, params: Any, model_state: Any, *eval_batch: Any) -> Any:
        if self.has_state:
            return self.eval_fn(params, model_state, *eval_batch)
        return self.eval_fn(params, *eval_batch)

    def __call__(self, params: Any, model_state: Any, eval_batch: tuple) -> dict[str, jax.Array]:
        params, model_state = jax.lax.stop_gradient((params, model_state))
        values = eval_values(self._call(params, model_state, *eval_batch))
        return {name: jnp.asarray(v).astype(self.dtypes[name]) for name, v in values.items()}

    def start(self, capacity: int) -> EvalBuffers:
        """Empty buffers of ``capacity`` slots (and a spare one)."""
        return EvalBuffers(
            jnp.int32(0),
            jnp.full((capacity + 1,), -1, jnp.int32),
            {n: jnp.full((capacity + 1,), _pad(d), d) for n, d in self.dtypes.items()},
        )

    def pads(self) -> dict[str, jax.Array]:
        """The values of a slot no evaluation wrote."""
        return {n: jnp.asarray(_pad(d), d) for n, d in self.dtypes.items()}


def evaluate(
    evaluation: Evaluation,
    eval_every: int,
    buffers: EvalBuffers,
    step: jax.Array,
    moved: jax.Array,
    params: Any,
    model_state: Any,
    eval_batch: tuple,
) -> EvalBuffers:
    """``buffers`` with one more evaluation if it is due: the updates applied since the
    last look ``moved`` the fit's step count to ``step``, a multiple of ``eval_every``.

    A ``lax.cond`` computes the values (under ``jax.vmap`` a select, which runs ``eval_fn``
    for every model), or the pads when none is due; they are written at slot ``used``
    either way, which the next evaluation overwrites (the spare slot when all are used).
    The buffers stay out of the ``cond``: XLA would copy them at every look.
    """
    due = moved & eval_due(step, eval_every)
    values = jax.lax.cond(
        due,
        lambda: evaluation(params, model_state, eval_batch),
        evaluation.pads,
    )
    at = buffers.used
    return EvalBuffers(
        at + due.astype(at.dtype),
        jax.lax.dynamic_update_index_in_dim(
            buffers.step, jnp.where(due, step, -1).astype(buffers.step.dtype), at, 0
        ),
        {
            n: jax.lax.dynamic_update_index_in_dim(buffers.values[n], v, at, 0)
            for n, v in values.items()
        },
    )


def host_eval_trace(buffers: EvalBuffers) -> EvalTrace:
    """The `EvalTrace` of a call's buffers, read back to the host (``np.asarray`` per
    buffer: ``jax.device_get`` of the three took ~20 us more a call here)."""
    return host_evals(
        np.asarray(buffers.step),
        {n: np.asarray(v) for n, v in buffers.values.items()},
        int(buffers.used),
    )


def traced_eval_trace(buffers: EvalBuffers) -> EvalTrace:
    """The `EvalTrace` inside a user's transform: the padded buffers (step -1 and values NaN
    past the evaluations run), without the spare slot."""
    return EvalTrace(buffers.step[..., :-1], {n: v[..., :-1] for n, v in buffers.values.items()})
