"""What the JAX backend checks before anything runs: the parameters, an optimizer state
against its optimizer, and ``loss_fn`` (traced once into `Loss`, whose output is checked).

The checks of a call's inputs run while the fused program is traced, so a call pays
nothing for them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "Loss",
    "check_dtypes_kept",
    "check_model_state",
    "check_opt_state",
    "check_params",
    "inputs_reaching_output",
    "loss_params",
]


def _leaves_with_paths(tree: Any) -> list:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


# How to pass a model object that holds more than float arrays (the message of every
# refusal of params that are not float arrays).
_SPLIT_FIX = (
    "A model object holds more than its trainable arrays: pass those alone and rebuild the "
    "model inside loss_fn. Equinox: `params, static = eqx.partition(model, "
    "eqx.is_inexact_array)`, then `model = eqx.combine(params, static)` in loss_fn. Flax nnx: "
    "`graphdef, params, rest = nnx.split(model, nnx.Param, ...)`, then "
    "`model = nnx.merge(graphdef, params, rest)` in loss_fn, with `rest` (batch statistics "
    "...) carried by fuse(..., has_state=True) and fit.init(params, rest). A flax "
    "TrainState: pass state.params (the fit keeps its own optimizer state). Other values: "
    "cast them, e.g. jnp.asarray(x, jnp.float32), or close over them in loss_fn."
)


def check_params(params: Any, name: str = "params") -> None:
    """Raise unless ``params`` holds at least one array, all of them floating-point (and,
    with flax nnx, none of them a non-parameter ``nnx.Variable``)."""
    leaves = _leaves_with_paths(params)
    if not leaves:
        raise ValueError(
            f"`{name}` must hold at least one float array; got {params!r} (no array leaves). "
            "Pass the model's parameters, e.g. a dict of jnp arrays."
        )
    for path, leaf in leaves:
        where = f"{name}{jax.tree_util.keystr(path)}"
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            try:
                dtype = np.asarray(leaf).dtype
            except Exception:  # noqa: BLE001 - anything NumPy cannot take is no array
                dtype = np.dtype(object)
        if dtype == np.dtype(object):
            raise TypeError(
                f"`{name}` must be a pytree of float arrays; got a {type(leaf).__name__} "
                f"({_short(repr(leaf), 120)}) at {where}. {_SPLIT_FIX}"
            )
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"`{name}` must hold only real floating-point arrays; got dtype {dtype} at "
                f"{where}: complex parameters are not supported. Keep the real and imaginary "
                "parts as two float arrays and build the complex value in loss_fn "
                "(jax.lax.complex(re, im))."
            )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"`{name}` must hold only floating-point arrays; got dtype {dtype} at "
                f"{where} (value {_short(repr(leaf), 120)}). {_SPLIT_FIX}"
            )
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None:  # a flax nnx model or state passed whole: its statistics are no params
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]:
            if is_var(leaf) and not isinstance(leaf, nnx.Param):
                raise TypeError(
                    f"`{name}` holds a flax nnx {type(leaf).__name__} at "
                    f"{name}{jax.tree_util.keystr(path)}, which is no nnx.Param: the optimizer "
                    f"would train it and loss_fn's updates to it would be lost. {_SPLIT_FIX}"
                )


def check_model_state(model_state: Any) -> None:
    """Raise unless every leaf of ``model_state`` is an array (of any dtype)."""
    for path, leaf in _leaves_with_paths(model_state):
        try:
            ok = np.asarray(leaf).dtype != np.dtype(object) if not hasattr(leaf, "dtype") else True
        except Exception:  # noqa: BLE001 - anything NumPy cannot take is no array
            ok = False
        if not ok:
            raise TypeError(
                f"`model_state` must be a pytree of arrays; got a {type(leaf).__name__} "
                f"({_short(repr(leaf), 120)}) at model_state{jax.tree_util.keystr(path)}. "
                "Pass the model's non-parameter arrays only (flax: variables['batch_stats']; "
                "nnx: the `rest` of nnx.split(model, nnx.Param, ...)), and close over the rest "
                "in loss_fn."
            )


def check_opt_state(optimizer: optax.GradientTransformation, params: Any, opt_state: Any) -> None:
    """Raise if ``opt_state`` has not the structure and shapes that ``optimizer.init(params)``
    gives (a state from another optimizer or model: it would fail deep inside optax, or
    worse, run). Checked while tracing, so a call pays nothing for it."""
    spec = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params
    )
    want = jax.eval_shape(optimizer.init, spec)
    fix = (
        "Pass the state this fit's init(params) made or its calls returned; after changing "
        "the optimizer or the model, start again from fit.init(params)."
    )
    want_tree, got_tree = (
        jax.tree_util.tree_structure(want),
        jax.tree_util.tree_structure(opt_state),
    )
    if want_tree != got_tree:  # type: ignore[operator]  # jaxlib ships no typing for PyTreeDef
        raise TypeError(
            f"`state.opt_state` is not a state of this fit's optimizer for these params: it is "
            f"{_short(got_tree)}, where optimizer.init(params) gives {_short(want_tree)}. {fix}"
        )
    for (path, got), w in zip(_leaves_with_paths(opt_state), jax.tree_util.tree_leaves(want)):
        if np.shape(got) != w.shape:
            raise ValueError(
                f"`state.opt_state{jax.tree_util.keystr(path)}` has shape {np.shape(got)}, where "
                f"optimizer.init(params) gives {w.shape} (the params' shapes changed?). {fix}"
            )


def check_dtypes_kept(optimizer: optax.GradientTransformation, params: Any, opt_state: Any) -> None:
    """Raise where an update would give ``opt_state`` a leaf of another dtype (a state made
    for bfloat16 params, run with float32 ones): a plain loop promotes it at its first step,
    the fused loop carries fixed dtypes (and JAX's while_loop would say so obscurely)."""
    shape_of = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))  # noqa: E731
    spec = jax.tree_util.tree_map(shape_of, (opt_state, params))
    try:
        _, after = jax.eval_shape(lambda s, p: optimizer.update(p, s, p), *spec)
    except Exception:  # noqa: BLE001 - (an update needing more arguments: the loop tells)
        return
    for (path, got), w in zip(_leaves_with_paths(opt_state), jax.tree_util.tree_leaves(after)):
        if jnp.result_type(got) != w.dtype:
            raise TypeError(
                f"`state.opt_state{jax.tree_util.keystr(path)}` is {jnp.result_type(got)}, and "
                f"an update with these params makes it {w.dtype} (the state was made for "
                "params of another dtype?): the fused loop carries the state with fixed dtypes, "
                "where a plain loop would promote it at its first step. Cast it to what the "
                "update gives (the first step then computes in that dtype throughout), e.g. "
                "state._replace(opt_state=jax.tree.map(lambda a, b: "
                "a.astype(b.dtype), state.opt_state, fit.init(state.params).opt_state)), or "
                "start again from fit.init(params)."
            )


