"""The array functions of `stepfuse._core.loop.Ops` for JAX: with them the fused loop
runs the shared step semantics (`stepfuse._core.loop`) on traced arrays."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.loop import Ops

__all__ = ["OPS", "select"]


class _JaxOps:
    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return jnp.where(cond, a, b)

    @staticmethod
    def isfinite(x: Any) -> Any:
        return jnp.isfinite(x)

    @staticmethod
    def logical_not(x: Any) -> Any:
        return jnp.logical_not(x)

    @staticmethod
    def to_int(x: Any) -> Any:
        return jnp.asarray(x).astype(jnp.int32)

    @staticmethod
    def cast(x: Any, dtype: np.dtype) -> Any:
        return jnp.asarray(x).astype(dtype)

    @staticmethod
    def false() -> Any:
        return jnp.bool_(False)


OPS: Ops = _JaxOps()
"""`stepfuse._core.loop.Ops` over JAX arrays (traced or not)."""


def select(pred: Any, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where ``pred``, else ``on_false``, leaf by leaf (two pytrees alike)."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
