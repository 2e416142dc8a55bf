"""Stacked minibatches for the TF1 fused loop: ``fuse(loss_fn, opt, steps=..., data=
sf.Batches(xs, ys))`` feeds one stacked batch per ``sess.run`` through one placeholder set
and calls ``loss_fn(xs[i], ys[i])`` at step ``i`` of the run.

The fused loop reads the step's index from a variable that the run resets to 0 before
its loop and every step advances (a refused step ends the run); the stepwise mode feeds
the index as a placeholder. ``loss_fn`` without ``data`` is called with no arguments, as
before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from .._core.data import Batches
from ._checks import _fail

tf1 = tf.compat.v1

__all__ = ["V1Data"]


class V1Data:
    """The index a step reads its minibatch by, and ``loss_fn`` wrapped to take it."""

    def __init__(self, data: Any, stepwise: bool, steps: Any) -> None:
        # (`Batches` needs a known leading length: placeholders of shape (None, ...) come
        # as a tuple)
        arrays = data.arrays if isinstance(data, Batches) else data
        if (
            not isinstance(arrays, (tuple, list))
            or not arrays
            or not all(isinstance(a, tf.Tensor) and a.shape.rank != 0 for a in arrays)
        ):
            _fail(
                TypeError,
                "data",
                type(data).__name__,
                "None, a stepfuse.Batches of graph tensors (placeholders), e.g. "
                "sf.Batches(xs_ph, ys_ph), or a tuple of them (leading axis None allowed)",
                "Stack the minibatches along a leading axis and feed them once per run.",
            )
        self.arrays = tuple(arrays)
        lead = self.arrays[0].shape[0] if self.arrays[0].shape.rank else None
        if isinstance(steps, int) and lead is not None and int(lead) < steps:
            data_n = int(lead)
            raise ValueError(
                f"`data` holds {data_n} stacked minibatches but `steps` is {steps}: its leading "
                f"axis must be at least the run's steps. Pass steps={data_n}, or stack more."
            )
        self.index: Any = None
        self.pos: Any = None
        if stepwise:
            self.index = tf1.placeholder_with_default(np.int64(0), [], name="stepfuse_data_index")
        else:
            with tf1.init_scope():
                self.pos = tf.Variable(0, dtype=tf.int64, trainable=False, name="stepfuse_data_pos")

    def wrap(self, loss_fn: Callable[..., Any]) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """``(first, each)``: ``loss_fn`` on minibatch 0 (the graph's ``loss``, built once
        outside the loop) and on the step's minibatch (inside it)."""

        def first() -> Any:
            return loss_fn(*(a[0] for a in self.arrays))

        def each() -> Any:
            if self.pos is None:
                return loss_fn(*(tf.gather(a, self.index) for a in self.arrays))
            i = self.pos.read_value()
            args = [tf.gather(a, i) for a in self.arrays]
            with tf.control_dependencies(args):
                bump = self.pos.assign_add(1)
            with tf.control_dependencies([bump]):
                args = [tf.identity(a) for a in args]
            return loss_fn(*args)

        return first, each

    def resets(self) -> list[Any]:
        """The ops a run must run before its loop (the index back to 0)."""
        return [] if self.pos is None else [self.pos.assign(0)]

    def check_feed(self, feed: dict, n: int) -> None:
        """A ValueError if the stacked batch fed holds fewer minibatches than ``n``."""
        for a in self.arrays:
            value = feed.get(a)
            if value is None:
                continue
            have = int(np.shape(value)[0]) if np.ndim(value) else 0
            if have < n:
                raise ValueError(
                    f"`feed_dict[{a.name}]` (a `data` array) holds {have} stacked minibatches "
                    f"but the run takes {n} steps: its leading axis must be at least the run's "
                    f"steps. Pass steps={have} to run, or stack {n} minibatches."
                )
