"""What the JAX backend checks before anything runs: the parameters, an optimizer state
against its optimizer, and ``loss_fn`` (traced once into `Loss`, whose output is checked).

The checks of a call's inputs run while the fused program is traced, so a call pays
nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["Loss", "check_opt_state", "check_params", "inputs_reaching_output"]


def _leaves_with_paths(tree: Any) -> list:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def check_params(params: Any, name: str = "params") -> None:
    """Raise unless ``params`` holds at least one array, all of them floating-point."""
    leaves = _leaves_with_paths(params)
    if not leaves:
        raise ValueError(
            f"`{name}` must hold at least one float array; got {params!r} (no array leaves). "
            "Pass the model's parameters, e.g. a dict of jnp arrays."
        )
    for path, leaf in leaves:
        dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"`{name}` must hold only floating-point arrays; got dtype {dtype} at "
                f"{name}{jax.tree_util.keystr(path)} (value {leaf!r}). Cast it, e.g. "
                "jnp.asarray(x, jnp.float32), or close over non-trainable values in loss_fn."
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


def _short(tree: Any, limit: int = 400) -> str:
    text = str(tree)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


class Loss:
    """``loss_fn`` traced once into a jaxpr whose output is checked before anything runs.

    ``loss(params, *batch)`` is ``(loss, aux)`` (``aux`` None without ``has_aux``).
    """

    def __init__(self, loss_fn: Callable[..., Any], has_aux: bool, params: Any, batch: tuple):
        try:
            closed, shape = jax.make_jaxpr(loss_fn, return_shape=True)(params, *batch)
        except (TypeError, ValueError) as e:
            shapes = jax.tree_util.tree_map(lambda a: tuple(np.shape(a)), (params, batch))
            # The plain type: JAX's own subclasses (ConcretizationTypeError ...) take a tracer.
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"`loss_fn(params, *batch)` failed with params/batch shapes {shapes}: {e} "
                "Check that the batch passed to fit(state, *batch) fits the model."
            ) from e
        if has_aux and not (isinstance(shape, (tuple, list)) and len(shape) == 2):
            raise TypeError(
                f"`loss_fn` must return (loss, aux) with has_aux=True; got {shape!r}. "
                "Return a pair, or build with has_aux=False."
            )
        out = shape[0] if has_aux else shape
        if (
            not isinstance(out, jax.ShapeDtypeStruct)
            or out.shape != ()
            or not jnp.issubdtype(out.dtype, jnp.floating)
        ):
            desc = f"shape {out.shape}, dtype {out.dtype}" if hasattr(out, "shape") else repr(out)
            raise TypeError(
                f"`loss_fn` must return a floating-point scalar{' (with aux)' if has_aux else ''}; "
                f"got {desc}. Reduce it to a scalar (e.g. jnp.mean) and make it float "
                "(e.g. .astype(jnp.float32))."
            )
        n_params = len(jax.tree_util.tree_leaves(params))
        if not any(inputs_reaching_output(closed.jaxpr)[:n_params]):
            raise ValueError(
                "`loss_fn` does not depend on `params`: every gradient would be zero and no "
                "step would change anything. Compute the loss from the params argument "
                "(not from arrays closed over) and do not wrap it in stop_gradient."
            )
        self.dtype = out.dtype
        self.aux_shape = shape[1] if has_aux else None
        _, self._in_tree = jax.tree_util.tree_flatten((params, *batch))
        self._out_tree = jax.tree_util.tree_structure(shape)
        self._fun = jax.extend.core.jaxpr_as_fun(closed)
        self.has_aux = has_aux

    def __call__(self, params: Any, *batch: Any) -> tuple[Any, Any]:
        flat = jax.tree_util.tree_leaves((params, *batch))
        out = jax.tree_util.tree_unflatten(self._out_tree, self._fun(*flat))
        return out if self.has_aux else (out, None)
