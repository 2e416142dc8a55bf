"""`FitState`, what a JAX fit carries between calls, and `stepfuse.Trace` and
`stepfuse.EvalTrace` as pytrees (a call traced by a user's transform returns them with
arrays in every field)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from .._core import EvalTrace, Trace

__all__ = ["FitState", "replicated_like"]

jax.tree_util.register_pytree_node(
    Trace,
    lambda t: ((t.loss, t.steps, t.stop, t.eval), t.record_every),
    lambda k, c: Trace(c[0], c[1], c[2], record_every=k, eval=c[3]),
)
jax.tree_util.register_pytree_node(
    EvalTrace,
    lambda e: ((e.step, dict(e.values)), None),
    lambda _, c: EvalTrace(c[0], c[1]),
)


class FitState(NamedTuple):
    """Everything a fit carries between calls: a pytree, so it vmaps, saves and restores.

    Attributes:
      params: the parameters (any pytree of float arrays).
      opt_state: the optax optimizer state.
      step: int32 scalar, the number of updates applied since ``init``.
      model_state: the model's state that is no parameter (flax ``batch_stats``, an
        nnx ``BatchStat`` state ...), carried step to step with ``has_state=True``; None
        otherwise (a pytree without leaves, so a state without it flattens, vmaps and
        saves as before).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    model_state: Any = None


def replicated_like(params: Any, tree: Any) -> Any:
    """``tree`` (the optimizer state and step count ``init`` makes) with each array that
    is not on a mesh placed replicated on the mesh of ``params``, where they are on one:
    a call returns them so, and an input placed otherwise compiles the program again."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = None
    for leaf in jax.tree_util.tree_leaves(params):
        try:
            sharding = leaf.sharding
        except Exception:  # noqa: BLE001 - (a tracer, a NumPy array: nothing placed)
            return tree
        if isinstance(sharding, NamedSharding):
            mesh = sharding.mesh
            break
    if mesh is None:
        return tree
    everywhere = NamedSharding(mesh, PartitionSpec())

    def place(leaf: Any) -> Any:
        if isinstance(getattr(leaf, "sharding", None), NamedSharding):
            return leaf
        return jax.device_put(leaf, everywhere)

    return jax.tree_util.tree_map(place, tree)
