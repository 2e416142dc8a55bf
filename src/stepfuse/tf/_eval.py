"""Evaluation inside the TF2 loop (the shared semantics: `stepfuse._core.evaluation`).

A call's ``eval_batch`` reaches the programs as more flat tensors after the batch's: first
the fit's step count at the call's start (int64), then ``eval_batch``'s tensors; new values
of the same shapes and dtypes reuse the traced programs. ``eval_fn(*eval_batch)`` is traced
once in a scratch graph before anything runs (`Evaluations.probe`), which checks that it
traces and returns a scalar or a dict of scalars and fixes the buffers' dtypes.

Inside the loop the steps run in segments that end at the next multiple of ``eval_every``
(`stepfuse.tf._loop.Segments`); after each segment a ``tf.cond`` evaluates if an applied
update reached it, and writes the values into fixed-size buffers carried by the loop (one
launch's evaluations: at most ``ceil(steps per launch / eval_every)``). The steps' own loop
is the one a fit without ``eval_fn`` runs. A call that runs several launches (a callback, a
bar, or a call longer than a launch) gathers each launch's evaluations in its outer loop
(`stepfuse.tf._loop.Gather`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from .._core import EvalTrace, Options, ceil_div, eval_due, eval_values, host_evals, loop
from ._checks import _ArgumentError, _fail, _flat_batch
from ._loop import Buffers
from ._ops import OPS
from ._probe import variables_written

__all__ = ["Evaluations"]

_INT32_MAX = 2**31 - 1


def _buffer_dtype(dtype: tf.DType) -> tf.DType:
    """float64 stays, any other float is float32 (as the losses are recorded), integers
    and bools keep theirs."""
    if dtype.is_floating:
        return tf.float64 if dtype == tf.float64 else tf.float32
    return dtype


def _pad(dtype: tf.DType) -> Any:
    return tf.constant(np.nan if dtype.is_floating else 0, dtype)


class Evaluations:
    """A TF2 fit's evaluation inside the loop: its arguments, its check, the loop's
    segments, and the results read back.

    Attributes:
      capacity: evaluation slots of one launch of the inner loop.
      size: the flat tensors a call appends to the batch (the start step and
        ``eval_batch``'s tensors).
    """

    def __init__(self, opts: Options, steps_per_launch: int):
        assert opts.eval_fn is not None and opts.eval_every is not None
        self.eval_fn, self.every = opts.eval_fn, opts.eval_every
        self.capacity = ceil_div(steps_per_launch, self.every)
        self.structure: Any = None  # the nesting of the eval_batch the programs were traced for
        self.size = 1
        self._dtypes: dict[Any, dict[str, tf.DType]] = {}  # signature -> each value's dtype
        self.dtypes: dict[str, tf.DType] = {}  # those of the call being run
        self.written: list = []  # the variables eval_fn writes (see `probe`)

    # -- the host side ------------------------------------------------------------------

    def flatten(self, eval_batch: tuple, start: int) -> tuple[tuple, Any]:
        """``(tensors, structure)``: the start step and ``eval_batch``'s tensors, flat."""
        flat, structure = _flat_batch(eval_batch)
        return (tf.constant(start, tf.int64), *flat), structure

    def probe(self, tail: tuple) -> None:
        """Trace ``eval_fn`` for these arguments in a scratch graph (nothing runs): a
        named error if it fails to trace or returns anything but a scalar or a non-empty
        dict of scalars. Once per signature."""
        key = (str(self.structure), tuple((t.dtype, tuple(t.shape)) for t in tail[1:]))
        found = self._dtypes.get(key)
        if found is None:
            specs = [tf.TensorSpec(t.shape, t.dtype) for t in tail[1:]]
            concrete = tf.function(self._traced, autograph=False).get_concrete_function(*specs)
            values = eval_values(concrete.structured_outputs)
            # what it writes (a metric, BatchNorm statistics): a jit_compile="auto" trial
            # undoes it (`Fit._written_variables`)
            written, drawn = variables_written(concrete.graph)
            for v in [*(written or ()), *drawn]:
                if all(v is not w for w in self.written):
                    self.written.append(v)
            found = self._dtypes[key] = {
                name: _buffer_dtype(tf.convert_to_tensor(v).dtype) for name, v in values.items()
            }
        self.dtypes = found

    def _traced(self, *flat: Any) -> Any:
        args = tf.nest.pack_sequence_as(self.structure, list(flat))
        try:
            return self.eval_fn(*args)
        except (NotImplementedError, AttributeError) as e:  # eager tensors' .numpy()
            if "numpy" not in str(e):
                raise
            _fail(
                TypeError,
                "eval_fn",
                self.eval_fn,
                "traceable (it runs inside the fused loop)",
                f"It called .numpy() ({e}); use the variables and tensors themselves.",
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, _ArgumentError):
                raise
            shapes = [f"{t.dtype.name}{list(t.shape)}" for t in flat]
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"`eval_fn(*eval_batch)` failed while tracing with eval_batch tensors {shapes}: "
                f"{e} -- Pass the arguments eval_fn takes as fit(..., eval_batch=(...)) (a "
                "tuple is the arguments, any other value one argument)."
            ) from e

    def trace(self, outputs: list, gathered: bool) -> EvalTrace:
        """The call's `EvalTrace` from its program's outputs: a launch's ``count, steps,
        *values`` (``gathered``: the outer loop's ``steps, *values``)."""
        if gathered:
            steps, *values = (o.numpy() for o in outputs)
            count = len(steps)
        else:
            count, steps, *values = (o.numpy() for o in outputs)
        return host_evals(steps, dict(zip(self.dtypes, values)), count)

    # -- inside the programs ------------------------------------------------------------

    def values(self, flat: Any) -> dict[str, Any]:
        """``eval_fn``'s values for the eval tensors ``flat`` (the start step left out),
        each as its buffer's dtype."""
        out = eval_values(self._traced(*flat))
        return {n: tf.cast(out[n], self.dtypes[n]) for n in self.dtypes}

    def segments(self, tail: tuple, i0: Any) -> _Segments:
        """The inner loop's segments for a launch whose first step is ``i0`` of the call."""
        return _Segments(self, tail[0] + tf.cast(i0, tf.int64), tail[1:])

    def gather(self) -> Buffers:
        return Buffers([tf.int64, *self.dtypes.values()])


