"""The array functions of `stepfuse._core.loop.Ops` for JAX: with them the fused loop
runs the shared step semantics (`stepfuse._core.loop`) on traced arrays."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._core.loop import FunctionOps, Ops

__all__ = ["OPS", "select"]

OPS: Ops = FunctionOps(
    where=jnp.where,
    isfinite=jnp.isfinite,
    logical_not=jnp.logical_not,
    equal=jnp.equal,
    to_int=lambda x: jnp.asarray(x).astype(jnp.int32),
    cast=lambda x, dtype: jnp.asarray(x).astype(dtype),
    false=lambda: jnp.bool_(False),
)
"""`stepfuse._core.loop.Ops` over JAX arrays (traced or not)."""


def select(pred: Any, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where ``pred``, else ``on_false``, leaf by leaf (two pytrees alike)."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
