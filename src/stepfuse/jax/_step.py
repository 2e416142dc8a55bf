"""One optimizer step, proposed and not applied: the loss and gradient at the current
parameters, optax's update with the extra arguments it takes, and the step's finite probe.
The fused loop and the stepwise reference both run it."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import optax

from ._checks import Loss, check_opt_state
from ._probe import flat_state, held, nonfinite_probe

__all__ = ["Proposal", "extra_args", "propose", "update"]

Proposal = tuple[Any, Any, Any, Any, Any, Any]
"""``(loss, aux, new_params, new_opt_state, probe, kept)`` (see `propose`)."""


def extra_args(
    optimizer: optax.GradientTransformation, loss: Loss, value: Any, grads: Any, batch: tuple
) -> dict[str, Any]:
    """The keyword arguments optax's ``GradientTransformationExtraArgs`` may read in
    ``update``: the loss ``value`` and gradient ``grad`` at ``params`` (reduce_on_plateau,
    polyak_sgd), ``value_fn(params)``, the loss on this call's batch (lbfgs and the line
    searches), and ``grad_fn(params, i)``, its gradient (sam). An update that takes
    ``**extra_args`` gets the first three, optax's convention (its transformations drop
    what they do not read; the backtracking line search hands any other one on to
    ``value_fn``); one with named keywords gets those it names; a plain
    ``GradientTransformation`` none."""
    if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
        return {}
    on_batch = lambda p: loss(p, *batch)[0]  # noqa: E731
    offered = {
        "value": value,
        "grad": grads,
        "value_fn": on_batch,
        "grad_fn": lambda p, i: jax.grad(on_batch)(p),
    }
    try:
        accepted = list(inspect.signature(optimizer.update).parameters.values())
    except (TypeError, ValueError):  # no signature to read
        accepted = [inspect.Parameter("extra_args", inspect.Parameter.VAR_KEYWORD)]
    names = {a.name for a in accepted}
    if any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted):
        names |= set(offered)  # `update` drops those a transformation inside refuses
    return {k: v for k, v in offered.items() if k in names}


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


def propose(
    optimizer: optax.GradientTransformation,
    loss: Loss,
    params: Any,
    opt_state: Any,
    batch: tuple,
    kept: Any = None,
) -> Proposal:
    """One step from ``(params, opt_state)``, not applied: ``(loss, aux, new_params,
    new_opt_state, probe, kept')`` with the finite ``probe`` of `nonfinite_probe`.

    ``kept``: the state entries that count as finite while left unchanged, carried by the
    fused loop; computed here for a single step when None.
    """
    check_opt_state(optimizer, params, opt_state)
    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, *batch)
    updates, new_opt = update(
        optimizer, grads, opt_state, params, extra_args(optimizer, loss, value, grads, batch)
    )
    new_params = optax.apply_updates(params, updates)
    new_params = jax.tree_util.tree_map(lambda n, p: n.astype(p.dtype), new_params, params)
    kept = held(flat_state(opt_state)) if kept is None else kept
    probe, kept = nonfinite_probe((value, grads, new_params), new_opt, kept)
    return value, aux, new_params, new_opt, probe, kept
