"""What a call learns about the JAX transformations around it: whether it is traced
(`inside_a_trace`), differentiated (`wants_reverse_mode`), placed on several devices
(`spans_devices`), or varying over ``shard_map`` axes (`varying_like`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["inside_a_trace", "spans_devices", "varying_like", "wants_reverse_mode"]


def wants_reverse_mode(leaves: Iterable[Any]) -> bool:
    """Whether the leaves are being differentiated (``jax.grad`` / ``jax.jvp`` tracers),
    also beneath ``jax.vmap``'s batch tracers (``jax.grad(jax.vmap(fit))``)."""
    for x in leaves:
        while isinstance(x, jax.core.Tracer):
            if type(x).__name__ in ("JVPTracer", "LinearizeTracer"):
                return True
            x = getattr(x, "val", None)  # a BatchTracer's batched value
    return False


def spans_devices(leaves: Iterable[Any]) -> bool:
    """Whether any array is placed on more than one device (sharded or replicated)."""
    return any(len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1 for x in leaves)


try:
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover - a JAX without it: under a trace any op is staged

    def _trace_state_clean() -> bool:
        return not isinstance(jnp.zeros((), jnp.int32), jax.core.Tracer)


def inside_a_trace() -> bool:
    """Whether a JAX transformation is tracing the caller (even one that closes over every
    input, so no argument is a tracer)."""
    return not _trace_state_clean()


def varying_like(tree: Any, inputs: Any) -> Any:
    """``tree`` made varying over every manual mesh axis any of ``inputs`` varies over.

    Under ``jax.shard_map`` with one model per device, the parameters vary across devices;
    after one step so does everything in the loop that depends on them (the counters, the
    loss buffer, a count in the optimizer state), and ``while_loop`` wants its carry's
    types to stay the same, so the carry starts varying. Elsewhere nothing changes."""
    if not (hasattr(jax, "typeof") and hasattr(jax.lax, "pcast")):
        return tree

    def vma(x: Any) -> frozenset:  # the manual axes x varies over (`.vma` in some JAX versions)
        t = jax.typeof(x)
        return frozenset(
            getattr(getattr(t, "manual_axis_type", None), "varying", None)
            or getattr(t, "vma", None)
            or ()
        )

    axes = frozenset().union(*map(vma, jax.tree_util.tree_leaves(inputs)))
    if not axes:
        return tree

    def vary(x: Any) -> Any:
        missing = tuple(sorted(axes - vma(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(vary, tree)
