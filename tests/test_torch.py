"""stepfuse.torch: fused and stepwise fits against plain PyTorch training.

The reference everywhere is ``opt.zero_grad(); loss.backward(); opt.step()`` written
here. Compiles are the slow part (docs/internals/torch.md), so compiled fits are
shared by module-scoped fixtures, and the four SGD variants are covered in the fused
mode by one SGD with four parameter groups (one compile) on the MLP; the stepwise mode
runs the full optimizer x model matrix.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from helpers import slow_params
from torch_helpers import (
    OPTIMIZERS,
    STATE_ATOL,
    X,
    Y,
    assert_close_lists,
    assert_fused,
    assert_mode,
    assert_same_state,
    make,
    mlp,
    params_of,
    reference_steps,
    reset,
    sgd_variants_groups,
    state_of,
)

import stepfuse.torch as sf
from stepfuse import NonFiniteError, Stop
from stepfuse.torch import _cuda as torch_cuda
from stepfuse.torch import _plan as torch_plan

CALLS = (3, 1, 4)  # steps of successive calls: a remainder, a single step, two chunks


def run_calls(fit, calls=CALLS, x=X, y=Y):
    traces = [fit(x, y, steps=n) for n in calls]
    return np.concatenate([t.loss for t in traces]), traces


def check_against_reference(model_name, opt=None, groups=None, mode="fused", fit_kwargs=None):
    model, optimizer, loss_fn = make(model_name, opt, groups)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no silent fallback
        fit = sf.fuse(loss_fn, optimizer, steps=4, mode=mode, **(fit_kwargs or {}))
        losses, traces = run_calls(fit)
    assert_mode(fit, mode)
    ref_model, ref_opt, _ = make(model_name, opt, groups)
    ref_losses = reference_steps(ref_model, ref_opt, sum(CALLS))
    assert [t.steps for t in traces] == list(CALLS)
    assert all(t.stop == Stop.STEPS for t in traces)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-7)
    assert_close_lists(params_of(model), params_of(ref_model))
    assert_same_state(state_of(optimizer), state_of(ref_opt), atol_by_key=STATE_ATOL.get(opt))
    # ordinary PyTorch carries on exactly as after the reference run
    after = reference_steps(model, optimizer, 2)
    np.testing.assert_allclose(after, reference_steps(ref_model, ref_opt, 2), rtol=1e-6, atol=1e-7)
    assert_close_lists(params_of(model), params_of(ref_model))
    return fit


# -- stepwise mode: the whole matrix --------------------------------------------------------


@pytest.mark.parametrize("model_name", ["perceptron", "mlp"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_stepwise_matches_torch_reference(model_name, opt):
    check_against_reference(model_name, opt, mode="stepwise")


@pytest.mark.parametrize(
    "dtype, recorded",
    [(torch.float64, np.float64), (torch.float32, np.float32), (torch.bfloat16, np.float32)],
)
def test_stepwise_trace_keeps_the_loss_precision_as_the_fused_one(dtype, recorded):
    """float64 losses stay float64, others are recorded as float32 (the fused trace's rule);
    the stepwise trace was float64 for every model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2).to(dtype)
    x, y = torch.randn(8, 2, dtype=dtype), torch.randint(0, 2, (8,))
    fit = sf.fuse(
        lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
        torch.optim.SGD(model.parameters(), lr=0.1),
        steps=3,
        mode="stepwise",
    )
    trace = fit(x, y)
    assert trace.steps == 3 and trace.loss.dtype == recorded
    ref = torch.nn.functional.cross_entropy(model(x), y).item()  # the loss after the 3 steps
    assert float(fit(x, y, steps=1).loss[0]) == ref  # recorded exactly


# -- fused mode -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sgd_fit():
    """One compiled fit (seed perceptron, SGD lr 0.01) shared by several tests; reset per use."""
    model, optimizer, loss_fn = make("perceptron", "sgd")
    fit = sf.fuse(loss_fn, optimizer, steps=3, chunk=2)
    return model, optimizer, fit


# CI compiles Adam's and RMSprop's. Adagrad (its options are test_torch_optimizers'
# sample's), AdamW and Adam(decoupled_weight_decay) (Adam's update code) run with
# --runslow, one compile each.
@pytest.mark.parametrize(
    "opt",
    ["adam", "rmsprop"]
    + [
        pytest.param(o, marks=pytest.mark.slow)
        for o in ("adagrad", "adamw", "adam_decoupled")
        if o in OPTIMIZERS
    ],
)
def test_fused_matches_torch_reference_perceptron(opt):
    fit = check_against_reference("perceptron", opt, fit_kwargs={"chunk": 2})
    assert fit.compiles == 1


def test_fused_sgd_matches_torch_reference_perceptron(sgd_fit):
    model, optimizer, fit = sgd_fit
    reset("perceptron", model, optimizer)
    losses, _ = run_calls(fit)
    assert_fused(fit)
    ref_model, ref_opt, _ = make("perceptron", "sgd")
    np.testing.assert_allclose(
        losses, reference_steps(ref_model, ref_opt, sum(CALLS)), rtol=1e-6, atol=1e-7
    )
    assert_close_lists(params_of(model), params_of(ref_model))


def test_fused_sgd_plain_momentum_nesterov_weight_decay_groups_mlp():
    fit = check_against_reference("mlp", groups=sgd_variants_groups, fit_kwargs={"chunk": 2})
    assert fit.compiles == 1


@pytest.mark.slow  # Adam is the perceptron's above, the mlp SGD's; the pair: --runslow
def test_fused_adam_mlp():
    check_against_reference("mlp", "adam", fit_kwargs={"chunk": 2})


@pytest.mark.default_chunk
def test_a_tiny_step_runs_four_steps_an_iteration_by_default_and_equals_the_reference():
    """No chunk given: the seed perceptron's step is tiny, so its loop runs 4 steps an
    iteration (calls of 3, 1 and 4 steps: a call's end inside an iteration, then a whole
    one); a 784-256-10 MLP on 1,024 rows is not tiny: 1 step. (The other fits of CI's run
    run tiny models 1 step an iteration: tests/conftest.py.)"""
    fit = check_against_reference("perceptron", "sgd_momentum")
    assert fit.plan["chunk"] == 4 and fit.plan["reason"].startswith("a tiny step"), fit.plan
    assert fit.compiles == 1
    big = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
    x, y = torch.randn(1024, 784), torch.randint(0, 10, (1024,))
    plan = torch_plan.choose(
        None, lambda x, y: torch.nn.functional.cross_entropy(big(x), y), [big], (x, y), rnn=False
    )
    assert plan.chunk == 1 and plan.reason.startswith("not a tiny step"), plan


