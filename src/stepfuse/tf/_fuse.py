"""`fuse`: the TF2 backend's entry point, its arguments checked before anything is built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core import check_options, shared_doc
from ._checks import _check_jit_compile, _check_optimizer, _check_variables, _fail
from ._fit import Fit

__all__ = ["fuse"]


@shared_doc
def fuse(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    variables: Any,
    *,
    steps: int,
    tol: float | None = None,
    record_every: int = 1,
    callback: Callable[[int, float], Any] | None = None,
    every: int | None = None,
    progress: bool = False,
    on_nonfinite: str = "stop",
    mode: str = "fused",
    jit_compile: bool = True,
    eval_fn: Callable[..., Any] | None = None,
    eval_every: int | None = None,
) -> Fit:
    """Build a fused fit that runs many Keras-optimizer steps in one ``tf.function`` call.

    Args:
      loss_fn: ``loss_fn(*batch)`` reads the variables and returns a scalar float tensor.
        It is traced once (its Python body runs at trace time only).
      optimizer: a Keras 3 optimizer (``keras.optimizers.SGD``, ``Adam``, ``AdamW``,
        ``RMSprop``...). Its slot variables are built here; its own update rule is used.
      variables: a list of trainable float ``tf.Variable`` / ``keras.Variable``, a
        ``tf.Module`` or a built Keras model (its ``trainable_variables``).
      {options}
      jit_compile: XLA-compile the step loop (default), and the stepwise mode's step (so
        both draw alike). If an op can't be compiled, the first call warns and falls back
        to a plain ``tf.function``. A loss with random ops (Dropout) runs without XLA, with
        a warning: XLA draws other numbers than TensorFlow's kernels from the same seed,
        and the fit draws what the plain GradientTape loop draws.

    Returns:
      a `Fit`; ``trace = fit(*batch, steps=None)`` updates the variables and the optimizer
      state in place and returns a `stepfuse.Trace`. Any ``steps`` reuses the same traced
      program; so do new batch values of the same shapes and dtypes. With ``eval_fn``, a
      call passes ``fit(*batch, eval_batch=(...))`` and ``eval_fn(*eval_batch)``, reading
      the variables as ``loss_fn`` does, runs inside the loop; its results are
      ``trace.eval``.

    Example:
      >>> import keras, tensorflow as tf, stepfuse.tf as sf
      >>> from stepfuse.problems import blobs
      >>> x, y = blobs()
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
      >>> ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
      >>> fit = sf.fuse(lambda x, y: ce(y, model(x)), keras.optimizers.SGD(0.01), model, steps=3)
      >>> trace = fit(x, y)                 # 3 updates, one tf.function call
      >>> trace = fit(x, y, steps=1000)     # same program, no retrace
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
        _fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "callable as loss_fn(*batch) -> scalar tensor",
            "Pass a function that reads the variables and returns the loss.",
        )
    _check_optimizer(optimizer)
    # A model's non-trainable variables (BatchNorm statistics, dropout seeds) change in the
    # forward pass: a refused step puts them back too.
    held = list(getattr(variables, "non_trainable_variables", None) or [])  # a module's or model's
    variables = _check_variables(variables)
    _check_jit_compile(jit_compile)
    return Fit(loss_fn, optimizer, variables, opts, jit_compile, held=held)
