"""What the fused TF1 loop carries besides its `Flow`, and the counts a run packs for the
host.

`Carry` lays out the loop variables a step reads and moves on: the step's index in the
run (a stacked ``Batches``' entry), the fit's global step ``t`` (from the graph's step
variable: ``Epochs``' minibatches, the evaluation schedule and callback step numbers), a
shuffled dataset's order, and the evaluation buffers. A launch of the compiled loop
reads the variables once before its loop and writes them once after it; a refused
(NaN/inf) step does not advance ``t``, so the next run starts at its minibatch.

A run's results reach the host in one fetched vector (``packed``): the loss buffer, then
int32 counts (`tail`): ``count, applied, stop``, then the step variable after the run
(two int32 words of its int64) when the fit has one, then the evaluations' count when it
evaluates (`read_tail` on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["Carry", "read_tail", "tail", "tail_size"]


class Carry:
    """The loop variables of a fused TF1 fit: ``(i, [t], *stream's, *evaluation's)``."""

    def __init__(self, step_var: Any, streams: Any, evals: Any) -> None:
        self.step_var, self.streams, self.evals = step_var, streams, evals
        self._width = 0  # how many loop variables the stream carries (set by `start`)

    def start(self, i0: Any) -> tuple[Any, ...]:
        """The initial carry of a launch whose first step has index ``i0`` in the run."""
        data = self.streams.carry_in() if self.streams is not None else ()
        self._width = len(data)
        t = () if self.step_var is None else (self.step_var.read_value(),)
        evals = self.evals.carry_in() if self.evals is not None else ()
        return (tf.cast(i0, tf.int32), *t, *data, *evals)

    def _split(self, held: tuple[Any, ...]) -> tuple[Any, Any, tuple, tuple]:
        k = 1 if self.step_var is None else 2
        t = None if self.step_var is None else held[1]
        return held[0], t, tuple(held[k : k + self._width]), tuple(held[k + self._width :])

    def step(
        self, held: tuple[Any, ...], guarded: Callable[[list[Any]], tuple[Any, Any]]
    ) -> tuple[Any, Any, tuple[Any, ...]]:
        """One step: ``guarded(args)`` (the loss of ``loss_fn(*args)`` and whether its
        update was applied) on this step's minibatch; ``(loss, ok, the carry after)``."""
        i, t, data, evals = self._split(held)
        args: list[Any] = []
        if self.streams is not None:
            args, data = self.streams.each(i, t, data)
        loss, ok = guarded(args)
        moved: list[Any] = [i + 1]
        if t is not None:
            t = t + tf.cast(ok, tf.int64)
            moved.append(t)
        if self.evals is not None:
            evals = self.evals.after(t, ok, evals)
        return loss, ok, (*moved, *data, *evals)

    def end(self, held: tuple[Any, ...]) -> tuple[list[Any], Any, tuple[Any, ...]]:
        """``(the writes back, t after the launch, the evaluation buffers)``."""
        _, t, data, evals = self._split(held)
        writes = [] if self.step_var is None else [self.step_var.assign(t)]
        if self.streams is not None:
            writes += self.streams.carry_out(data)
        return writes, t, evals


def tail(count: Any, applied: Any, stop: Any, t: Any = None, evaluations: Any = None) -> Any:
    """The int32 counts a run packs after its losses (see the module's docstring)."""
    parts = [tf.stack([count, applied, stop])]
    if t is not None:
        parts.append(tf.bitcast(tf.cast(t, tf.int64), tf.int32))
    if evaluations is not None:
        parts.append(tf.reshape(tf.cast(evaluations, tf.int32), [1]))
    return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def tail_size(has_step: bool, has_eval: bool) -> int:
    return 3 + 2 * has_step + has_eval


def read_tail(packed: np.ndarray, has_step: bool, has_eval: bool) -> tuple[int, ...]:
    """``(count, applied, stop, step after or -1, evaluations or 0)`` from a fetched
    ``packed`` (int32 bits in float32, or values in float64 for a float64 loss)."""
    raw = packed[-tail_size(has_step, has_eval) :]
    ints = raw.astype(np.int32) if raw.dtype == np.float64 else raw.view(np.int32)
    count, applied, stop = ints[:3].tolist()
    step = int(ints[3:5].copy().view(np.int64)[0]) if has_step else -1
    evaluations = int(ints[-1]) if has_eval else 0
    return count, applied, stop, step, evaluations
