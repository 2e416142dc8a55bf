"""Bad input to the PyTorch backend, one table: every case raises a TypeError/ValueError
that names the argument (a callback's own error reaches the caller unchanged) and leaves
the parameters AND ``optimizer.state`` exactly as they were (compared bitwise).

Most cases run ``mode="stepwise"`` (no compile); the last block repeats the call-time
cases on one compiled fused fit, which keeps working (and is not recompiled) after them.
A batch that does not fit ``loss_fn`` surfaces torch's own error as the ``__cause__``
of a `stepfuse.torch.BatchError` (a ValueError, and still a RuntimeError) naming `batch`.

Labels out of range in a batch whose shapes/dtypes were already seen by the fit (the
batch is checked eagerly once per signature, not per call) are found by the compiled
program's bounds check: a `BatchError` too, with torch's error as its cause, and nothing
changes.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch_helpers import (
    X,
    Y,
    assert_close_lists,
    assert_fused,
    assert_mode,
    assert_same_state,
    make,
    params_of,
    reference_steps,
    state_of,
)

import stepfuse.torch as sf


class NotATorchOptimizer:
    """A duck-typed optimizer of no framework (has step/zero_grad, is no torch.optim.Optimizer)."""

    param_groups = []

    def step(self):
        pass

    def zero_grad(self):
        pass


def _foreign_optimizers():
    out = [("dummy", lambda: NotATorchOptimizer()), ("str", lambda: "sgd")]
    if importlib.util.find_spec("optax") is not None:
        out.append(("optax.sgd", lambda: __import__("optax").sgd(0.1)))
    if importlib.util.find_spec("keras") is not None:

        def keras_sgd():
            import os

            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            import keras

            return keras.optimizers.SGD(0.1)

        out.append(("keras.SGD", keras_sgd))
    return out


def _frozen_param_optimizer(model):
    # Frozen parameters among trainable ones are skipped as torch.optim skips them; an
    # optimizer with nothing to train is refused.
    frozen = torch.zeros(2, requires_grad=False)
    return torch.optim.SGD([frozen], lr=0.1)


def _int_param_optimizer(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["params"].append(torch.zeros(2, dtype=torch.int64))
    return opt


def boom(step, loss):
    raise RuntimeError(f"callback failed at step {step}")


# (id, fuse kwargs or a factory, call args, exception, the name it must contain)
# ``build(model, optimizer, loss_fn)`` -> something to call, or raises itself.
def fuse_kw(**kw):
    return lambda m, o, f: sf.fuse(f, o, **{"steps": 3, "mode": "stepwise", **kw})


def fuse_loss(loss):
    return lambda m, o, f: sf.fuse(lambda x, y: loss(m, x, y), o, steps=3, mode="stepwise")(X, Y)


def fuse_opt(make_opt):
    return lambda m, o, f: sf.fuse(f, make_opt(m), steps=3, mode="stepwise")(X, Y)


def call(*batch, **kw):
    return lambda m, o, f: sf.fuse(f, o, steps=3, mode="stepwise")(*batch, **kw)


CASES = [
    # -- options, refused by fuse() ------------------------------------------------------
    ("steps=0", fuse_kw(steps=0), ValueError, "steps"),
    ("steps=-3", fuse_kw(steps=-3), ValueError, "steps"),
    ("steps=2.5", fuse_kw(steps=2.5), TypeError, "steps"),
    ("steps=True", fuse_kw(steps=True), TypeError, "steps"),
    ("steps='10'", fuse_kw(steps="10"), TypeError, "steps"),
    ("tol=-1", fuse_kw(tol=-1.0), ValueError, "tol"),
    ("tol=nan", fuse_kw(tol=float("nan")), ValueError, "tol"),
    ("tol='small'", fuse_kw(tol="small"), TypeError, "tol"),
    ("record_every=0", fuse_kw(record_every=0), ValueError, "record_every"),
    ("record_every=1.5", fuse_kw(record_every=1.5), TypeError, "record_every"),
    ("every=0", fuse_kw(callback=boom, every=0), ValueError, "every"),
    ("every=2.0", fuse_kw(callback=boom, every=2.0), TypeError, "every"),
    ("every without callback", fuse_kw(every=5), ValueError, "every"),
    ("callback=3", fuse_kw(callback=3), TypeError, "callback"),
    ("progress='yes'", fuse_kw(progress="yes"), TypeError, "progress"),
    ("on_nonfinite='ignore'", fuse_kw(on_nonfinite="ignore"), ValueError, "on_nonfinite"),
    ("mode='fast'", fuse_kw(mode="fast"), ValueError, "mode"),
    ("model='net'", fuse_kw(model="net"), TypeError, "model"),
    ("chunk=0", fuse_kw(chunk=0), ValueError, "chunk"),
    ("clip_grad_norm=0", fuse_kw(clip_grad_norm=0.0), ValueError, "clip_grad_norm"),
    ("clip_grad_value='1'", fuse_kw(clip_grad_value="1"), TypeError, "clip_grad_value"),
    ("loss_fn=3", lambda m, o, f: sf.fuse(3, o, steps=3), TypeError, "loss_fn"),
    # -- optimizers and parameters, refused by fuse() ----------------------------------------
    *[
        (
            f"optimizer={name}",
            (lambda mk: lambda m, o, f: sf.fuse(f, mk(), steps=3))(mk),
            TypeError,
            "optimizer",
        )
        for name, mk in _foreign_optimizers()
    ],
    ("every param requires_grad=False", fuse_opt(_frozen_param_optimizer), ValueError, "optimizer"),
    ("param of integer dtype", fuse_opt(_int_param_optimizer), TypeError, "optimizer"),
    # -- the loss, refused by the first call before any step ----------------------------------
    (
        "loss not scalar",
        fuse_loss(lambda m, x, y: F.cross_entropy(m(x), y, reduction="none")),
        ValueError,
        "loss_fn",
    ),
    (
        "loss of integer dtype",
        fuse_loss(lambda m, x, y: (m(x).argmax(1) == y).sum()),
        TypeError,
        "loss_fn",
    ),
    (
        "loss a Python float",
        fuse_loss(lambda m, x, y: float(F.cross_entropy(m(x), y))),
        TypeError,
        "loss_fn",
    ),
    ("loss independent of params", fuse_loss(lambda m, x, y: (x**2).mean()), ValueError, "loss_fn"),
    # -- the batch, refused by the first call before any step ---------------------------------
    ("x with 3 features", call(torch.zeros(50, 3), Y), ValueError, "batch"),
    ("x float64", call(X.double(), Y), ValueError, "batch"),
    ("y shorter than x", call(X, Y[:49]), ValueError, "batch"),
    ("label out of range", call(X, Y + 5), ValueError, "batch"),
    ("missing y", call(X), TypeError, "batch"),
    ("one argument too many", call(X, Y, Y), TypeError, "batch"),
    (
        "a DataLoader",
        call(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=10)),
        TypeError,
        "batch",
    ),
    # -- per call -------------------------------------------------------------------------
    ("call steps=0", call(X, Y, steps=0), ValueError, "steps"),
    ("call steps=2.5", call(X, Y, steps=2.5), TypeError, "steps"),
]


@pytest.fixture
def adam_perceptron():
    """The seed perceptron with Adam after one plain step (state to protect)."""
    model, optimizer, loss_fn = make("perceptron", "adam")
    reference_steps(model, optimizer, 1)
    return model, optimizer, loss_fn


def assert_unchanged(model, optimizer, params, state):
    assert_close_lists(params_of(model), params, rtol=0, atol=0)
    assert_same_state(state_of(optimizer), state, rtol=0, atol=0)


@pytest.mark.parametrize("build, exc, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument_and_changes_nothing(adam_perceptron, build, exc, name):
    model, optimizer, loss_fn = adam_perceptron
    params, state = params_of(model), state_of(optimizer)
    with pytest.raises(exc) as err:
        build(model, optimizer, loss_fn)
    assert f"`{name}`" in str(err.value), str(err.value)
    assert "got" in str(err.value) or name == "batch", str(err.value)
    assert_unchanged(model, optimizer, params, state)


def test_a_dataloader_passed_as_the_batch_is_told_how_to_stack_its_batches(adam_perceptron):
    model, optimizer, loss_fn = adam_perceptron
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=10)
    with pytest.raises(TypeError, match=r"Batches\.from_iterable\(loader, n\)"):
        sf.fuse(loss_fn, optimizer, steps=2, model=model)(loader)


def test_the_table_counts_its_cases():
    # the count reported in the report; keeps the table from shrinking silently
    assert len(CASES) >= 35


def test_batch_error_keeps_torchs_error_and_is_still_a_runtime_error(adam_perceptron):
    model, optimizer, loss_fn = adam_perceptron
    fit = sf.fuse(loss_fn, optimizer, steps=3, mode="stepwise")
    with pytest.raises(RuntimeError) as err:
        fit(torch.zeros(50, 3), Y)
    assert isinstance(err.value, sf.BatchError) and isinstance(err.value, ValueError)
    assert "mat1 and mat2" in str(err.value.__cause__)
    assert "(50, 3)" in str(err.value)


@pytest.mark.parametrize("kind", ["numpy", "list"])
def test_a_numpy_or_list_batch_is_named_with_the_fix(adam_perceptron, kind):
    """torch's own TypeError (``linear(): ... must be Tensor``) becomes one that names the
    argument and says to pass tensors; nothing changes."""
    model, optimizer, loss_fn = adam_perceptron
    before = [p.detach().clone() for p in model.parameters()]
    fit = sf.fuse(loss_fn, optimizer, steps=3)
    x = X.numpy() if kind == "numpy" else X.tolist()
    with pytest.raises(
        TypeError, match=r"`batch` does not fit .*Argument\(s\) 0 .*torch.as_tensor"
    ):
        fit(x, Y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert fit.step == 0


@pytest.mark.parametrize("mode", ["stepwise", "fused"])
def test_a_raising_callback_reaches_the_user_with_the_state_of_the_last_completed_step(mode):
    model, optimizer, loss_fn = make("perceptron", "adam")
    seen = []

    def cb(step, loss):
        seen.append(step)
        if step == 4:
            raise ZeroDivisionError("user bug in the callback")

    fit = sf.fuse(loss_fn, optimizer, steps=8, callback=cb, every=2, mode=mode, chunk=2)
    with pytest.raises(ZeroDivisionError, match="user bug"):
        fit(X, Y)
    assert_mode(fit, mode)
    assert seen == [2, 4] and fit.step == 4
    ref_m, ref_o, _ = make("perceptron", "adam")
    reference_steps(ref_m, ref_o, 4)
    assert_close_lists(params_of(model), params_of(ref_m))
    assert_same_state(state_of(optimizer), state_of(ref_o))
    # and the fit carries on from there
    fit.opts = dataclasses.replace(fit.opts, callback=None, every=None)
    assert fit(X, Y, steps=2).steps == 2
    reference_steps(ref_m, ref_o, 2)
    assert_close_lists(params_of(model), params_of(ref_m))


# -- the same call-time errors on one compiled (fused) fit ------------------------------------


@pytest.fixture(scope="module")
def fused_fit():
    model, optimizer, loss_fn = make("perceptron", "adam")
    fit = sf.fuse(loss_fn, optimizer, steps=4, chunk=2)
    fit(X, Y, steps=3)  # compiles; state exists
    assert_fused(fit)
    assert fit.compiles == 1
    return model, optimizer, fit


FUSED_CALLS = [
    ("steps=0", dict(steps=0), (X, Y), ValueError, "steps"),
    ("steps=-1", dict(steps=-1), (X, Y), ValueError, "steps"),
    ("steps=1.0", dict(steps=1.0), (X, Y), TypeError, "steps"),
    ("x with 3 features", {}, (torch.zeros(50, 3), Y), ValueError, "batch"),
    ("x float64", {}, (X.double(), Y), ValueError, "batch"),
    ("y shorter than x", {}, (X, Y[:49]), ValueError, "batch"),
    # Same shapes and dtypes as an already checked batch: the values are not checked again
    # (that would cost an eager step per call), so the compiled program's own bounds check
    # finds it, raised before any update is kept, as a BatchError naming the batch.
    ("label out of range, known signature", {}, (X, Y + 5), sf.BatchError, "batch"),
]


@pytest.mark.parametrize(
    "kw, batch, exc, name", [c[1:] for c in FUSED_CALLS], ids=[c[0] for c in FUSED_CALLS]
)
def test_fused_call_errors_change_nothing(fused_fit, kw, batch, exc, name):
    model, optimizer, fit = fused_fit
    params, state, step = params_of(model), state_of(optimizer), fit.step
    with pytest.raises(exc) as err:
        fit(*batch, **kw)
    assert (f"`{name}`" if exc is not RuntimeError else name) in str(err.value)
    assert_unchanged(model, optimizer, params, state)
    assert fit.step == step


def test_a_bad_label_mid_call_says_which_steps_were_applied():
    # The first call's eager step is applied before the program runs the others: the
    # error said "Nothing was changed" while fit.step was 1 and the weights had moved.
    import stepfuse

    model, optimizer, loss_fn = make("perceptron", "adam")
    ref_m, ref_o, _ = make("perceptron", "adam")
    ys = Y.expand(3, -1).clone()
    ys[2, 0] = 7  # two classes
    fit = sf.fuse(loss_fn, optimizer, steps=3, model=model)
    with pytest.raises(sf.BatchError, match=r"first 1 step\(s\) were applied.* 1 to 2"):
        fit(stepfuse.Batches(X.expand(3, -1, -1), ys))
    assert fit.step == 1
    reference_steps(ref_m, ref_o, 1)
    assert_close_lists(params_of(model), params_of(ref_m))


def test_fused_fit_still_matches_the_reference_after_the_errors(fused_fit):
    model, optimizer, fit = fused_fit
    trace = fit(X, Y, steps=5)
    ref_m, ref_o, _ = make("perceptron", "adam")
    ref = reference_steps(ref_m, ref_o, fit.step)
    np.testing.assert_allclose(trace.loss, ref[-5:], rtol=1e-6, atol=1e-7)
    assert_close_lists(params_of(model), params_of(ref_m))
    assert_same_state(state_of(optimizer), state_of(ref_o))
    assert fit.compiles == 1
