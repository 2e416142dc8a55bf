"""Test helpers shared by every backend's tests and by the conformance suite.

Nothing here imports a framework at import time: the registries build their optimizers
lazily, and the comparisons read arrays by duck typing (NumPy, JAX, TF and torch arrays,
nested in dicts, lists, tuples and NamedTuples).

- the problems: `X`, `Y` (the seed's blobs), `PROBLEMS` (initial parameters as NumPy);
- `OPTIMIZERS`: per backend, name -> factory, and `make_optimizer`;
- `splits`: a number of steps cut into calls;
- `to_numpy`, `leaves`, `assert_close`: tree comparison within a tolerance or bit for bit;
- `assert_fused`: a fit is fused, or the message says why not;
- `assert_max_compiles`: a fit compiled at most ``k`` programs;
- `assert_tol_stops_where_the_recorded_losses_say`: every backend's ``tol`` at the last bit.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import pytest

from stepfuse import Stop
from stepfuse.problems import SEED_LR, blobs, mlp_init, perceptron_init

__all__ = [
    "ATOL",
    "BACKENDS",
    "CATALOGUES",
    "OPTIMIZERS",
    "PROBLEMS",
    "RTOL",
    "X",
    "Y",
    "assert_close",
    "assert_fused",
    "assert_max_compiles",
    "assert_mode",
    "assert_tol_stops_where_the_recorded_losses_say",
    "leaves",
    "make_optimizer",
    "splits",
    "to_numpy",
]

BACKENDS = ("jax", "tf2", "tf1", "torch")

# The project's contract for fused against stepwise in float32 on CPU: 1e-6 relative.
RTOL, ATOL = 1e-6, 1e-7

X, Y = blobs()  # the seed's 50 two-dimensional points in two blobs (float32, int32)

PROBLEMS: dict[str, Callable[[], Any]] = {
    # the seed's 2->2 dense layer: {"kernel": ones (2, 2), "bias": zeros (2,)}
    "perceptron": perceptron_init,
    # a 2-16-2 tanh MLP: [{"kernel", "bias"}, {"kernel", "bias"}]
    "mlp": lambda: mlp_init((2, 16, 2)),
}


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _optax() -> Any:
    return _module("optax")


def _keras() -> Any:
    return _module("keras")


def _tf1() -> Any:
    return _module("tensorflow").compat.v1


def _torch_optim() -> Any:
    return _module("torch").optim


# Per backend, name -> factory: ``factory()`` for jax / tf2 / tf1 (tf1 inside the graph
# being built), ``factory(params)`` for torch. The first names are the ones the
# conformance suite runs on every backend with the same hyper-parameters; the others are
# the backends' own test registries (tests/test_jax.py, tf_helpers.py, test_tf_v1.py,
# torch_helpers.py), to be used in their place.
OPTIMIZERS: dict[str, dict[str, Callable[..., Any]]] = {
    "jax": {
        "sgd": lambda: _optax().sgd(SEED_LR),
        "momentum": lambda: _optax().sgd(0.05, momentum=0.9),
        "adam": lambda: _optax().adam(0.01),
        "diverging": lambda: _optax().sgd(1e37, momentum=0.9),
        "sgd_nesterov": lambda: _optax().sgd(0.05, momentum=0.9, nesterov=True),
        "adamw": lambda: _optax().adamw(0.01, weight_decay=0.1),
        "rmsprop": lambda: _optax().rmsprop(0.1),
    },
    "tf2": {
        "sgd": lambda: _keras().optimizers.SGD(SEED_LR),
        "momentum": lambda: _keras().optimizers.SGD(0.05, momentum=0.9),
        "adam": lambda: _keras().optimizers.Adam(0.01),
        "diverging": lambda: _keras().optimizers.SGD(1e37, momentum=0.9),
        "sgd_momentum_nesterov": lambda: _keras().optimizers.SGD(0.05, momentum=0.9, nesterov=True),
        "adamw": lambda: _keras().optimizers.AdamW(0.05, weight_decay=0.01),
        "rmsprop": lambda: _keras().optimizers.RMSprop(0.01, momentum=0.5),
    },
    "tf1": {
        "sgd": lambda: _tf1().train.GradientDescentOptimizer(SEED_LR),
        "momentum": lambda: _tf1().train.MomentumOptimizer(0.05, 0.9),
        "adam": lambda: _tf1().train.AdamOptimizer(0.01),
        "diverging": lambda: _tf1().train.MomentumOptimizer(1e37, 0.9),
        "momentum_nesterov": lambda: _tf1().train.MomentumOptimizer(0.05, 0.9, use_nesterov=True),
        "rmsprop": lambda: _tf1().train.RMSPropOptimizer(0.01, momentum=0.5),
    },
    "torch": {
        "sgd": lambda params: _torch_optim().SGD(params, lr=SEED_LR),
        "momentum": lambda params: _torch_optim().SGD(params, lr=0.05, momentum=0.9),
        "adam": lambda params: _torch_optim().Adam(params, lr=0.01),
        "diverging": lambda params: _torch_optim().SGD(params, lr=1e37, momentum=0.9),
        "sgd_nesterov": lambda params: _torch_optim().SGD(
            params, lr=0.05, momentum=0.9, nesterov=True
        ),
        "adamw": lambda params: _torch_optim().AdamW(params, lr=0.01, weight_decay=0.1),
        "rmsprop": lambda params: _torch_optim().RMSprop(
            params, lr=0.01, momentum=0.5, centered=True
        ),
        "adagrad": lambda params: _torch_optim().Adagrad(params, lr=0.1),
    },
}


# The backends' own test catalogues (wider than the shared names above): test_jax.py,
# test_tf.py, test_tf_v1.py and test_torch.py parametrize over them.
CATALOGUES: dict[str, dict[str, Callable[..., Any]]] = {
    "jax": {
        "sgd": lambda: _optax().sgd(0.05),
        "sgd_momentum": lambda: _optax().sgd(0.05, momentum=0.9),
        "sgd_nesterov": lambda: _optax().sgd(0.05, momentum=0.9, nesterov=True),
        "adam": lambda: _optax().adam(0.01),
        "adamw": lambda: _optax().adamw(0.01, weight_decay=0.1),
        "adam_cosine_schedule": lambda: _optax().adam(_optax().cosine_decay_schedule(0.02, 40)),
        "sgd_exponential_schedule": lambda: _optax().sgd(_optax().exponential_decay(0.1, 5, 0.7)),
        # optax's GradientTransformationExtraArgs that read the loss, re-evaluate it or its gradient
        "lbfgs": lambda: _optax().lbfgs(),
        "adam_reduce_on_plateau": lambda: _optax().chain(
            _optax().adam(0.05),
            _optax().contrib.reduce_on_plateau(factor=0.5, patience=1, rtol=0.2),
        ),
        "polyak_sgd": lambda: _optax().polyak_sgd(max_learning_rate=0.5),
        "sgd_backtracking_linesearch": lambda: _optax().chain(
            _optax().sgd(2.0), _optax().scale_by_backtracking_linesearch(max_backtracking_steps=15)
        ),
        "sam": lambda: _optax().contrib.sam(_optax().sgd(0.1), _optax().sgd(0.05), sync_period=3),
        # a wrapper, not a GradientTransformation: accumulates 3 gradients per update
        "multi_steps_adam": lambda: _optax().MultiSteps(_optax().adam(0.05), every_k_schedule=3),
        # sam inside a chain, which hands every extra argument to it (sam takes grad_fn only)
        "clip_sam": lambda: _optax().chain(
            _optax().clip_by_global_norm(1.0),
            _optax().contrib.sam(_optax().sgd(0.1), _optax().sgd(0.05), sync_period=3),
        ),
        # states holding inf from the start: reduce_on_plateau's best value until its first
        # average of 3 losses; an injected max_norm=inf
        "adam_reduce_on_plateau_every_3": lambda: _optax().chain(
            _optax().adam(0.05),
            _optax().contrib.reduce_on_plateau(
                factor=0.5, patience=1, rtol=0.2, accumulation_size=3
            ),
        ),
        "sgd_clip_inf": lambda: _optax().chain(
            _optax().inject_hyperparams(_optax().clip_by_global_norm)(max_norm=math.inf),
            _optax().sgd(0.1),
        ),
    },
    "tf2": {
        "sgd": lambda: _keras().optimizers.SGD(SEED_LR),
        "sgd_momentum_nesterov": lambda: _keras().optimizers.SGD(0.05, momentum=0.9, nesterov=True),
        "adam": lambda: _keras().optimizers.Adam(0.05),
        "adamw": lambda: _keras().optimizers.AdamW(0.05, weight_decay=0.01),
        "rmsprop": lambda: _keras().optimizers.RMSprop(0.01, momentum=0.5),
    },
    "tf1": {
        "gd": lambda: _tf1().train.GradientDescentOptimizer(0.01),
        "momentum_nesterov": lambda: _tf1().train.MomentumOptimizer(0.05, 0.9, use_nesterov=True),
        "adam": lambda: _tf1().train.AdamOptimizer(0.05),
        "rmsprop": lambda: _tf1().train.RMSPropOptimizer(0.01, momentum=0.5),
    },
    # torch: ``factory(params)``; test_torch.py (adam_decoupled needs torch >= 2.8)
    "torch": {
        "sgd": lambda params: _torch_optim().SGD(params, lr=0.01),
        "sgd_momentum": lambda params: _torch_optim().SGD(params, lr=0.05, momentum=0.9),
        "sgd_nesterov": lambda params: _torch_optim().SGD(
            params, lr=0.05, momentum=0.9, nesterov=True
        ),
        "sgd_weight_decay": lambda params: _torch_optim().SGD(
            params, lr=0.05, momentum=0.5, dampening=0.1, weight_decay=0.1
        ),
        "adam": lambda params: _torch_optim().Adam(params, lr=0.01),
        "adamw": lambda params: _torch_optim().AdamW(params, lr=0.01, weight_decay=0.1),
        "adam_decoupled": lambda params: _torch_optim().Adam(
            params, lr=0.01, weight_decay=0.5, decoupled_weight_decay=True
        ),
        "rmsprop": lambda params: _torch_optim().RMSprop(
            params, lr=0.01, momentum=0.5, centered=True
        ),
        "adagrad": lambda params: _torch_optim().Adagrad(params, lr=0.1),
    },
}


def make_optimizer(backend: str, name: str, params: Any = None) -> Any:
    """A fresh optimizer ``name`` of ``backend`` (torch: over ``params``)."""
    factory = OPTIMIZERS[backend][name]
    return factory(params) if backend == "torch" else factory()


def splits(total: int, size: int) -> list[int]:
    """``total`` steps as calls of ``size`` steps, the last one shorter if need be."""
    if total < 1 or size < 1:
        raise ValueError(f"splits({total}, {size}): both must be >= 1")
    return [size] * (total // size) + ([total % size] if total % size else [])


# -- trees of arrays --------------------------------------------------------------------------


def to_numpy(value: Any) -> np.ndarray:
    """One array (NumPy, JAX, TF, torch, or a Python number) as a NumPy array (a copy)."""
    if hasattr(value, "detach"):  # torch.Tensor
        value = value.detach().cpu().numpy()
    elif hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # tf.Tensor / Variable
        value = value.numpy()
    return np.array(value)


def _numbers(value: Any) -> bool:
    """A list or tuple of plain numbers (losses gathered on the host): one array leaf."""
    return (
        isinstance(value, (list, tuple))
        and not hasattr(value, "_fields")
        and len(value) > 0
        and all(isinstance(v, (int, float, np.number)) for v in value)
    )


def leaves(tree: Any, path: str = "") -> list[tuple[str, np.ndarray]]:
    """``(path, array)`` for every leaf of a nested dict / list / tuple / NamedTuple, in a
    fixed order (dict keys sorted, as ``jax.tree_util`` does); ``None`` leaves are kept
    as ``None`` so that two trees with a missing entry in the same place compare equal.
    A list of plain numbers is one leaf (an array)."""
    if tree is None:
        return [(path or "<root>", None)]
    if _numbers(tree):
        return [(path or "<root>", np.asarray(tree))]
    if isinstance(tree, Mapping):
        out = []
        for key in sorted(tree, key=repr):
            out += leaves(tree[key], f"{path}[{key!r}]")
        return out
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a NamedTuple
        out = []
        for field in tree._fields:
            out += leaves(getattr(tree, field), f"{path}.{field}")
        return out
    if isinstance(tree, (list, tuple)):
        out = []
        for i, item in enumerate(tree):
            out += leaves(item, f"{path}[{i}]")
        return out
    return [(path or "<root>", to_numpy(tree))]


def assert_close(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL, what: str = "") -> None:
    """Two trees of arrays have the same structure, shapes and values: within
    ``rtol``/``atol``, or bit for bit (NaN equal to NaN) when both are 0."""
    la, lb = leaves(a), leaves(b)
    pa, pb = [p for p, _ in la], [p for p, _ in lb]
    assert pa == pb, f"{what}: different structures:\n  {pa}\n  {pb}"
    for (path, u), (_, v) in zip(la, lb):
        where = f"{what}{path}"
        if u is None or v is None:
            assert u is None and v is None, f"{where}: {u!r} against {v!r}"
            continue
        assert u.shape == v.shape, f"{where}: shapes {u.shape} and {v.shape}"
        if rtol == 0 and atol == 0:
            np.testing.assert_array_equal(u, v, err_msg=f"{where} (bit for bit)")
        else:
            np.testing.assert_allclose(u, v, rtol=rtol, atol=atol, err_msg=where)


# -- fits -------------------------------------------------------------------------------------


def fallback_reason(fit: Any) -> str:
    """Why ``fit`` is not fused, as far as it says."""
    reason = getattr(fit, "fallback_reason", None)
    return reason if reason else "(the fit gives no fallback_reason)"


def assert_mode(fit: Any, mode: str = "fused") -> None:
    """``fit.mode == mode``; the message carries the fit's reason for falling back."""
    if not hasattr(fit, "mode"):
        raise AssertionError(f"{type(fit).__module__}.{type(fit).__qualname__} has no `mode`")
    assert fit.mode == mode, (
        f"{type(fit).__qualname__}.mode is {fit.mode!r}, not {mode!r}: {fallback_reason(fit)}"
    )