def _short(tree: Any, limit: int = 400) -> str:
    text = str(tree)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _numbers(arg: Any) -> str:
    """``"a list of 8000 numbers"`` for a batch argument given as (nested) lists of numbers
    (``fit(state, x.tolist())``), which JAX reads as a pytree of separate scalars; else ``""``."""
    leaves = jax.tree_util.tree_leaves(arg)
    if isinstance(arg, (list, tuple)) and leaves and all(np.ndim(v) == 0 for v in leaves):
        return f"a {type(arg).__name__} of {len(leaves)} numbers"
    return ""


def _lists(batch: tuple) -> str:
    named = [f"batch[{i}] is {_numbers(a)}" for i, a in enumerate(batch) if _numbers(a)]
    if not named:
        return ""
    return (
        f" {'; '.join(named)}: JAX reads a list as a pytree of separate scalars; "
        "np.asarray(...) makes it one array."
    )


def inputs_reaching_output(jaxpr: Any) -> list[bool]:
    """For each input of ``jaxpr``, whether the first output (the loss) may depend on it.

    A conservative walk back from the loss through the equations; ``stop_gradient``
    cuts the dependency, as it does for the gradient.
    """
    Var = jax.extend.core.Var
    needed = {v for v in jaxpr.outvars[:1] if isinstance(v, Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name == "stop_gradient" or not any(v in needed for v in eqn.outvars):
            continue
        needed.update(v for v in eqn.invars if isinstance(v, Var))
    return [v in needed for v in jaxpr.invars]


def loss_params(params: Any) -> Any:
    """The parameters ``loss_fn`` is evaluated at: ``params.fast`` of an
    ``optax.LookaheadParams`` (the gradient `optax.lookahead` takes is that of the fast
    parameters), else ``params``."""
    return params.fast if isinstance(params, optax.LookaheadParams) else params


def check_lookahead(optimizer: optax.GradientTransformation, params: Any) -> None:
    """Raise if ``optimizer`` holds an `optax.lookahead` (its state a ``LookaheadState``)
    and ``params`` are no ``optax.LookaheadParams``: its update reads ``params.fast`` and
    ``params.slow``."""
    if isinstance(params, optax.LookaheadParams):
        return
    is_state = lambda x: isinstance(x, optax.LookaheadState)  # noqa: E731
    quiet = logging.getLogger("absl")  # (lookahead's init logs that it "continues")
    mute = logging.Filter("-")  # passes no record of the absl logger
    quiet.addFilter(mute)
    try:
        state = jax.eval_shape(optimizer.init, _spec(params))
    except Exception:  # noqa: BLE001 - an init that fails here fails again in init, clearly
        return
    finally:
        quiet.removeFilter(mute)
    if any(map(is_state, jax.tree_util.tree_leaves(state, is_leaf=is_state))):
        raise TypeError(
            "`params` must be an optax.LookaheadParams for optax.lookahead (its update reads "
            f"params.fast and params.slow); got a {type(params).__name__}. Pass "
            "fit.init(optax.LookaheadParams.init_synced(params)): loss_fn is then called "
            "with params.fast, the parameters the gradient is taken of, and "
            "state.params.slow are the slow ones."
        )


def _spec(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree
    )


class Loss:
    """``loss_fn`` traced once into a jaxpr whose output is checked before anything runs.

    ``loss(params, model_state, *batch)`` is ``(loss, (new_model_state, aux))``:
    ``new_model_state`` None without ``has_state`` (``loss_fn(params, *batch)`` is then
    called without a model state), ``aux`` None without ``has_aux``. With ``has_state``
    ``loss_fn(params, model_state, *batch)`` returns ``(loss, new_model_state)``, or
    ``(loss, (new_model_state, aux))`` with ``has_aux`` as well.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        has_aux: bool,
        params: Any,
        batch: tuple,
        has_state: bool = False,
        model_state: Any = None,
    ):
        def call(params: Any, model_state: Any, *batch: Any) -> Any:
            return loss_fn(params, model_state, *batch) if has_state else loss_fn(params, *batch)

        try:
            closed, shape = jax.make_jaxpr(call, return_shape=True)(params, model_state, *batch)
        except (TypeError, ValueError) as e:
            shape = lambda a: tuple(np.shape(a))  # noqa: E731
            shapes = (
                jax.tree_util.tree_map(shape, params),
                tuple(_numbers(a) or jax.tree_util.tree_map(shape, a) for a in batch),
            )
            args = "params, model_state, *batch" if has_state else "params, *batch"
            # The plain type: JAX's own subclasses (ConcretizationTypeError ...) take a tracer.
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"`loss_fn({args})` failed with params/batch shapes {_short(shapes)}: {e} "
                f"Check that the batch passed to fit(state, *batch) fits the model.{_lists(batch)}"
            ) from e
        out, new_state, aux = self._parts(shape, has_aux, has_state)
        if (
            not isinstance(out, jax.ShapeDtypeStruct)
            or out.shape != ()
            or not jnp.issubdtype(out.dtype, jnp.floating)
        ):
            desc = f"shape {out.shape}, dtype {out.dtype}" if hasattr(out, "shape") else repr(out)
            fix = (
                "Reduce it to a scalar (e.g. jnp.mean) and make it float "
                "(e.g. .astype(jnp.float32))."
            )
            if isinstance(out, (tuple, list)) and not has_aux:
                n = len(out)
                fix = (
                    f"It returned a {type(out).__name__} of {n}: for (loss, aux), build with "
                    "fuse(..., has_aux=True)"
                    + (
                        "; for (loss, new_model_state), with has_state=True."
                        if not has_state
                        else "; with has_state=True it returns (loss, new_model_state)."
                    )
                    + " Otherwise r"
                    + fix[1:]
                )
            raise TypeError(
                f"`loss_fn` must return a floating-point scalar{' (with aux)' if has_aux else ''}; "
                f"got {desc}. {fix}"
            )
        if has_state:
            self._check_new_state(model_state, new_state)
        n_params = len(jax.tree_util.tree_leaves(params))
        if not any(inputs_reaching_output(closed.jaxpr)[:n_params]):
            raise ValueError(
                "`loss_fn` does not depend on `params`: every gradient would be zero and no "
                "step would change anything. Compute the loss from the params argument "
                "(not from arrays closed over) and do not wrap it in stop_gradient."
            )
        self.dtype = out.dtype
        self.aux_shape = aux
        self._state_spec = _spec(model_state) if has_state else None
        self._out_tree = jax.tree_util.tree_structure(shape)
        self._fun = jax.extend.core.jaxpr_as_fun(closed)
        self.has_aux, self.has_state = has_aux, has_state

    @staticmethod
    def _parts(shape: Any, has_aux: bool, has_state: bool) -> tuple[Any, Any, Any]:
        """``(loss, new_model_state, aux)`` of ``loss_fn``'s output, or a clear error."""

        def pair(x: Any) -> bool:
            return isinstance(x, (tuple, list)) and len(x) == 2

        if has_state and has_aux:
            if not (pair(shape) and pair(shape[1])):
                raise TypeError(
                    "`loss_fn` must return (loss, (new_model_state, aux)) with has_state=True "
                    f"and has_aux=True; got {_short(repr(shape))}. Return that nesting."
                )
            return shape[0], shape[1][0], shape[1][1]
        if has_state or has_aux:
            if not pair(shape):
                want, flag = (
                    ("(loss, new_model_state)", "has_state")
                    if has_state
                    else ("(loss, aux)", "has_aux")
                )
                raise TypeError(
                    f"`loss_fn` must return {want} with {flag}=True; got {_short(repr(shape))}. "
                    f"Return a pair, or build with {flag}=False."
                )
            return (shape[0], shape[1], None) if has_state else (shape[0], None, shape[1])
        return shape, None, None

    @staticmethod
    def _check_new_state(model_state: Any, new_state: Any) -> None:
        """The loop carries the model state: ``loss_fn`` must return one like it got."""
        want, got = _spec(model_state), new_state
        fix = (
            "Return the new model state with the structure, shapes and dtypes of the "
            "model_state loss_fn received (flax linen: `out, updates = model.apply(..., "
            'mutable=["batch_stats"])` returns updates["batch_stats"] for model_state = '
            'variables["batch_stats"]).'
        )
        want_tree, got_tree = (
            jax.tree_util.tree_structure(want),
            jax.tree_util.tree_structure(got),
        )
        if want_tree != got_tree:  # type: ignore[operator]  # jaxlib ships no typing for PyTreeDef
            raise TypeError(
                f"`loss_fn`'s new model state is {_short(str(got_tree))}, where the model_state "
                f"it received is {_short(str(want_tree))} (has_state=True). {fix}"
            )
        for (path, g), w in zip(_leaves_with_paths(got), jax.tree_util.tree_leaves(want)):
            if g.shape != w.shape or g.dtype != w.dtype:
                raise TypeError(
                    f"`loss_fn`'s new model_state{jax.tree_util.keystr(path)} has shape "
                    f"{g.shape} and dtype {g.dtype}, where the model_state it received has "
                    f"{w.shape} and {w.dtype} (has_state=True). {fix}"
                )

    def __call__(self, params: Any, model_state: Any, *batch: Any) -> tuple[Any, Any]:
        flat = jax.tree_util.tree_leaves((params, model_state, *batch))
        try:
            out = jax.tree_util.tree_unflatten(self._out_tree, self._fun(*flat))
        except (TypeError, ValueError) as e:
            if "collective" in str(e):  # (shard_map's check of the axes a value varies over)
                e.add_note(
                    "stepfuse.jax: the fit runs loss_fn as the program jax.make_jaxpr traced "
                    "from it, where a collective (lax.pmean, psum) under jax.shard_map fails "
                    "JAX's check of the axes each value varies over. For data-parallel "
                    "training, place the batch with a NamedSharding instead (see the guide's "
                    "several devices): the fit's program then averages over the devices, "
                    "with no collective in loss_fn."
                )
            raise
        value, new_state, aux = self._parts(out, self.has_aux, self.has_state)
        if self.has_state:  # the same dtypes (checked), a weak type made strong for the carry
            new_state = jax.tree_util.tree_map(
                lambda n, s: jnp.asarray(n).astype(s.dtype), new_state, self._state_spec
            )
        return value, (new_state, aux)
