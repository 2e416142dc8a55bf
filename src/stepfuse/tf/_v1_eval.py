"""Evaluation inside the TF1 loop (``stepfuse.tf.v1.fuse(..., eval_fn=f, eval_every=k)``).

``f()`` builds the evaluation from the graph's tensors (validation placeholders fed in the
same ``feed_dict`` as the training batch, and the model's variables), as ``loss_fn`` does:
TF1's ``eval_batch`` is the run's ``feed_dict``. It is built once outside the loop (its
names and dtypes, and the tensors the stepwise mode fetches) and once inside the step,
under a ``tf.cond`` that runs it after each applied update that brings the fit's step
count (the loop's step variable) to a multiple of ``k`` (`stepfuse._core.evaluation`).

The results stay on the device in fixed-size buffers carried by the compiled loop (the
fit's steps of the evaluations, int64, and one buffer per value in its own dtype; ``count``
of them used), written by a ``tensor_scatter_nd_update`` only at an evaluation. A launch of
at most ``chunk`` steps evaluates at most ``ceil(chunk / k)`` times, its capacity; a run
that chains launches concatenates theirs outside the compiled loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from .._core import Described, EvalTrace, ceil_div, eval_due, eval_values, host_evals
from ._checks import _fail
from ._v1_graph import _reuse_scope

__all__ = ["V1Eval"]


def _scalars(out: Any) -> dict[str, Any]:
    """What ``eval_fn()`` returned as ``{name: scalar tensor}``, or an error naming
    ``eval_fn`` (`stepfuse._core.evaluation.eval_values` checks the structure)."""

    def tensor(v: Any) -> Any:
        try:
            t = tf.convert_to_tensor(v)
        except (TypeError, ValueError):
            _fail(
                TypeError,
                "eval_fn",
                v,
                "a function returning a scalar tensor or a dict of them",
                "Return e.g. tf.reduce_mean(...) or {'loss': ..., 'accuracy': ...}.",
            )
        if t.shape.rank is None:  # a scalar only known at run time
            t = tf.reshape(t, [])
        if not (t.dtype.is_floating or t.dtype.is_integer or t.dtype == tf.bool):
            _fail(
                TypeError,
                "eval_fn",
                Described(f"a value of dtype {t.dtype.name}", t),
                "a function returning real numbers (float, int or bool scalars)",
                "Cast it, e.g. tf.cast(value, tf.float32).",
            )
        return t

    if isinstance(out, Mapping):
        values = eval_values({k: tensor(v) for k, v in out.items()})
    else:
        values = eval_values(tensor(out))
    return values


class V1Eval:
    """A fit's evaluation: its tensors outside the loop and its buffers inside.

    Attributes:
      fetches: ``{name: scalar tensor}`` built outside the loop (what the stepwise mode
        runs at each evaluation).
      names, dtypes: the series (``"value"`` for a scalar ``eval_fn``) and their dtypes.
      every: ``eval_every``. capacity: evaluations one launch of the compiled loop holds.
    """

    def __init__(self, eval_fn: Callable[[], Any], every: int, chunk: int) -> None:
        self.eval_fn = eval_fn
        self.every = every
        self.capacity = ceil_div(chunk, every)
        with _reuse_scope():
            self.fetches = _scalars(eval_fn())
        self.names = tuple(self.fetches)
        self.dtypes = tuple(t.dtype for t in self.fetches.values())

    def carry_in(self) -> tuple[Any, ...]:
        """The loop variables: the count, the evaluations' steps and each value's buffer."""
        cap = self.capacity
        return (
            tf.constant(0, tf.int32),
            tf.fill([cap], tf.constant(-1, tf.int64)),
            *(tf.zeros([cap], d) for d in self.dtypes),
        )

    def after(self, t: Any, ok: Any, carried: tuple[Any, ...]) -> tuple[Any, ...]:
        """The buffers after a step that left the fit's step count at ``t`` (int64) and
        applied its update if ``ok``: ``eval_fn`` run and recorded when that is due."""
        count, steps, *bufs = carried

        def record() -> tuple[Any, ...]:
            with _reuse_scope():
                values = _scalars(self.eval_fn())
            if tuple(values) != self.names or tuple(v.dtype for v in values.values()) != (
                self.dtypes
            ):
                _fail(
                    ValueError,
                    "eval_fn",
                    {k: v.dtype.name for k, v in values.items()},
                    "the same names and dtypes at every call "
                    f"({dict(zip(self.names, [d.name for d in self.dtypes]))})",
                    "Build the same evaluation each time eval_fn is called.",
                )
            at = tf.reshape(count, [1, 1])
            new = [tf.tensor_scatter_nd_update(steps, at, tf.reshape(t, [1]))]
            for buf, v in zip(bufs, values.values()):
                new.append(tf.tensor_scatter_nd_update(buf, at, tf.reshape(v, [1])))
            return (count + 1, *new)

        def skip() -> tuple[Any, ...]:
            return (tf.identity(count), tf.identity(steps), *(tf.identity(b) for b in bufs))

        due = tf.logical_and(ok, eval_due(t, self.every, tf.equal))
        return tuple(tf.cond(due, record, skip))

    def host(self, count: Any, steps: Any, values: Any) -> EvalTrace:
        """The `EvalTrace` of a run from its fetched buffers (the first ``count`` entries)."""
        return host_evals(np.asarray(steps), dict(zip(self.names, values)), count)