def assert_fused(fit: Any) -> None:
    """``fit.mode == "fused"``; the message carries the fit's reason for falling back."""
    assert_mode(fit, "fused")


def assert_max_compiles(fit: Any, k: int, *, at_least: int = 1) -> None:
    """``fit.compiles`` is at most ``k`` (and at least ``at_least``: a counter that never
    counts would pass any maximum)."""
    if not hasattr(fit, "compiles"):
        raise AssertionError(
            f"{type(fit).__module__}.{type(fit).__qualname__} has no `compiles` counter"
        )
    n = fit.compiles
    assert at_least <= n <= k, (
        f"{type(fit).__qualname__}.compiles == {n}: expected between {at_least} and {k} "
        f"(one program for every steps=n and batch values of the same shapes)"
    )


def concat(traces: Iterable[Any]) -> np.ndarray:
    """The recorded losses of several calls, end to end."""
    parts = [np.asarray(t.loss) for t in traces]
    return np.concatenate(parts) if parts else np.zeros((0,), np.float32)


def assert_tol_stops_where_the_recorded_losses_say(run, losses, at=(20, 40)):
    """``run(tol)`` makes a fresh fit with that ``tol`` and returns its `Trace`; ``losses``
    are the same fit's losses without ``tol``. For ``tol`` equal to a recorded difference
    and an ulp either side, the loop stops exactly where its own recorded losses first meet
    ``tol``, and records the same losses up to there.

    (XLA fuses a loss's last operation into the comparison with the loss before and may
    round that copy differently, an FMA, from the one recorded; a loop comparing that copy
    stopped a step early or late for about half of these tols.)
    """
    losses = np.asarray(losses)
    diffs = np.abs(np.diff(losses.astype(np.float64)))
    for i in at:
        for tol in (diffs[i], np.nextafter(diffs[i], 0), np.nextafter(diffs[i], 1)):
            trace = run(float(tol))
            recorded = np.asarray(trace.loss)
            np.testing.assert_array_equal(recorded, losses[: len(recorded)])
            met = np.nonzero(np.abs(np.diff(recorded.astype(np.float64))) <= tol)[0]
            assert trace.stop is Stop.TOL and len(met) == 1 and trace.steps == met[0] + 2, (
                i,
                tol,
                trace,
            )


