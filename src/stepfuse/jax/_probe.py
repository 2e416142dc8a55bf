"""The finite check of one step: a single float probe, 0 if every checked value is finite.

A step's loss, gradients, proposed parameters and proposed optimizer state are checked
together; the fused loop carries the probe as `stepfuse._core.loop.Flow.probe` and its
test reads it, so checking a step costs one reduction.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["SMALL", "flat_state", "held", "nonfinite_probe"]

SMALL = 1 << 14  # elements: below this the NaN/inf check copies the leaves into one array


def _inexact_leaves(tree: Any) -> list:
    return [
        jnp.ravel(x)
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]


def flat_state(opt_state: Any) -> jax.Array:
    """The float entries of an optimizer state as one vector."""
    leaves = _inexact_leaves(opt_state)
    return jnp.concatenate(leaves) if leaves else jnp.zeros((0,), jnp.float32)


def held(flat: jax.Array) -> jax.Array:
    """``flat``'s non-finite entries, NaN at every finite one (NaN equals nothing): the
    entries of an optimizer state that the next state may keep (see `nonfinite_probe`)."""
    return jnp.where(jnp.isfinite(flat), jnp.full_like(flat, jnp.nan), flat)


def nonfinite_probe(tree: Any, state: Any, kept: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(probe, kept')``: ``probe`` a float32 scalar, 0 if every float entry of ``tree``
    and ``state`` is finite, NaN otherwise (``x * 0`` is 0 for finite ``x``, NaN for
    NaN/inf). The loop carries it as is and its test reads it, so checking a step costs
    one reduction.

    An entry of ``state`` equal to its entry of ``kept`` (`held` of the state before,
    flattened) counts as finite: a state entry already inf and left so
    (reduce_on_plateau's best value before its first average, an injected max_norm=inf)
    is no non-finite update. ``kept'`` is ``kept`` for the next step. The loop carries
    it: compared with the state of the step before, which the step overwrites in place,
    every state leaf's comparison was a kernel of its own on XLA:CPU (see
    docs/internals/jax.md).

    XLA splits a sum over concatenated leaves into one reduction per leaf; on XLA:CPU
    each is a kernel launch, which dominates for small models, so there the leaves are
    concatenated behind an optimization barrier and summed once. Large models keep the
    per-leaf reductions, which read each leaf once and copy nothing.
    """
    checked, state_leaves = _inexact_leaves(tree), _inexact_leaves(state)
    if not checked + state_leaves:
        return jnp.float32(0), kept
    dtype = jnp.result_type(*checked, *state_leaves)
    flat = jnp.concatenate([x.astype(dtype) for x in checked + state_leaves])
    if flat.size <= SMALL:
        flat = jax.lax.optimization_barrier(flat)
    zeros = flat * 0  # times 0 before any cast: a float64 1e300 is finite
    if state_leaves:
        n = flat.size - kept.size
        zeros = jnp.where(
            flat == jnp.concatenate([jnp.full((n,), jnp.nan, dtype), kept.astype(dtype)]),
            jnp.zeros_like(zeros),
            zeros,
        )
        kept = held(flat[n:]).astype(kept.dtype)  # exact: the entries are of that dtype
    return jnp.sum(zeros.astype(jnp.float32)), kept