def test_seed_row_k_equals_row_3k(sgd_fit):
    model, optimizer, fit = sgd_fit
    reset("perceptron", model, optimizer)
    start = fit.step
    three = [fit(X, Y) for _ in range(10)]
    assert_fused(fit)
    assert all(t.steps == 3 and t.loss.shape == (3,) for t in three)
    model1, opt1, loss1 = make("perceptron", "sgd")
    one = sf.fuse(loss1, opt1, steps=1, mode="stepwise")
    rows1 = [one(X, Y).loss[0] for _ in range(30)]
    rows3 = [t.loss[0] for t in three]
    assert rows3[0] == pytest.approx(math.log(2), abs=1e-6)
    np.testing.assert_allclose(rows3, rows1[::3], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.concatenate([t.loss for t in three]), rows1, rtol=1e-6, atol=1e-7)
    assert_close_lists(params_of(model), params_of(model1))
    assert fit.step - start == 30 and one.step == 30


def test_one_compile_serves_every_steps_and_new_batch_values(sgd_fit):
    model, optimizer, fit = sgd_fit
    reset("perceptron", model, optimizer)
    fit(X, Y, steps=1)
    before = fit.compiles
    for n in (1, 2, 5, 17, 3):
        assert fit(X, Y, steps=n).steps == n
    fit(X + 0.5, Y.flip(0), steps=4)  # new values, same shapes
    assert_fused(fit)
    assert fit.compiles == before == 1


CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the CUDA-graph path)"
)
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
TOL = {"cpu": dict(rtol=1e-6, atol=1e-7), "cuda": dict(rtol=1e-5, atol=1e-6)}
"""Fused against eager on one device: float32 on the CPU; on CUDA inductor's fused kernels
and torch's capturable update rules round differently from the eager kernels."""


# chunk 1: the default of all but tiny models. A stop inside a longer chunk is the
# conformance suite's (the perceptron's default chunk, 4): chunk 2 runs with --runslow.
@pytest.mark.parametrize("chunk", slow_params([1, 2], {2}))
@pytest.mark.parametrize("device", DEVICES)
def test_options_tol_record_every_callback_match_stepwise_oracle(device, chunk):
    seen = {"fused": [], "stepwise": []}
    fits = {}
    x, y, tol = X.to(device), Y.to(device), TOL[device]
    for mode in ("fused", "stepwise"):
        model, optimizer, loss_fn = make("perceptron", "adam")
        model.to(device)
        fits[mode] = (
            model,
            optimizer,
            sf.fuse(
                loss_fn,
                optimizer,
                steps=40,
                tol=8e-3,
                record_every=3,
                every=4,
                chunk=chunk,
                mode=mode,
                callback=lambda step, loss, mode=mode: seen[mode].append((step, loss)),
            ),
        )
    traces = {mode: [f(x, y, steps=n) for n in (5, 40)] for mode, (_, _, f) in fits.items()}
    assert_fused(fits["fused"][2])
    for tf, ts in zip(traces["fused"], traces["stepwise"]):
        assert (tf.steps, tf.stop) == (ts.steps, ts.stop)
        np.testing.assert_allclose(tf.loss, ts.loss, **tol)
    assert traces["fused"][0].stop == Stop.STEPS and traces["fused"][1].stop == Stop.TOL
    assert 0 < traces["fused"][1].steps < 40  # the converged call cost fewer steps
    assert len(traces["fused"][0].loss) == 2  # steps 0 and 3 of 5
    assert [s for s, _ in seen["fused"]] == [s for s, _ in seen["stepwise"]]
    assert [s for s, _ in seen["fused"]][:3] == [4, 8, 12]
    np.testing.assert_allclose(
        [v for _, v in seen["fused"]], [v for _, v in seen["stepwise"]], rtol=tol["rtol"]
    )
    assert_close_lists(params_of(fits["fused"][0]), params_of(fits["stepwise"][0]), **tol)
    assert_same_state(state_of(fits["fused"][1]), state_of(fits["stepwise"][1]), **tol)


def diverging(model):
    return torch.optim.SGD, [{"params": model.parameters(), "lr": 1e37, "momentum": 0.9}]


# On the CPU the conformance suite's torch run refuses the same diverging SGD's update at
# the same step (and test_reliability_torch every kind of fault): --runslow; CUDA's in CI.
@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=CUDA)]
)
def test_nonfinite_stops_before_the_bad_update_like_the_stepwise_oracle(device):
    runs = {}
    x, y, tol = X.to(device), Y.to(device), TOL[device]
    for mode in ("fused", "stepwise"):
        model, optimizer, loss_fn = make("perceptron", param_groups=diverging)
        model.to(device)
        fit = sf.fuse(loss_fn, optimizer, steps=10, mode=mode, chunk=2)
        runs[mode] = (model, optimizer, fit(x, y))
        assert_mode(fit, mode)
    (mf, of, tf), (ms, os_, ts) = runs["fused"], runs["stepwise"]
    assert ts.stop == Stop.NONFINITE and 1 < ts.steps < 10
    assert (tf.steps, tf.stop) == (ts.steps, ts.stop)
    assert len(tf.loss) == ts.steps + 1 and not np.isfinite(tf.loss[-1])
    np.testing.assert_allclose(tf.loss[:-1], ts.loss[:-1], rtol=tol["rtol"])
    assert_close_lists(params_of(mf), params_of(ms), **tol)
    assert all(torch.isfinite(p).all() for p in mf.parameters())
    assert_same_state(state_of(of), state_of(os_), **tol)
    # the oracle itself: exactly `steps` plain updates give these parameters
    mr, optr, _ = make("perceptron", param_groups=diverging)
    mr.to(device)
    reference_steps(mr, optr, ts.steps, x, y)
    assert_close_lists(params_of(ms), params_of(mr), **tol)


def test_on_nonfinite_raise_reports_the_step_and_keeps_the_finite_state():
    model, optimizer, loss_fn = make("perceptron", param_groups=diverging)
    fit = sf.fuse(loss_fn, optimizer, steps=10, on_nonfinite="raise", mode="stepwise")
    with pytest.raises(NonFiniteError) as err:
        fit(X, Y)
    assert err.value.step == err.value.trace.steps == fit.step
    assert all(torch.isfinite(p).all() for p in model.parameters())


# Fused, test_bad_input_torch's raising callback covers it (and the state it leaves): the
# fused case runs with --runslow.
@pytest.mark.parametrize("mode", slow_params(["fused", "stepwise"], {"fused"}))
def test_callback_fires_inside_the_call_and_its_exception_reaches_the_caller(mode):
    calls = []

    def boom(step, loss):
        calls.append((step, loss))
        if step == 6:
            raise KeyError("stop here")

    model, optimizer, loss_fn = make("perceptron", "sgd")
    fit = sf.fuse(loss_fn, optimizer, steps=10, callback=boom, every=2, mode=mode, chunk=2)
    with pytest.raises(KeyError, match="stop here"):
        fit(X, Y)
    assert_mode(fit, mode)
    ref_m, ref_o, _ = make("perceptron", "sgd")
    ref_losses = reference_steps(ref_m, ref_o, 6)
    assert [s for s, _ in calls] == [2, 4, 6] and fit.step == 6
    np.testing.assert_allclose([v for _, v in calls], ref_losses[[1, 3, 5]], rtol=1e-6, atol=1e-7)
    assert_close_lists(params_of(model), params_of(ref_m))  # the state of step 6, not beyond