def slow_params(values: Iterable[Any], slow: Iterable[Any]) -> list[Any]:
    """``values`` for ``pytest.mark.parametrize``, those in ``slow`` marked slow (run with
    --runslow): the CI run keeps the others."""
    slow = set(slow)
    return [pytest.param(v, marks=pytest.mark.slow) if v in slow else v for v in values]


def examples(n: int) -> int:
    """A property test's Hypothesis examples: ``n`` with --runslow (or STEPFUSE_SLOW=1),
    half as many in CI (where the test is derandomized, the first half of the same ones)."""
    return n if os.environ.get("STEPFUSE_SLOW") == "1" else max(1, n // 2)


# The notification cases of the backends' test_notifications_leave_the_results_unchanged:
# (notify, record_every); in CI a bar alone (bar-1) and a bar with a callback (both-3), all
# six with --runslow.
_NOTIFY = {
    "bar": {"progress": True},
    "callback": {"callback": lambda s, l: None},
    "both": {"progress": True, "callback": lambda s, l: None},
}
NOTIFICATION_CASES = [
    pytest.param(
        notify,
        every,
        id=f"{name}-{every}",
        marks=() if (name, every) in (("bar", 1), ("both", 3)) else pytest.mark.slow,
    )
    for name, notify in _NOTIFY.items()
    for every in (1, 3)
]
