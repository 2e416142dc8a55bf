"""The array functions of `stepfuse._core.loop.Ops` for TensorFlow: with them the graph loops
of both TF backends run the shared step semantics (`stepfuse._core.loop`) on tensors."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from .._core.loop import FunctionOps, Ops

__all__ = ["OPS"]

OPS: Ops = FunctionOps(
    where=tf.where,
    isfinite=tf.math.is_finite,
    logical_not=tf.logical_not,
    equal=tf.equal,
    to_int=lambda x: tf.cast(x, tf.int32),
    cast=lambda x, dtype: tf.cast(x, tf.as_dtype(np.dtype(dtype))),
    false=lambda: tf.constant(False),
)
"""`stepfuse._core.loop.Ops` over TensorFlow tensors (graph or eager)."""