# -- bad input: errors name the argument; nothing changes --------------------------------------


class NotATorchOptimizer:
    def update(self, grads, state):
        return grads, state


@pytest.mark.parametrize(
    "build, exc, name",
    [
        (lambda m, o, f: sf.fuse(f, NotATorchOptimizer(), steps=3), TypeError, "optimizer"),
        (lambda m, o, f: sf.fuse(f, "sgd", steps=3), TypeError, "optimizer"),
        (
            lambda m, o, f: sf.fuse(
                f, torch.optim.SGD([torch.zeros(2, dtype=torch.float32)], lr=0.1), steps=3
            ),
            ValueError,
            "optimizer",
        ),
        (lambda m, o, f: sf.fuse(f, _bad_dtype_optimizer(), steps=3), TypeError, "optimizer"),
        (lambda m, o, f: sf.fuse(f, o, steps=0), ValueError, "steps"),
        (lambda m, o, f: sf.fuse(f, o, steps=3, tol=-1.0), ValueError, "tol"),
        (lambda m, o, f: sf.fuse(f, o, steps=3, every=5), ValueError, "every"),
        (lambda m, o, f: sf.fuse(f, o, steps=3, mode="fast"), ValueError, "mode"),
        (lambda m, o, f: sf.fuse(f, o, steps=3, model="net"), TypeError, "model"),
        (lambda m, o, f: sf.fuse(f, o, steps=3, chunk=0), ValueError, "chunk"),
        (lambda m, o, f: sf.fuse(3, o, steps=3), TypeError, "loss_fn"),
        (
            lambda m, o, f: sf.fuse(
                lambda x, y: torch.nn.functional.cross_entropy(m(x), y, reduction="none"),
                o,
                steps=3,
                mode="stepwise",
            )(X, Y),
            ValueError,
            "loss_fn",
        ),
        (
            lambda m, o, f: sf.fuse(
                lambda x, y: (m(x).argmax(1) == y).sum(), o, steps=3, mode="stepwise"
            )(X, Y),
            TypeError,
            "loss_fn",
        ),
        (
            lambda m, o, f: sf.fuse(lambda x, y: (x**2).mean(), o, steps=3, mode="stepwise")(X, Y),
            ValueError,
            "loss_fn",
        ),
        (
            lambda m, o, f: sf.fuse(f, o, steps=3, mode="stepwise")(X, Y, steps=2.5),
            TypeError,
            "steps",
        ),
    ],
)
def test_bad_input_names_the_argument_and_changes_nothing(build, exc, name):
    model, optimizer, loss_fn = make("perceptron", "adam")
    reference_steps(model, optimizer, 1)  # some optimizer state to protect
    params, state = params_of(model), state_of(optimizer)
    with pytest.raises(exc) as err:
        build(model, optimizer, loss_fn)
    assert f"`{name}`" in str(err.value)
    assert "got" in str(err.value)
    assert_close_lists(params_of(model), params, rtol=0, atol=0)
    assert_same_state(state_of(optimizer), state, rtol=0, atol=0)


def _bad_dtype_optimizer():
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    opt.param_groups[0]["params"][0] = torch.zeros(2, dtype=torch.int64)
    return opt


# -- fallbacks -------------------------------------------------------------------------------


class _OwnSGD(torch.optim.SGD):
    """An optimizer class that is not torch.optim's own (no fused rule is known for it)."""


def test_unsupported_optimizer_falls_back_to_stepwise_with_a_warning():
    model = mlp()
    optimizer = _OwnSGD(model.parameters(), lr=0.01)
    with pytest.warns(RuntimeWarning, match="_OwnSGD"):
        fit = sf.fuse(
            lambda x, y: torch.nn.functional.cross_entropy(model(x), y), optimizer, steps=3
        )
    assert fit.mode == "stepwise" and "_OwnSGD" in fit.fallback_reason
    losses = fit(X, Y).loss
    ref = mlp()
    np.testing.assert_allclose(
        losses, reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.01), 3), rtol=1e-6
    )


def test_lbfgs_step_gets_a_closure_and_equals_torchs_own_closure_loop():
    """LBFGS re-evaluates the loss inside ``step(closure)``: it runs stepwise (with the
    fallback warning), and c calls equal torch's own loop of ``opt.step(closure)``."""

    def build():
        model = mlp()
        return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=4)

    model, optimizer = build()
    with pytest.warns(RuntimeWarning, match="LBFGS"):
        fit = sf.fuse(
            lambda x, y: torch.nn.functional.cross_entropy(model(x), y), optimizer, steps=4
        )
    losses, traces = run_calls(fit)
    assert [t.steps for t in traces] == list(CALLS) and fit.step == sum(CALLS)

    ref_model, ref_opt = build()

    def closure():
        ref_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref_model(X), Y)
        loss.backward()
        return loss

    ref_losses = [ref_opt.step(closure).item() for _ in range(sum(CALLS))]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-7)
    assert_close_lists(params_of(model), params_of(ref_model))
    mine = optimizer.state[next(model.parameters())]  # LBFGS keeps its state on the first param
    ref = ref_opt.state[next(ref_model.parameters())]
    assert mine["n_iter"] == ref["n_iter"] > sum(CALLS)  # several inner iterations a step
    assert_close_lists(
        [mine["d"], mine["prev_flat_grad"], *mine["old_dirs"]],
        [ref["d"], ref["prev_flat_grad"], *ref["old_dirs"]],
    )


def test_an_error_inside_step_leaves_parameters_and_state_as_before_the_step():
    model = mlp()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    calls = {"n": 0}

    def flaky_loss(x, y):
        calls["n"] += 1
        if calls["n"] == 10:  # inside the second call's step, after some inner iterations
            raise RuntimeError("data loader hiccup")
        return torch.nn.functional.cross_entropy(model(x), y)

    with pytest.warns(RuntimeWarning, match="LBFGS"):
        fit = sf.fuse(flaky_loss, optimizer, steps=1)
    fit(X, Y)
    params, state = params_of(model), state_of(optimizer)
    with pytest.raises(RuntimeError, match="hiccup"):
        fit(X, Y)
    assert fit.step == 1
    assert_close_lists(params_of(model), params, rtol=0, atol=0)
    first = lambda st: {k: v for k, v in st[0].items() if isinstance(v, (torch.Tensor, int))}  # noqa: E731
    assert_same_state([first(state_of(optimizer))], [first(state)], rtol=0, atol=0)