class _Segments:
    """`stepfuse.tf._loop.Segments` that evaluate: a segment ends at the next multiple of
    ``eval_every``; after it, a ``tf.cond`` writes the evaluation if an applied update
    reached that multiple. ``state``: ``(count, steps, *values)``, one launch's buffers
    (and a spare slot: see `after`)."""

    def __init__(self, evals: Evaluations, base: Any, args: tuple):
        self.evals, self.base, self.args = evals, base, args  # base: the launch's first step
        cap = evals.capacity + 1
        self.state = (
            tf.constant(0, tf.int32),
            tf.fill([cap], tf.constant(-1, tf.int64)),
            *(tf.fill([cap], _pad(d)) for d in evals.dtypes.values()),
        )

    def _step(self, flow: Any) -> Any:
        return self.base + tf.cast(loop.applied(OPS, flow), tf.int64)

    def end(self, flow: Any) -> Any:
        k = self.evals.every
        end = tf.cast(flow.i, tf.int64) + k - self._step(flow) % k
        return tf.cast(tf.minimum(end, _INT32_MAX), tf.int32)

    def after(self, before: Any, flow: Any, state: tuple) -> tuple:
        """A ``tf.cond`` computes the values if an evaluation is due, else the pads; they
        are written at slot ``count`` either way, which the next evaluation overwrites (the
        spare slot when all are full). The buffers stay out of the ``cond``: XLA copied
        them at every segment (~10 us a step with ``eval_every=1`` on the seed)."""
        step = self._step(flow)
        moved = loop.applied(OPS, flow) > loop.applied(OPS, before)
        due = tf.logical_and(moved, eval_due(step, self.evals.every, OPS.equal))

        def evaluate() -> tuple:
            return tuple(self.evals.values(self.args).values())

        values = tf.cond(due, evaluate, lambda: tuple(map(_pad, self.evals.dtypes.values())))
        count, steps, *series = state
        at = tf.reshape(count, [1, 1])
        step = tf.where(due, step, tf.constant(-1, tf.int64))
        return (
            count + tf.cast(due, tf.int32),
            tf.tensor_scatter_nd_update(steps, at, tf.reshape(step, [1])),
            *(
                tf.tensor_scatter_nd_update(s, at, tf.reshape(v, [1]))
                for s, v in zip(series, values)
            ),
        )
