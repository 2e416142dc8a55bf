"""`fuse`: the JAX backend's entry point, its arguments checked before anything is built."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from .._core import check_options, fail, shared_doc
from ._fit import Fit

__all__ = ["fuse"]


@shared_doc
def fuse(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    steps: int,
    tol: float | None = None,
    record_every: int = 1,
    has_aux: bool = False,
    has_state: bool = False,
    callback: Callable[[int, float], Any] | None = None,
    every: int | None = None,
    progress: bool = False,
    on_nonfinite: str = "stop",
    mode: str = "fused",
    differentiable: bool = False,
    compiler_options: dict[str, Any] | None = None,
    eval_fn: Callable[..., Any] | None = None,
    eval_every: int | None = None,
) -> Fit:
    """Build a fused fit: ``steps`` optax updates of ``loss_fn`` in one compiled call.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar`` (or ``(scalar, aux)`` with
        ``has_aux=True``); a pure JAX function.
      optimizer: any ``optax.GradientTransformation`` (schedules, ``chain`` ...). A
        ``GradientTransformationExtraArgs`` gets ``value`` (the loss), ``grad`` and
        ``value_fn`` (the loss of params on this call's batch) at every step, as
        ``optax.lbfgs``, ``optax.contrib.reduce_on_plateau`` and ``optax.polyak_sgd`` need,
        ``obj_fn`` (the same function: ``optax.contrib.sophia``) and ``grad_fn``
        (``optax.contrib.sam``); an ``optax.MultiSteps`` is taken as its
        ``gradient_transformation()``. With ``optax.lookahead``, pass
        ``fit.init(optax.LookaheadParams.init_synced(params))``: ``loss_fn`` gets
        ``params.fast``.
      {options}
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the call returns the aux of the
        last evaluated step as a third value.
      has_state: the model has a state that is no parameter (flax ``batch_stats``, an
        nnx ``BatchStat``): ``loss_fn(params, model_state, *batch) -> (loss,
        new_model_state)`` (``(loss, (new_model_state, aux))`` with ``has_aux``), the
        loop carries it step to step and call to call (``fit.init(params,
        model_state)``, ``state.model_state``); a refused non-finite update leaves it
        at the last finite step too. ``eval_fn`` is then called as ``eval_fn(params,
        model_state, *eval_batch)``.
      differentiable: run the loop as a ``lax.scan`` of the built ``steps`` iterations
        (those past a call's ``steps=n``, and finished ones, masked) so that ``jax.grad``
        can go through it in reverse mode; one program serves every ``n`` (a call costs
        the built ``steps`` iterations, masked ones cheap). Chosen automatically when ``fit`` is
        called directly under ``jax.grad``; set it when ``fit`` sits inside a
        ``jax.jit`` that is then differentiated.
      compiler_options: XLA options for the fused program and the stepwise
        reference's step (``jax.jit(..., compiler_options=...)``), e.g.
        ``{"xla_cpu_experimental_ynn_fusion_type": ""}`` (on XLA:CPU a faster step for
        small models such as the seed's perceptron: see docs/internals/jax.md). Checked when
        `fuse` is called; ignored where ``fit`` is traced inside a user's ``jax.jit``
        (that ``jit``'s options apply).

    Returns:
      A `Fit`: ``state = fit.init(params)`` (``fit.init(params, model_state)`` with
      ``has_state``); ``state, trace = fit(state, *batch)``. With ``eval_fn``, a call
      passes ``fit(state, *batch, eval_batch=(...))`` and ``eval_fn(params, *eval_batch)``
      runs inside the compiled loop (``params``: those ``loss_fn`` gets), its results in
      ``trace.eval``.

    Example:
      >>> import jax.numpy as jnp, optax, stepfuse.jax as sf
      >>> fit = sf.fuse(lambda w, x: jnp.sum((w - x) ** 2), optax.sgd(0.1), steps=50)
      >>> state, trace = fit(fit.init(jnp.zeros(3)), jnp.ones(3))
      >>> trace.steps, round(float(state.params[0]), 4)
      (50, 1.0)
    """
    opts = check_options(
        steps,
        tol,
        record_every,
        callback,
        every,
        progress,
        on_nonfinite,
        mode,
        eval_fn=eval_fn,
        eval_every=eval_every,
    )
    if not callable(loss_fn):
        fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "callable as loss_fn(params, *batch)",
            "Pass the function that computes the loss.",
        )
    if not isinstance(optimizer, (optax.GradientTransformation, optax.MultiSteps)):
        raise TypeError(
            f"`optimizer` must be an optax.GradientTransformation; got {optimizer!r} "
            f"({type(optimizer).__module__}.{type(optimizer).__name__}). Pass e.g. optax.adam(1e-3); "
            "for Keras or torch.optim optimizers use stepfuse.tf or stepfuse.torch."
        )
    if isinstance(optimizer, optax.MultiSteps):  # a wrapper that builds its transformation
        optimizer = optimizer.gradient_transformation()
    for name, flag in (
        ("has_aux", has_aux),
        ("has_state", has_state),
        ("differentiable", differentiable),
    ):
        if not isinstance(flag, bool):
            fail(TypeError, name, flag, "True or False", "Pass a bool.")
    return Fit(
        loss_fn,
        optimizer,
        opts,
        has_aux,
        differentiable,
        _check_compiler_options(compiler_options),
        has_state,
    )


def _check_compiler_options(options: Any) -> dict[str, Any]:
    """``options`` as a dict XLA accepts (tried on a one-op program), or a clear error."""
    if options is None:
        return {}
    fix = (
        "Pass None or a dict of XLA option names to values, e.g. "
        '{"xla_cpu_experimental_ynn_fusion_type": ""}.'
    )
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        fail(TypeError, "compiler_options", options, "a dict with str keys", fix)
    bad = {k: v for k, v in options.items() if not isinstance(v, (str, bool, int, float))}
    if bad:
        raise TypeError(
            f"`compiler_options` values must be str, bool, int or float; got {bad!r}. {fix}"
        )
    options = dict(options)
    if options:
        if "compiler_options" not in inspect.signature(jax.jit).parameters:
            raise TypeError(
                f"`compiler_options` needs a jax whose jax.jit takes them; jax "
                f"{jax.__version__} does not. Upgrade jax, or pass None."
            )
        try:
            jax.jit(lambda x: x + 1, compiler_options=options)(np.float32(0))
        except Exception as e:  # XLA's error for an unknown name or a bad value
            raise ValueError(
                f"`compiler_options` {options!r} were refused by XLA "
                f"({jax.default_backend()}): {e}. {fix}"
            ) from e
    return options