def test_probe_changes_neither_batchnorm_statistics_nor_the_random_state():
    """The batch check runs loss_fn once before the first call's steps; it must leave no
    trace: the buffers and the dropout masks equal those of the plain loop."""

    def build():
        torch.manual_seed(3)
        model = torch.nn.Sequential(
            torch.nn.Linear(2, 8),
            torch.nn.BatchNorm1d(8),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(8, 2),
        )
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, optimizer = build()
    fit = sf.fuse(
        lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
        optimizer,
        steps=3,
        mode="stepwise",
    )
    torch.manual_seed(7)
    losses = fit(X, Y).loss
    ref_model, ref_opt = build()
    torch.manual_seed(7)
    np.testing.assert_allclose(losses, reference_steps(ref_model, ref_opt, 3), rtol=1e-6)
    bn, ref_bn = model[1], ref_model[1]
    assert int(bn.num_batches_tracked) == int(ref_bn.num_batches_tracked) == 3
    assert_close_lists([bn.running_mean, bn.running_var], [ref_bn.running_mean, ref_bn.running_var])


def test_refused_step_leaves_batchnorm_statistics_as_before_it():
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    fit = sf.fuse(
        lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
        torch.optim.Adam(model.parameters(), lr=0.01),
        steps=3,
        mode="stepwise",
    )
    assert fit(X, Y).steps == 3
    before = [t.detach().clone() for t in model.state_dict().values()]
    bad = X.clone()
    bad[0, 0] = math.nan
    trace = fit(bad, Y)
    assert trace.stop == Stop.NONFINITE and trace.steps == 0
    assert_close_lists(list(model.state_dict().values()), before, rtol=0, atol=0)


def test_parameters_changed_after_fuse_are_refused_and_nothing_moves():
    body, head = torch.nn.Linear(2, 4), torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    fit = sf.fuse(
        lambda x, y: torch.nn.functional.cross_entropy(head(body(x)), y),
        optimizer,
        steps=2,
        mode="stepwise",
    )
    fit(X, Y)
    # progressive unfreezing: the fit was built for the head only
    optimizer.add_param_group({"params": list(body.parameters())})
    before, state = params_of(body) + params_of(head), state_of(optimizer)
    with pytest.raises(ValueError, match="(?i)`optimizer`.*build a new fit"):
        fit(X, Y)
    assert_close_lists(params_of(body) + params_of(head), before, rtol=0, atol=0)
    assert_same_state(state_of(optimizer), state, rtol=0, atol=0)
    assert fit.step == 2


