"""The finite check of one step: a single float probe, 0 if every checked value is finite.

A step's loss, gradients, proposed parameters and proposed optimizer state are checked
together; the fused loop carries the probe as `stepfuse._core.loop.Flow.probe` and its
test reads it, so checking a step costs one reduction.

A `Plan` (made by `stepfuse.jax._step.plan` from a strictness analysis of the step,
`stepfuse.jax._strict`) lets the check read less while refusing exactly the same steps:

- a gradient leaf that a new parameter is strict in (a NaN/inf in the gradient always
  gives one in the new parameters: SGD, momentum, Adam) need not be read: the check of
  the new parameters sees it at the same step;
- on a large model (above `SMALL` entries) whose state starts the call finite, the values
  that stay non-finite once they are (a parameter through ``p + u``, Adam's moments) are
  checked at the end of the call and of each of its segments instead of at every step
  (`unseen`): reading them every step cost up to half of the step on XLA:CPU. A NaN/inf
  that appears there at step ``t`` is still there at the end, so the loop knows that a
  step went wrong, and the call is run again with the check at every step (``exact``,
  the same compiled program, so the same values bit for bit) to find which.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["SMALL", "Plan", "flat_state", "held", "nonfinite_probe", "unseen"]

SMALL = 1 << 14  # elements: below this the NaN/inf check copies the leaves into one array


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which of a step's values the check reads at every step.

    Attributes:
      grads: per gradient leaf, whether every step's check reads it (False: a new
        parameter is strict in it).
      lazy: whether the persistent values are checked at the end of a call or segment
        (`unseen`) rather than at every step, unless the call runs ``exact``.
      lazy_grads: in the lazy check, per gradient leaf, whether every step reads it (False:
        a persistent value is strict in it).
      lazy_params: in the lazy check, per parameter leaf, whether every step reads it
        (False: it is persistent).
      lazy_state: in the lazy check, per float leaf of the optimizer state, whether every
        step reads it (False: persistent). The model state is read at every step.
    """

    grads: tuple[bool, ...]
    lazy: bool = False
    lazy_grads: tuple[bool, ...] = ()
    lazy_params: tuple[bool, ...] = ()
    lazy_state: tuple[bool, ...] = ()


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


def _pick(leaves: list, keep: tuple[bool, ...]) -> list:
    return [x for x, k in zip(leaves, keep) if k]


def _plain(leaves: list) -> jax.Array:
    """0 if every entry of ``leaves`` is finite, NaN otherwise (a float32 scalar), one
    reduction per leaf (a large leaf is read once, nothing copied)."""
    total = jnp.float32(0)
    for x in leaves:
        total = total + jnp.sum(x * 0).astype(jnp.float32)  # times 0 before any cast
    return total


def _full(checked: list, state_leaves: list, kept: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The check of ``checked`` and of ``state_leaves`` against ``kept`` (see
    `nonfinite_probe`)."""
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


def nonfinite_probe(
    value: Any,
    grads: Any,
    new_params: Any,
    state: Any,
    kept: jax.Array,
    plan: Plan | None = None,
    exact: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """``(probe, kept')``: ``probe`` a float32 scalar, 0 if the loss ``value``, every float
    entry of ``grads``, ``new_params`` and ``state`` (the new optimizer and model state)
    is finite, NaN otherwise (``x * 0`` is 0 for finite ``x``, NaN for NaN/inf). The loop
    carries it as is and its test reads it.

    An entry of ``state`` equal to its entry of ``kept`` (`held` of the state before,
    flattened) counts as finite: a state entry already inf and left so
    (reduce_on_plateau's best value before its first average, an injected max_norm=inf)
    is no non-finite update. ``kept'`` is ``kept`` for the next step. The loop carries
    it: compared with the state of the step before, which the step overwrites in place,
    every state leaf's comparison was a kernel of its own on XLA:CPU (see
    docs/internals/jax.md).

    ``plan`` (None: read everything) says what may be left unread (see the module's
    docstring). With a lazy plan, ``exact`` (a traced bool) chooses at run time between
    the check of every value (with ``kept``, which a refused step leaves as it was) and
    the check of the values that are not persistent (``kept`` then unchanged: the loop
    runs so only from a finite state, where it is all NaN); ``exact=None`` always checks
    every value.

    XLA splits a sum over concatenated leaves into one reduction per leaf; on XLA:CPU
    each is a kernel launch, which dominates for small models, so there the leaves are
    concatenated behind an optimization barrier and summed once.
    """
    grads_l, params_l = _inexact_leaves(grads), _inexact_leaves(new_params)
    state_l = _inexact_leaves(state)
    value_l = _inexact_leaves(value)
    every = plan.grads if plan is not None else (True,) * len(grads_l)
    checked = value_l + _pick(grads_l, every) + params_l
    if plan is None or not plan.lazy or exact is None:
        return _full(checked, state_l, kept)
    n_opt = len(plan.lazy_state)
    now = _plain(value_l + _pick(grads_l, plan.lazy_grads) + _pick(params_l, plan.lazy_params))
    state_now = _pick(state_l[:n_opt], plan.lazy_state) + state_l[n_opt:]

    def every_value(operands: tuple) -> tuple[jax.Array, jax.Array]:
        now, checked, state_l, kept, _ = operands
        probe, new_kept = _full(checked, state_l, kept)
        # a refused step keeps ``kept`` (the loop stops there; under vmap it goes on)
        return probe, jnp.where(jnp.isfinite(now + probe), new_kept, kept)

    def not_persistent(operands: tuple) -> tuple[jax.Array, jax.Array]:
        _, _, _, kept, state_now = operands
        return _plain(state_now), kept

    rest, kept = jax.lax.cond(
        exact, every_value, not_persistent, (now, checked, state_l, kept, state_now)
    )
    return now + rest, kept


def unseen(plan: Plan | None, params: Any, opt_state: Any) -> Any:
    """Whether a lazy plan's persistent values (`Plan`) hold a NaN/inf in ``params`` and
    ``opt_state``: if they do, a step the loop did not check at once had one (the loop
    ran from a finite state); ``False`` without a lazy plan."""
    if plan is None or not plan.lazy:
        return jnp.bool_(False)
    leaves = [x for x, k in zip(_inexact_leaves(params), plan.lazy_params) if not k]
    leaves += [x for x, k in zip(_inexact_leaves(opt_state), plan.lazy_state) if not k]
    return jnp.logical_not(jnp.isfinite(_plain(leaves)))
