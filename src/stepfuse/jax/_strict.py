"""Which non-finite inputs a computation cannot lose: a strictness analysis of its jaxpr.

A value ``y`` is *strict* in an input ``x`` when, whatever the other inputs hold, ``x``
having a NaN/inf entry makes ``y`` have one too. IEEE arithmetic gives it for the
operations listed below: ``inf + -inf``, ``inf * 0`` and ``inf / inf`` are NaN, so a sum,
a product or a numerator never turns a non-finite operand finite. Others lose it
(``exp(-inf) == 0``, ``max(-inf, 1) == 1``, ``1 / inf == 0``, a ``select``, a slice that
drops the entry), and every operation this module does not know counts as losing it.

The fused loop uses the analysis of one optimizer step (`stepfuse.jax._step.plan`) to
check the values that cannot lose a NaN/inf less often: a parameter that became NaN/inf
stays so through ``optax.apply_updates`` (``p + u``), so a step's non-finite gradient
that reaches the new parameters is seen there (see `stepfuse.jax._probe`).

Every rule is about *some* entry: ``y`` strict in ``x`` means a non-finite entry anywhere
in ``x`` gives a non-finite entry somewhere in ``y``. That composes (strict in a strict
value is strict), and is what a check that reduces a whole array needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

__all__ = ["strict_inputs"]

# Strict in every operand: sums, products, moves of entries that keep all of them.
_ALL = frozenset(
    {
        "abs",
        "add",
        "add_any",
        "broadcast_in_dim",
        "ceil",
        "concatenate",
        "convert_element_type",
        "copy",
        "copy_p",
        "cumsum",
        "floor",
        "log",
        "log1p",
        "mul",
        "neg",
        "reduce_precision",
        "reduce_sum",
        "reshape",
        "rev",
        "round",
        "sqrt",
        "square",
        "squeeze",
        "sub",
        "transpose",
    }
)
# Strict in the first operand only (``x / y``: a non-finite y can give 0).
_FIRST = frozenset({"div"})
# Calls whose body is a jaxpr with the call's operands and results.
_CALLS = frozenset(
    {
        "checkpoint",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "jit",
        "pjit",
        "remat2",
    }
)


def _inexact(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def _operands(eqn: Any) -> Sequence[int] | None:
    """Which operands ``eqn``'s results are strict in (None: none)."""
    name = eqn.primitive.name
    if name in _ALL:
        if name == "convert_element_type" and not all(_inexact(v.aval) for v in eqn.invars):
            return None  # an integer turned float was never non-finite; the other way is lost
        return range(len(eqn.invars))
    if name in _FIRST:
        return (0,)
    if name == "integer_pow" and eqn.params.get("y", 0) >= 1:
        return (0,)  # inf ** -1 == 0, x ** 0 == 1
    if name == "pad" and all(lo >= 0 and hi >= 0 for lo, hi, _ in eqn.params["padding_config"]):
        return (0,)  # negative padding drops entries
    return None


def _body(eqn: Any) -> Any:
    """The jaxpr of a call ``eqn`` whose operands and results are its own, else None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr"):
        body = eqn.params.get(key)
        if body is None:
            continue
        body = getattr(body, "jaxpr", body)  # a ClosedJaxpr's consts are not operands
        if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
            return body
    return None


def _propagate(jaxpr: Any, ins: Sequence[frozenset]) -> list[frozenset]:
    """The inputs (labels) each output of ``jaxpr`` is strict in, given those of its
    inputs."""
    env: dict[Any, frozenset] = {}
    for v, s in zip(jaxpr.invars, ins):
        env[v] = s

    def read(v: Any) -> frozenset:
        return env.get(v, frozenset()) if isinstance(v, jax.extend.core.Var) else frozenset()

    for eqn in jaxpr.eqns:
        body = _body(eqn)
        if body is not None:
            outs = _propagate(body, [read(v) for v in eqn.invars])
        else:
            which = _operands(eqn)
            got = frozenset().union(*(read(eqn.invars[i]) for i in which)) if which else frozenset()
            outs = [got] * len(eqn.outvars)
        for v, s in zip(eqn.outvars, outs):
            size = int(np.prod(getattr(v.aval, "shape", ()) or (1,)))
            # an empty or non-float result holds no NaN/inf
            env[v] = s if _inexact(v.aval) and size > 0 else frozenset()
    return [read(v) for v in jaxpr.outvars]


def strict_inputs(fn: Callable[..., Any], *args: Any) -> list[frozenset[int]]:
    """For each leaf of ``fn(*args)``, the flat indices of the leaves of ``args`` it is
    strict in. ``args`` may be tracers of an enclosing trace; values ``fn`` closes over
    count as unknown inputs (no output is strict in them)."""
    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    flat = jax.tree_util.tree_leaves(args)
    ins = [frozenset({i}) if _inexact(jax.typeof(x)) else frozenset() for i, x in enumerate(flat)]
    return _propagate(jaxpr, ins)