def test_a_parameter_frozen_after_fuse_is_skipped_as_torch_skips_it():
    """Freezing a parameter between calls (it was refused): torch.optim skips it from then
    on (no gradient: no update, its state kept as it was), and so does the fit."""

    def build():
        torch.manual_seed(6)
        model = torch.nn.Linear(2, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, optimizer = build()
    loss_fn = lambda x, y: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
    fit = sf.fuse(loss_fn, optimizer, steps=2, mode="stepwise")
    fit(X, Y)
    model.bias.requires_grad_(False)
    bias, buf = model.bias.detach().clone(), optimizer.state[model.bias]["momentum_buffer"].clone()
    assert fit(X, Y).steps == 2
    ref, ref_opt = build()
    reference_steps(ref, ref_opt, 2)
    ref.bias.requires_grad_(False)
    reference_steps(ref, ref_opt, 2)
    assert torch.equal(model.bias, bias)
    assert torch.equal(optimizer.state[model.bias]["momentum_buffer"], buf)
    assert_close_lists(params_of(model), params_of(ref))


def test_parameters_outside_the_optimizer_stay_fixed_and_the_fit_stays_fused():
    """The optimizer holds the head only; the body's parameters still require grad."""

    def build():
        torch.manual_seed(5)
        body, head = torch.nn.Linear(2, 4), torch.nn.Linear(4, 2)
        return body, head, torch.optim.Adam(head.parameters(), lr=0.05)

    body, head, optimizer = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no silent fallback
        fit = sf.fuse(
            lambda x, y: torch.nn.functional.cross_entropy(head(body(x)), y),
            optimizer,
            steps=4,
            chunk=1,  # (the chunk does not matter here: about half the default's compile)
        )
        losses, _ = run_calls(fit)
    assert_fused(fit)
    ref_body, ref_head, ref_opt = build()
    ref = torch.nn.Sequential(ref_body, ref_head)
    np.testing.assert_allclose(
        losses, reference_steps(ref, ref_opt, sum(CALLS)), rtol=1e-6, atol=1e-7
    )
    assert_close_lists(params_of(head), params_of(ref_head))
    assert_close_lists(params_of(body), params_of(ref_body), rtol=0, atol=0)


def test_loss_without_a_module_falls_back_and_names_model():
    w = torch.ones(2, 2, requires_grad=True)
    optimizer = torch.optim.SGD([w], lr=0.01)
    with pytest.warns(RuntimeWarning, match="model="):
        fit = sf.fuse(lambda x, y: torch.nn.functional.cross_entropy(x @ w, y), optimizer, steps=2)
    assert fit(X, Y).steps == 2


# -- CUDA graph path -------------------------------------------------------------------------


class _Replay:
    """Stands in for a captured CUDA graph on the CPU: replaying runs the chunk ``k`` times
    on the same static buffers, which is what replaying its captured kernels does."""

    def __init__(self, chunk, k):
        self.chunk, self.k = chunk, k
        self.replays = 0

    def replay(self):
        self.replays += 1
        for _ in range(self.k):
            self.chunk()


# The compiled kernels add a compile (about 30 s here) to the eager replay's: --runslow.
@pytest.mark.parametrize("kernels", [pytest.param("compiled", marks=pytest.mark.slow), "eager"])
def test_graph_path_static_buffers_and_replays_match_reference_on_cpu(monkeypatch, kernels):
    """The CUDA path's host logic (static buffers, one-chunk and many-chunk graphs, the
    write-back of state kept on the CPU) against torch's own Adam, with the capture
    replaced by re-running the chunk: a fault in that logic shows up without a GPU."""
    graphs = []

    def fake_graphs(chunk, dev, sizes):
        for _ in range(3):  # the warm-up, as on CUDA
            chunk()
        graphs[:] = [_Replay(chunk, k) for k in sizes]
        return list(graphs)

    monkeypatch.setattr(torch_cuda, "cuda_graphs", fake_graphs)
    monkeypatch.setattr(torch_cuda, "GRAPH_CHUNKS", 2)
    monkeypatch.setattr(sf.FusedFit, "_cuda", property(lambda self: True))
    if kernels == "eager":

        def no_compile(self, fn, kind, inductor_options):
            raise RuntimeError("inductor cannot take it")

        monkeypatch.setattr(sf.FusedFit, "_compile", no_compile)
        # the eager capturable Adam refuses CPU tensors: SGD with momentum stands in
        opt = "sgd_momentum"
    else:
        opt = "adam"
    model, optimizer, loss_fn = make("perceptron", opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no silent fallback
        fit = sf.fuse(loss_fn, optimizer, steps=9, chunk=2)
        calls = (3, 1, 9, 2)  # 9 steps: chunks 5 = 2 long replays of 2 chunks + 1 short
        traces = [fit(X, Y, steps=n) for n in calls]
    assert_fused(fit)
    assert fit.compiles == 1
    assert fit._program.fused_kernels == (kernels == "compiled")
    assert [t.steps for t in traces] == list(calls)
    assert [g.replays for g in graphs] == [1 + 1 + 1 + 1, 2]  # (3-1 eager first step)/2, 1, 9, 2
    losses = np.concatenate([t.loss for t in traces])
    ref_model, ref_opt, _ = make("perceptron", opt)
    np.testing.assert_allclose(
        losses, reference_steps(ref_model, ref_opt, sum(calls)), rtol=1e-6, atol=1e-7
    )
    assert_close_lists(params_of(model), params_of(ref_model))
    assert_same_state(state_of(optimizer), state_of(ref_opt))
    # a batch of another shape: new static buffers, a new program; back to the first
    # shape, the first program again (kept, not recaptured)
    half = (X[:25], Y[:25])
    np.testing.assert_allclose(
        fit(*half, steps=3).loss,
        reference_steps(ref_model, ref_opt, 3, *half),
        rtol=1e-6,
        atol=1e-7,
    )
    assert fit.compiles == 2
    np.testing.assert_allclose(
        fit(X, Y, steps=2).loss, reference_steps(ref_model, ref_opt, 2), rtol=1e-6, atol=1e-7
    )
    assert fit.compiles == 2
    assert_close_lists(params_of(model), params_of(ref_model))
    assert_same_state(state_of(optimizer), state_of(ref_opt))


@CUDA
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_cuda_graph_matches_torch_reference(opt):
    model, optimizer, loss_fn = make("mlp", opt)
    model.cuda()
    optimizer = OPTIMIZERS[opt](model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no silent fallback
        fit = sf.fuse(loss_fn, optimizer, steps=9, chunk=2)
        calls = (3, 1, 9, 2)  # 9 steps: more chunks than one long replay holds
        traces = [fit(X.cuda(), Y.cuda(), steps=n) for n in calls]
    assert_fused(fit)
    assert fit._program.fused_kernels, fit._program.compile_error
    assert [t.steps for t in traces] == list(calls)
    losses = np.concatenate([t.loss for t in traces])
    ref = mlp().cuda()
    ref_opt = OPTIMIZERS[opt](ref.parameters())
    ref_losses = reference_steps(ref, ref_opt, sum(calls), X.cuda(), Y.cuda())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert_same_state(state_of(optimizer), state_of(ref_opt), rtol=1e-5, atol=1e-6)
    assert fit.compiles == 1


# -- what the fused program cannot do: stepwise, as torch's own loop ------------------------


def _plain(model, optimizer, loss_fn, n, x=X, y=Y):
    losses = []
    for _ in range(n):
        optimizer.zero_grad()
        loss = loss_fn(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return np.asarray(losses)


def _hooked(kind):
    """(model, optimizer, loss_fn, hook calls) with one kind of user hook registered."""
    model, optimizer, loss_fn = make("perceptron", "sgd_momentum")
    calls = []
    if kind == "step_post":  # clamps the parameters after each step

        def clamp(opt, args, kwargs):
            calls.append(1)
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.3, 0.3)

        optimizer.register_step_post_hook(clamp)
    elif kind == "grad":  # halves one parameter's gradient
        model.weight.register_hook(lambda g: calls.append(1) or g * 0.5)
    else:  # a module backward hook that only observes
        model.register_full_backward_hook(lambda m, gi, go: calls.append(1))
    return model, optimizer, loss_fn, calls


@pytest.mark.parametrize("kind", ["step_post", "grad", "module_backward"])
def test_user_hooks_run_stepwise_with_a_warning_as_in_torchs_loop(kind):
    """The fused program takes gradients with torch.func and calls the update rule itself,
    so hooks would be skipped silently (they were): such a fit runs stepwise, and equals
    torch's own loop with the same hook."""
    model, optimizer, loss_fn, calls = _hooked(kind)
    fit = sf.fuse(loss_fn, optimizer, steps=3)
    with pytest.warns(RuntimeWarning, match="hooks"):
        losses, traces = run_calls(fit)
    assert fit.mode == "stepwise" and "hooks" in fit.fallback_reason and len(calls) >= sum(CALLS)
    ref_model, ref_opt, ref_loss, _ = _hooked(kind)
    np.testing.assert_allclose(losses, _plain(ref_model, ref_opt, ref_loss, sum(CALLS)), rtol=1e-6)
    assert_close_lists(params_of(model), params_of(ref_model))
    assert_same_state(state_of(optimizer), state_of(ref_opt))


def test_parameters_the_loss_does_not_use_are_skipped_as_torch_does():
    """A parameter without a gradient is skipped by torch.optim (no weight decay, no
    momentum, no state, no step): the fused program leaves it out (it ran stepwise
    before), and a batch that uses it gets a program of its own, whose first step creates
    its state as torch's does."""

    def build():
        torch.manual_seed(0)
        used, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(
            [*used.parameters(), *other.parameters()], lr=0.1, momentum=0.9, weight_decay=0.1
        )

        def loss_fn(x, y, both):
            logits = used(x) + other(x) if both else used(x)
            return torch.nn.functional.cross_entropy(logits, y)

        return used, other, opt, loss_fn

    used, other, opt, loss_fn = build()
    before = params_of(other)
    fit = sf.fuse(loss_fn, opt, steps=3, model=torch.nn.ModuleList([used, other]), chunk=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        first = np.concatenate([fit(X, Y, False).loss for _ in range(2)])
        assert_fused(fit)
        assert fit.compiles == 1
        assert_close_lists(params_of(other), before, rtol=0, atol=0)
        assert all(p not in opt.state for p in other.parameters())
        second = fit(X, Y, True).loss  # now it has a gradient: updated from here on
    assert_fused(fit)
    assert fit.compiles == 2
    r_used, r_other, r_opt, r_loss = build()
    ref_first = _plain(r_used, r_opt, lambda x, y: r_loss(x, y, False), 6)
    ref_second = _plain(r_used, r_opt, lambda x, y: r_loss(x, y, True), 3)
    np.testing.assert_allclose(first, ref_first, rtol=1e-6)
    np.testing.assert_allclose(second, ref_second, rtol=1e-6)
    assert_close_lists(params_of(used) + params_of(other), params_of(r_used) + params_of(r_other))
    assert not np.allclose(params_of(other)[0].numpy(), before[0].numpy())
    assert_same_state(state_of(opt), state_of(r_opt))
    assert all("momentum_buffer" in opt.state[p] for p in other.parameters())


def test_sparse_gradients_of_an_embedding_with_sparse_adam():
    """SparseAdam (stepwise) with nn.Embedding(sparse=True): the finiteness check read
    sparse gradients densely and failed."""

    def build():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        return emb, torch.optim.SparseAdam(emb.parameters(), lr=0.1)

    idx, target = torch.tensor([1, 4, 4, 7]), torch.ones(4, 3)
    emb, opt = build()
    with pytest.warns(RuntimeWarning, match="SparseAdam"):
        fit = sf.fuse(lambda i, t: ((emb(i) - t) ** 2).mean(), opt, steps=3)
    losses, _ = run_calls(fit, x=idx, y=target)
    r_emb, r_opt = build()
    ref = _plain(r_emb, r_opt, lambda i, t: ((r_emb(i) - t) ** 2).mean(), sum(CALLS), idx, target)
    np.testing.assert_allclose(losses, ref, rtol=1e-6)
    assert_close_lists(params_of(emb), params_of(r_emb))


def test_bfloat16_model_runs_fused_and_equals_stepwise():
    """The bfloat16 loss buffer could not become NumPy: every fused call failed."""
    out = {}
    for mode in ("fused", "stepwise"):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2).to(torch.bfloat16)
        fit = sf.fuse(
            lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
            torch.optim.SGD(model.parameters(), lr=0.1),
            steps=3,
            chunk=1,
            mode=mode,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            losses, traces = run_calls(fit, x=X.to(torch.bfloat16))
        assert_mode(fit, mode)
        assert losses.dtype == np.float32
        out[mode] = (losses, [p.float() for p in params_of(model)])
    # inductor computes bfloat16 ops in float32 and rounds once; eager rounds every op
    np.testing.assert_allclose(out["fused"][0], out["stepwise"][0], rtol=2e-2)
    assert_close_lists(out["fused"][1], out["stepwise"][1], rtol=2e-2, atol=1e-2)


def test_an_lr_scheduler_stepped_after_a_fused_call_sees_the_optimizer_stepped():
    """torch's schedulers watch optimizer.step(), which a fused call does not run: the call
    says it ran, so the scheduler neither warns "lr_scheduler.step() before
    optimizer.step()" nor skips the schedule's first value. (A new lr reaching the next
    call: the next test, a callback's change.)"""
    for mode in ("fused", "stepwise"):
        model, optimizer, loss_fn = make("perceptron", "sgd")
        base = optimizer.param_groups[0]["lr"]
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        fit = sf.fuse(loss_fn, optimizer, steps=3, mode=mode)
        fit(X, Y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scheduler.step()
        assert_mode(fit, mode)
        assert optimizer.param_groups[0]["lr"] == base * 0.5, mode


@pytest.mark.parametrize("key, value", [("lr", 0.0), ("momentum", 0.2)])
def test_a_callback_that_changes_a_hyper_parameter_takes_effect_for_the_rest_of_the_call(
    key, value
):
    """A hyper-parameter the callback changes mid-call holds for the remaining steps (the
    old lr was once used silently), as in the stepwise loop. ``lr`` is an input of the
    fused program: the same program runs on, no warning; ``momentum`` is compiled in: the
    program is compiled again, with a warning naming the change."""
    out = {}
    for mode in ("fused", "stepwise"):
        model, optimizer, loss_fn = make("perceptron", "sgd_momentum")
        before = optimizer.param_groups[0][key]

        def change(step, loss, optimizer=optimizer):
            if step == 2:
                optimizer.param_groups[0][key] = value

        fit = sf.fuse(loss_fn, optimizer, steps=6, callback=change, every=2, chunk=2, mode=mode)
        if mode == "fused" and key != "lr":
            with pytest.warns(RuntimeWarning, match="compiled again") as got:
                trace = fit(X, Y)
            assert f"group 0 {key}: {before!r} -> {value!r}" in str(got[0].message)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                trace = fit(X, Y)
        assert_mode(fit, mode)
        if mode == "fused":
            assert fit.compiles == (1 if key == "lr" else 2)
        out[mode] = (trace.loss, params_of(model), state_of(optimizer))
    np.testing.assert_allclose(out["fused"][0], out["stepwise"][0], rtol=1e-6)
    losses = out["fused"][0]
    if key == "lr":
        assert losses[1] != losses[2] and np.all(losses[2:] == losses[2])  # lr 0 from update 2
    assert_close_lists(out["fused"][1], out["stepwise"][1])
    assert_same_state(out["fused"][2], out["stepwise"][2])


def test_lr_schedulers_stepped_between_calls_run_one_program_as_the_plain_loop_runs():
    """An lr scheduler stepped after each call (two param groups, each its own schedule)
    changes the next call's lr without a compile (each new lr compiled again before: ~45 s a
    call on the 2-core VM); the fit equals the plain loop stepping the same schedulers
    after as many single steps, and the last lr, set by hand, too."""
    model, optimizer, loss_fn = make("perceptron", param_groups=_two_adam_groups)
    ref_m, ref_o, _ = make("perceptron", param_groups=_two_adam_groups)
    fit = sf.fuse(loss_fn, optimizer, steps=3, chunk=2)
    schedulers = [_schedulers(o) for o in (optimizer, ref_o)]
    losses, ref = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for call in range(5):
            if call == 4:
                for o in (optimizer, ref_o):
                    o.param_groups[1]["lr"] = 0.25  # by hand, the fit's float64 input too
            losses.append(fit(X, Y).loss)
            ref.append(reference_steps(ref_m, ref_o, 3))
            for s in schedulers:
                s.step()
    assert_fused(fit)
    assert fit.compiles == 1
    assert optimizer.param_groups[0]["lr"] == ref_o.param_groups[0]["lr"] != 0.01
    np.testing.assert_allclose(np.concatenate(losses), np.concatenate(ref), rtol=1e-6)
    assert_close_lists(params_of(model), params_of(ref_m))
    assert_same_state(state_of(optimizer), state_of(ref_o))


def _warmup_then_cosine(optimizer):
    """A per-batch schedule: 3 warm-up steps (LambdaLR), then cosine annealing."""
    lr = torch.optim.lr_scheduler
    warmup = lr.LambdaLR(optimizer, lambda e: (e + 1) / 4)
    return lr.SequentialLR(
        optimizer, [warmup, lr.CosineAnnealingLR(optimizer, T_max=6)], milestones=[3]
    )


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_an_lr_scheduler_given_to_fuse_steps_after_every_update_as_the_plain_loop(mode):
    """``fuse(lr_scheduler=)`` steps the scheduler after each update, inside the call: the
    fused program reads each step's lr from a table (one compile for every call), and
    calls of 3, 4 and 2 steps (chunk 2: masked steps) equal the plain loop stepping it
    after each ``optimizer.step()``, losses, parameters, state, the groups' lr and the
    scheduler's own count."""
    model, optimizer, loss_fn = make("perceptron", param_groups=_two_adam_groups)
    ref_m, ref_o, _ = make("perceptron", param_groups=_two_adam_groups)
    sched, ref_s = _warmup_then_cosine(optimizer), _warmup_then_cosine(ref_o)
    fit = sf.fuse(loss_fn, optimizer, steps=4, chunk=2, mode=mode, lr_scheduler=sched)
    losses, ref = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (3, 4, 2):
            losses.append(fit(X, Y, steps=n).loss)
            ref += list(reference_steps(ref_m, ref_o, n, scheduler=ref_s))
    assert_mode(fit, mode)
    if mode == "fused":
        assert fit.compiles == 1
    assert sched.last_epoch == ref_s.last_epoch == 9
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in ref_o.param_groups]
    np.testing.assert_allclose(np.concatenate(losses), ref, rtol=1e-6)
    assert_close_lists(params_of(model), params_of(ref_m))
    assert_same_state(state_of(optimizer), state_of(ref_o))


def test_an_lr_scheduler_is_stepped_once_per_update_a_call_applied():
    """A call that ``tol`` stops early steps the scheduler once per update it applied,
    as the plain loop that stopped there: the next call starts at that step's lr."""
    model, optimizer, loss_fn = make("perceptron", "sgd_momentum")
    ref_m, ref_o, _ = make("perceptron", "sgd_momentum")
    sched = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    ref_s = torch.optim.lr_scheduler.ExponentialLR(ref_o, gamma=0.5)
    fit = sf.fuse(loss_fn, optimizer, steps=40, tol=1e-3, chunk=1, lr_scheduler=sched)
    trace = fit(X, Y)
    assert_fused(fit)
    assert trace.stop == Stop.TOL and 1 < trace.steps < 40, (trace.stop, trace.steps)
    ref = list(reference_steps(ref_m, ref_o, trace.steps, scheduler=ref_s))
    assert sched.last_epoch == ref_s.last_epoch == trace.steps
    assert optimizer.param_groups[0]["lr"] == ref_o.param_groups[0]["lr"]
    np.testing.assert_allclose(trace.loss[: trace.steps], ref, rtol=1e-6)
    assert_close_lists(params_of(model), params_of(ref_m))


def test_an_lr_scheduler_that_cycles_momentum_runs_stepwise_saying_why():
    """OneCycleLR's default ``cycle_momentum`` changes momentum at every step, which the
    program compiles in: the fit runs stepwise (before any compile), naming the key and
    the fix, and equals the plain loop."""
    model, optimizer, loss_fn = make("perceptron", "sgd_momentum")
    ref_m, ref_o, _ = make("perceptron", "sgd_momentum")
    cycle = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=10)  # noqa: E731
    sched, ref_s = cycle(optimizer), cycle(ref_o)
    fit = sf.fuse(loss_fn, optimizer, steps=5, lr_scheduler=sched)
    with pytest.warns(RuntimeWarning, match="(?s)changes momentum.*cycle_momentum=False"):
        losses = fit(X, Y).loss
    assert fit.mode == "stepwise" and fit.compiles == 0
    ref = list(reference_steps(ref_m, ref_o, 5, scheduler=ref_s))
    np.testing.assert_allclose(losses, ref, rtol=1e-6)
    assert optimizer.param_groups[0]["momentum"] == ref_o.param_groups[0]["momentum"]
    assert_close_lists(params_of(model), params_of(ref_m))


def test_bad_lr_schedulers_are_refused_naming_the_argument():
    model, optimizer, loss_fn = make("perceptron", "sgd")
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    lr = torch.optim.lr_scheduler
    cases = [
        (lr.ReduceLROnPlateau(optimizer), TypeError, "(?s)lr_scheduler.*steps on a metric"),
        (lr.StepLR(other, 2), ValueError, "(?s)lr_scheduler.*over another optimizer"),
        (lambda step: 0.1, TypeError, "(?s)lr_scheduler.*LRScheduler"),
    ]
    for scheduler, error, match in cases:
        with pytest.raises(error, match=match):
            sf.fuse(loss_fn, optimizer, steps=3, lr_scheduler=scheduler)


def _two_adam_groups(model):
    """The perceptron's weight and bias in two Adam groups of their own lr (one compile of
    the perceptron is about half the MLP's)."""
    return torch.optim.Adam, [
        {"params": [model.weight], "lr": 0.01},
        {"params": [model.bias], "lr": 0.05, "weight_decay": 0.1},
    ]


def _schedulers(optimizer):
    """Cosine annealing on group 0, a warm-up factor on group 1 (a LambdaLR per group)."""
    lr = torch.optim.lr_scheduler
    return lr.SequentialLR(
        optimizer,
        [
            lr.LambdaLR(optimizer, [lambda e: 1.0, lambda e: min(1.0, (e + 1) / 3)]),
            lr.CosineAnnealingLR(optimizer, T_max=4),
        ],
        milestones=[2],
    )


def test_graph_path_copies_nested_batch_tensors_into_its_buffers(monkeypatch):
    """A dict of tensors as a batch argument, on the CUDA path's host logic (stand-in as
    above, eager chunk): each call trains on its own batch. The nested tensors were not
    copied into the static buffers, and batches were told apart by their repr (which
    elides a large tensor's values), so a later call trained on the first call's data."""
    monkeypatch.setattr(
        torch_cuda, "cuda_graphs", lambda chunk, dev, sizes: [_Replay(chunk, k) for k in sizes]
    )
    monkeypatch.setattr(sf.FusedFit, "_cuda", property(lambda self: True))

    def no_compile(self, fn, kind, inductor_options):
        raise RuntimeError("inductor cannot take it")

    monkeypatch.setattr(sf.FusedFit, "_compile", no_compile)
    big_x = torch.cat([X] * 40)  # 2,000 rows: its repr shows the first and last 3 only
    other = big_x.clone()
    other[3:-3] *= -1
    assert repr({"x": other}) == repr({"x": big_x})
    batches = [({"x": big_x}, torch.cat([Y] * 40)), ({"x": other}, torch.cat([Y] * 40))]
    model, optimizer, _ = make("perceptron", "sgd_momentum")
    fit = sf.fuse(
        lambda b, y: torch.nn.functional.cross_entropy(model(b["x"]), y),
        optimizer,
        steps=4,
        chunk=2,
    )
    losses = np.concatenate([fit(*b).loss for b in batches])
    ref_model, ref_opt, _ = make("perceptron", "sgd_momentum")
    ref = np.concatenate([reference_steps(ref_model, ref_opt, 4, b["x"], y) for b, y in batches])
    assert_fused(fit)
    np.testing.assert_allclose(losses, ref, rtol=1e-6, atol=1e-7)
    assert_close_lists(params_of(model), params_of(ref_model))


def test_batches_of_many_shapes_each_get_a_program_past_dynamos_recompile_limit(monkeypatch):
    """Every batch signature compiles a program of its own (the last few kept): one
    program recompiled by dynamo for each new shape failed hard at its recompile limit
    (lowered to 1 here; 8 by default)."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(dynamo_config, "recompile_limit", 1)
    model, optimizer, loss_fn = make("perceptron", "sgd")
    ref_model, ref_opt, _ = make("perceptron", "sgd")
    fit = sf.fuse(loss_fn, optimizer, steps=3, chunk=1)
    for rows in (50, 40, 30):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback
            losses = fit(X[:rows], Y[:rows]).loss
        np.testing.assert_allclose(
            losses, reference_steps(ref_model, ref_opt, 3, X[:rows], Y[:rows]), rtol=1e-6, atol=1e-7
        )
    assert_fused(fit)
    assert fit.compiles == 3
    assert_close_lists(params_of(model), params_of(ref_model))


@pytest.mark.parametrize("scheduled", [False, True])
def test_fused_dropout_draws_the_masks_of_the_plain_loop_over_calls(scheduled):
    """A call of 6 steps used to run its last chunk's masked steps' forward passes too,
    drawing masks the plain loop never draws: the next calls trained on other masks.
    (Each update moves the weights by the mask, so the weights count the masks drawn.)
    With an ``lr_scheduler``: the first call's check that the program draws as the plain
    loop does (a step run and undone) steps no scheduler (it crashed before)."""
    x = torch.ones(1, 16)

    def run(fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.25)
        lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1 / (1 + e)) if scheduled else None

        def loss_fn(x):
            return (torch.nn.functional.dropout(x, 0.5, training=True) @ model.weight.T).sum()

        torch.manual_seed(42)
        fit = sf.fuse(loss_fn, opt, steps=6, model=model, lr_scheduler=lr) if fused else None
        for _ in range(3):
            if fused:
                fit(x)
            else:
                for _ in range(6):
                    opt.zero_grad()
                    loss_fn(x).backward()
                    opt.step()
                    if lr is not None:
                        lr.step()
        return fit, model.weight.detach().clone(), torch.get_rng_state(), lr

    fit, weight, rng, lr = run(True)
    _, ref_weight, ref_rng, ref_lr = run(False)
    assert_fused(fit)
    assert fit.chunk == 1
    torch.testing.assert_close(weight, ref_weight, rtol=1e-6 if scheduled else 0, atol=0)
    assert torch.equal(rng, ref_rng)
    if scheduled:
        assert lr.last_epoch == ref_lr.last_epoch == 18


def test_a_build_that_fails_outside_the_model_is_tried_again_and_a_fallback_shows_the_cause(
    monkeypatch,
):
    """A compile that fails for a reason outside the model (here an OS error, as inductor's
    cache lock timing out under concurrent processes raises) is tried once more, not turned
    into a stepwise fit; a failure that stays is a fallback whose reason holds the whole
    error chain, not its first line."""
    from stepfuse.torch import _program

    real, calls = _program.build_program, []

    def flaky(spec, compile):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("backend failed:\n\nwrapped") from TimeoutError("cache lock")
        return real(spec, compile)

    monkeypatch.setattr(_program, "build_program", flaky)
    model, optimizer, loss_fn = make("perceptron", "sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        fit = sf.fuse(loss_fn, optimizer, steps=2, chunk=1)
        fit(X, Y)
    assert_fused(fit)
    assert len(calls) == 2

    def broken(spec, compile):
        raise RuntimeError("backend failed:\n\nsee below") from ValueError("the real cause")

    monkeypatch.setattr(_program, "build_program", broken)
    model, optimizer, loss_fn = make("perceptron", "sgd")
    fit = sf.fuse(loss_fn, optimizer, steps=2, chunk=1)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        fit(X, Y)
    assert_mode(fit, "stepwise")
    assert "see below" in fit.fallback_reason and "the real cause" in fit.fallback_reason


def test_the_model_is_found_through_default_arguments_and_partials():
    """A module reached by a default argument or a ``functools.partial`` is the model (not
    a fallback for parameters "that belong to no module")."""
    import functools

    from stepfuse.torch._probe import find_modules

    model, other = torch.nn.Linear(2, 1), torch.nn.Linear(1, 1)

    def loss(x, y, m):
        return ((m(x) - y) ** 2).mean()

    assert find_modules(lambda x, y, m=model: loss(x, y, m)) == [model]
    assert find_modules(lambda x, y, *, m=model: loss(x, y, m)) == [model]
    assert find_modules(functools.partial(loss, m=model)) == [model]
    assert find_modules(functools.partial(loss, m=other)) == [other]
    assert find_modules(lambda x, y: x.sum()) == []


def test_a_steps_scalars_get_a_buffer_of_their_own_and_the_same_values():
    """`_scalars.RealizeScalars`: a one-element expression (a bias correction of the step
    count) read by a large tensor is read through an identity ``as_strided`` (inductor then
    computes it once, not per element); small readers and the values are unchanged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from stepfuse.torch._scalars import LARGE, RealizeScalars

    def update(step, big, small):
        c = 1 - 0.999 ** (step.double() + 1)
        return big * c.sqrt().float(), small * c.float()

    args = (torch.tensor(3.0), torch.randn(LARGE), torch.randn(LARGE - 1))
    gm = make_fx(update)(*args)
    want = gm(*args)
    RealizeScalars()(gm.graph)
    gm.recompile()
    held = [n for n in gm.graph.nodes if n.target is torch.ops.aten.as_strided.default]
    assert len(held) == 1, gm.graph  # the sqrt's result, read by `big` alone
    (reader,) = held[0].users
    assert reader.meta["val"].numel() == LARGE
    for a, b in zip(gm(*args), want):
        assert torch.equal(a, b)
    assert RealizeScalars().uuid() == RealizeScalars().uuid()  # inductor's cache key


@pytest.mark.slow  # two compiles
def test_scalars_benchmark_script_runs_and_the_pass_changes_no_value(benchmark_script, monkeypatch):
    import sys

    script = benchmark_script("torch_scalars")
    monkeypatch.setitem(sys.modules, "torch_scalars", script)  # dynamo imports the loss's module
    rows = script.main(["--problems", "small", "--steps", "16", "--rounds", "1"])
    assert [r["program"] for r in rows] == ["with the pass", "without"]
    assert all(r["mode"] == "fused" and r["bitwise_equal"] for r in rows), rows


def test_a_float16_adam_step_rounds_where_eager_torch_rounds():
    """A float16 model with Adam: the program computed the update in float32 and rounded
    once, keeping a second moment that eager torch's float16 flushes to 0; a weight was
    0.2698 against eager's 0.2369 after one step, without a word."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8).half(), torch.randn(8, 4).half()

    def build():
        torch.manual_seed(1)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        ).half()
        return model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)

    model, opt = build()
    fit = sf.fuse(lambda a, b: torch.nn.functional.mse_loss(model(a), b), opt, steps=3)
    losses = np.concatenate([fit(x, y).loss for _ in range(2)])
    assert_mode(fit, "fused")
    plain, popt = build()
    ref = _plain(plain, popt, lambda a, b: torch.nn.functional.mse_loss(plain(a), b), 6, x, y)
    np.testing.assert_allclose(losses, ref, rtol=2e-3)  # (a float16 ulp: ~1e-3)
    # (the CUDA chunk is compiled with the same rounding; it runs only on a GPU)
    from stepfuse.torch._program import CHUNK_OPTIONS

    assert CHUNK_OPTIONS.get("emulate_precision_casts") is True
    assert_close_lists(
        [p.float() for p in params_of(model)],
        [p.float() for p in params_of(plain)],
        rtol=1e-2,
        atol=1e-3,
    )
