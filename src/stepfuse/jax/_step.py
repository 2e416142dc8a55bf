"""One optimizer step, proposed and not applied: the loss and gradient at the current
parameters, optax's update with the extra arguments it takes, and the step's finite probe.
The fused loop and the stepwise reference both run it."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._checks import Loss, check_opt_state, loss_params
from ._probe import SMALL, Plan, flat_state, held, nonfinite_probe
from ._strict import strict_inputs

__all__ = ["Proposal", "extra_args", "plan", "propose", "update"]

Proposal = tuple[Any, Any, Any, Any, Any, Any, Any]
"""``(loss, aux, new_params, new_opt_state, probe, kept, new_model_state)`` (see
`propose`)."""


def extra_args(
    optimizer: optax.GradientTransformation,
    loss: Loss,
    value: Any,
    grads: Any,
    batch: tuple,
    model_state: Any = None,
    opt_state: Any = None,
) -> dict[str, Any]:
    """The keyword arguments optax's ``GradientTransformationExtraArgs`` may read in
    ``update``: the loss ``value`` and gradient ``grad`` at ``params`` (reduce_on_plateau,
    polyak_sgd), ``value_fn(params)``, the loss on this call's batch (lbfgs and the line
    searches), ``obj_fn(params)``, the same function under the name
    ``optax.contrib.sophia``'s Hessian estimate reads (offered where ``opt_state`` holds a
    ``SophiaState``: a name refused costs `update` a trace of the update again, a
    sizeable part of the first call for lbfgs), and ``grad_fn(params, i)``, its gradient
    (sam). With a model state, the loss is that of the step's model state (the
    state before the step; its update is the step's own). An update that takes
    ``**extra_args`` gets them all (its transformations drop what they do not read; the
    backtracking line search hands any other one on to ``value_fn``, and `update` drops
    what it refuses); one with named keywords gets those it names; a plain
    ``GradientTransformation`` none."""
    if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
        return {}
    on_batch = lambda p: loss(p, model_state, *batch)[0]  # noqa: E731
    offered = {
        "value": value,
        "grad": grads,
        "value_fn": on_batch,
        "grad_fn": lambda p, i: jax.grad(on_batch)(p),
    }
    if _holds_sophia(opt_state):
        offered["obj_fn"] = on_batch
    try:
        accepted = list(inspect.signature(optimizer.update).parameters.values())
    except (TypeError, ValueError):  # no signature to read
        accepted = [inspect.Parameter("extra_args", inspect.Parameter.VAR_KEYWORD)]
    names = {a.name for a in accepted}
    if any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted):
        names |= set(offered)  # `update` drops those a transformation inside refuses
    return {k: v for k, v in offered.items() if k in names}


def _holds_sophia(opt_state: Any) -> bool:
    is_sophia = lambda x: isinstance(x, optax.contrib.SophiaState)  # noqa: E731
    return any(map(is_sophia, jax.tree_util.tree_leaves(opt_state, is_leaf=is_sophia)))


def update(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    extra: dict[str, Any],
) -> tuple[Any, Any]:
    """``optimizer.update`` with the extra arguments it takes. A ``**extra_args`` update
    (``optax.chain``) hands them to every transformation inside, and some accept only
    their own (``sam``: ``grad_fn``) or pass them on to ``value_fn`` (the line search):
    a name refused while tracing is dropped and the update traced again (no run-time cost)."""
    extra = dict(extra)
    while True:
        try:
            return optimizer.update(grads, opt_state, params, **extra)
        except TypeError as e:
            # "unexpected keyword argument 'x'", "... not consumed by `value_fn`: ['x']"
            message = str(e)
            refused = [k for k in extra if f"'{k}'" in message]
            if not refused or not ("unexpected keyword" in message or "not consumed" in message):
                raise
            for k in refused:
                del extra[k]


def _apply(
    optimizer: optax.GradientTransformation,
    loss: Loss,
    batch: tuple,
    model_state: Any,
) -> Any:
    """``(value, grads, opt_state, params) -> (new_params, new_opt_state)``: optax's update
    with its extra arguments, applied as `propose` applies it."""

    def apply(value: Any, grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
        extra = extra_args(optimizer, loss, value, grads, batch, model_state, opt_state)
        try:
            updates, new_opt = update(optimizer, grads, opt_state, params, extra)
        except Exception as e:
            e.add_note(
                "stepfuse: raised by the optimizer's update, called as a plain loop calls it: "
                "optimizer.update(grads, opt_state, params, ...) with grads = "
                "jax.grad(loss_fn) of the whole batch. An optimizer that needs other "
                "gradients (optax.contrib.dpsgd wants one per example) cannot run in a fit."
            )
            raise
        new_params = optax.apply_updates(params, updates)
        new_params = jax.tree_util.tree_map(lambda n, p: n.astype(p.dtype), new_params, params)
        return new_params, new_opt

    return apply


def _float(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


# optax's transformations that skip or zero a non-finite gradient themselves; an optimizer
# holding one sees its gradients unchecked (see `guards_gradients`).
_GUARDS = (optax.ApplyIfFiniteState, optax.ZeroNansState)


def guards_gradients(opt_state: Any) -> bool:
    """Whether the optimizer guards itself against non-finite gradients
    (``optax.apply_if_finite``, ``optax.zero_nans``, ``optax.MultiSteps`` with a
    ``should_skip_update_fn``). Its plain loop goes on past a NaN/inf
    gradient (the update skipped or the NaNs zeroed), so the step's check leaves the
    gradients to it: the loss, the new parameters and the new state are still checked,
    and a step that makes one of them non-finite is refused as always."""
    kinds = (*_GUARDS, optax.MultiStepsState)
    found = jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
    return any(
        isinstance(x, _GUARDS)
        # optax.MultiSteps(..., should_skip_update_fn=optax.skip_not_finite): a skip state
        or (isinstance(x, optax.MultiStepsState) and bool(jax.tree_util.tree_leaves(x.skip_state)))
        for x in found
    )


def plan(
    optimizer: optax.GradientTransformation,
    loss: Loss,
    params: Any,
    opt_state: Any,
    batch: tuple,
    model_state: Any = None,
    lazy: bool = True,
) -> Plan:
    """What a step's finite check may leave unread (`_probe.Plan`), from the strictness
    analysis of the update (`_strict.strict_inputs`) for these shapes: a gradient leaf
    that a new parameter is strict in; and where ``lazy`` and the step's values exceed
    `_probe.SMALL` entries, the values that stay non-finite from step to step (a
    parameter, or a state leaf strict in itself) and the gradient leaves one of them is
    strict in."""
    check_opt_state(optimizer, params, opt_state)
    value = jnp.zeros((), loss.dtype)
    grads = loss_params(params)  # the gradient's shapes and dtypes
    args = (value, grads, opt_state, params)
    strict = strict_inputs(_apply(optimizer, loss, batch, model_state), *args)
    leaves = [jax.tree_util.tree_leaves(a) for a in args]
    start = [sum(map(len, leaves[:i])) for i in range(4)]  # each argument's first leaf
    n_params = len(leaves[3])
    new_params, new_state = strict[:n_params], strict[n_params:]
    g_at = [start[1] + j for j, g in enumerate(leaves[1]) if _float(g)]
    s_at = [j for j, s in enumerate(leaves[2]) if _float(s)]
    in_params = frozenset().union(*new_params)
    guarded = guards_gradients(opt_state)
    grads_now = tuple(g not in in_params and not guarded for g in g_at)
    params_kept = [start[3] + j in new_params[j] for j in range(n_params)]
    state_kept = [start[2] + j in new_state[j] for j in s_at]
    kept_by = frozenset().union(
        *(s for s, k in zip(new_params, params_kept) if k),
        *(new_state[j] for j, k in zip(s_at, state_kept) if k),
    )
    size = sum(int(x.size) for x in jax.tree_util.tree_leaves((grads, params, opt_state)))
    if not lazy or size <= SMALL or not (any(params_kept) or any(state_kept)):
        return Plan(grads_now)
    return Plan(
        grads_now,
        lazy=True,
        lazy_grads=tuple(g not in kept_by and not guarded for g in g_at),
        lazy_params=tuple(not k for k in params_kept),
        lazy_state=tuple(not k for k in state_kept),
    )


def propose(
    optimizer: optax.GradientTransformation,
    loss: Loss,
    params: Any,
    opt_state: Any,
    batch: tuple,
    kept: Any = None,
    model_state: Any = None,
    checks: Plan | None = None,
    exact: Any = None,
) -> Proposal:
    """One step from ``(params, opt_state, model_state)``, not applied: ``(loss, aux,
    new_params, new_opt_state, probe, kept', new_model_state)`` with the finite ``probe``
    of `nonfinite_probe`.

    The loss and gradient are those at `loss_params` (``params.fast`` for
    `optax.lookahead`'s ``LookaheadParams``). ``model_state`` goes into ``loss_fn`` and
    its new value comes out (None without ``has_state``); it is checked with the
    optimizer state, so a step whose model state turns non-finite is refused too.
    ``kept``: the state entries that count as finite while left unchanged, carried by the
    fused loop; computed here for a single step when None. ``checks`` and ``exact``: what
    the finite check may leave unread (`_probe.nonfinite_probe`; None: nothing).
    """
    check_opt_state(optimizer, params, opt_state)
    (value, (new_state, aux)), grads = jax.value_and_grad(loss, has_aux=True)(
        loss_params(params), model_state, *batch
    )
    new_params, new_opt = _apply(optimizer, loss, batch, model_state)(
        value, grads, opt_state, params
    )
    kept = held(flat_state((opt_state, model_state))) if kept is None else kept
    probe, kept = nonfinite_probe(
        value, grads, new_params, (new_opt, new_state), kept, checks, exact
    )
    return value, aux, new_params, new_opt, probe, kept, new_state
