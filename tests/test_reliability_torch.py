"""PyTorch reliability: numerical faults, checkpoints across processes, determinism, progress.

Compiles are the slow part, so every fused fit here is the seed perceptron with Adam
(lr 0.01) and ``chunk=2``: the same graph as tests/test_bad_input_torch.py, so after the
first compile inductor's FX-graph cache serves the others. Fits are shared by
module-scoped fixtures and reset in place between uses.

Findings (torch 2.13, CPU, float32), asserted below:

* faults: NaN/inf in the loss, inf or NaN in a gradient only (the loss stays finite),
  fired mid-call and at the first step of a call: the fused and the stepwise mode stop
  with ``Stop.NONFINITE`` before the bad update; parameters and Adam's state are those
  of the last finite step (stepwise: bitwise equal to the hand-written loop of that many
  steps; fused: within 1e-6 of it). ``on_nonfinite="raise"`` raises `NonFiniteError`
  with the global step number in both modes.
* checkpoints: ``torch.save`` of model / optimizer ``state_dict`` + ``torch.load(...,
  weights_only=True)``; N steps, save, restore in a new process, N steps == 2N steps,
  bitwise (stepwise mode in both processes: no compile in the subprocess). The fused
  round trip (save, load into a perturbed model/optimizer, continue) is bitwise too, in
  one process with one compiled program.
* determinism: the same inputs give bitwise the same losses, parameters and state on
  two runs (fused and stepwise). Splitting 12 fused steps as 1x12, 3x4 and 12x1 is
  bitwise identical; fused vs stepwise (eager) differs by float rounding (bound 1e-6
  relative, measured ~1e-7).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import slow_params
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
    reset,
    state_of,
)

import stepfuse.torch as sf
from stepfuse import NonFiniteError, Stop

CHUNK = 2


def assert_bitwise(a, b):
    """Two lists of tensors (or of {key: tensor}) are identical, dtype included."""
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if isinstance(u, dict):
            assert set(u) == set(v)
            assert_bitwise([u[k] for k in sorted(u)], [v[k] for k in sorted(v)])
        else:
            assert u.dtype == v.dtype and torch.equal(u, v), (u, v)


def max_rel(a, b) -> float:
    return max(
        float(((u.double() - v.double()).abs() / v.double().abs().clamp_min(1e-30)).max())
        for u, v in zip(a, b)
    )


# -- 1. numerical faults --------------------------------------------------------------------

KINDS = {
    1: "NaN loss",
    2: "inf loss",
    3: "inf gradient (finite loss)",
    4: "NaN gradient (finite loss)",
}


def fault_loss(model):
    """The seed loss plus a fault of ``kind`` that fires once the loss drops below ``thr``.

    Terms that are exactly 0 (value and gradient) unless the fault fires, so with
    ``kind=0`` this is the plain cross-entropy, bitwise.
    """

    def loss_fn(x, y, kind, thr):
        ce = F.cross_entropy(model(x), y)
        fire = ce.detach() < thr
        u = model.weight.sum() - model.weight.sum().detach()  # value 0, d u / d weight = 1
        a = (fire & (kind == 3)).to(ce.dtype)
        b = 1 - a
        inf_grad = torch.sqrt(u * a + b) - torch.sqrt(b)  # 0; gradient +inf when a == 1
        a2 = (fire & (kind == 4)).to(ce.dtype)
        b2 = 1 - a2
        nan_grad = torch.sqrt(u.abs() * a2 + b2) - torch.sqrt(b2)  # 0; gradient 0 * inf = NaN
        loss = ce + inf_grad + nan_grad
        loss = torch.where(fire & (kind == 1), math.nan, loss)
        return torch.where(fire & (kind == 2), math.inf, loss)

    return loss_fn


@pytest.fixture(scope="module")
def fault_fits():
    fits = {}
    for mode in ("fused", "stepwise"):
        model, optimizer, _ = make("perceptron", "adam")
        fits[mode] = (
            model,
            optimizer,
            sf.fuse(fault_loss(model), optimizer, steps=12, chunk=CHUNK, mode=mode),
        )
    # the clean trajectory (kind 0) and a threshold between the losses before updates 4 and 5
    model, optimizer, fit = fits["stepwise"]
    clean = fit(X, Y, torch.tensor(0), torch.tensor(0.0)).loss
    reset("perceptron", model, optimizer)
    assert np.all(np.diff(clean) < 0)
    return fits, float((clean[4] + clean[5]) / 2)


FAULT_AT = 5


@pytest.mark.parametrize("kind", sorted(KINDS), ids=list(KINDS.values()))
def test_fault_mid_call_stops_before_the_bad_update(fault_fits, kind):
    fits, thr = fault_fits
    out = {}
    for mode, (model, optimizer, fit) in fits.items():
        reset("perceptron", model, optimizer)
        start = fit.step
        trace = fit(X, Y, torch.tensor(kind), torch.tensor(thr))
        assert_mode(fit, mode)
        assert trace.stop == Stop.NONFINITE and trace.steps == FAULT_AT, (mode, trace)
        assert fit.step - start == FAULT_AT
        assert len(trace.loss) == FAULT_AT + 1 and np.all(np.isfinite(trace.loss[:-1]))
        assert np.isfinite(trace.loss[-1]) == (kind in (3, 4))  # gradient faults: finite loss
        assert all(torch.isfinite(p).all() for p in model.parameters())
        out[mode] = (params_of(model), state_of(optimizer), trace.loss)
    ref_m, ref_o, _ = make("perceptron", "adam")
    ref_loss = reference_steps(ref_m, ref_o, FAULT_AT)
    # stepwise: exactly the hand-written loop of FAULT_AT steps (the fault terms add exact zeros)
    assert_bitwise(out["stepwise"][0], params_of(ref_m))
    assert_bitwise(out["stepwise"][1], state_of(ref_o))
    np.testing.assert_array_equal(out["stepwise"][2][:-1], ref_loss.astype(np.float32))
    # fused: the same state within float rounding
    assert_close_lists(out["fused"][0], params_of(ref_m))
    assert_same_state(out["fused"][1], state_of(ref_o))
    np.testing.assert_allclose(out["fused"][2][:-1], ref_loss, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", [1, 3], ids=[KINDS[1], KINDS[3]])
def test_fault_at_the_first_step_of_a_later_call_applies_nothing(fault_fits, kind):
    fits, _ = fault_fits
    for mode, (model, optimizer, fit) in fits.items():
        reset("perceptron", model, optimizer)
        fit(X, Y, torch.tensor(0), torch.tensor(0.0), steps=3)
        params, state = params_of(model), state_of(optimizer)
        trace = fit(X, Y, torch.tensor(kind), torch.tensor(math.inf), steps=6)  # fires at once
        assert_mode(fit, mode)
        assert (trace.steps, trace.stop, len(trace.loss)) == (0, Stop.NONFINITE, 1), mode
        assert_bitwise(params_of(model), params)
        assert_bitwise(state_of(optimizer), state)


# Fused, the conformance suite's torch run raises at the global step with its state (a
# compile of its own here): --runslow.
@pytest.mark.parametrize("mode", slow_params(["fused", "stepwise"], {"fused"}))
def test_on_nonfinite_raise_reports_the_global_step(fault_fits, mode):
    _, thr = fault_fits
    model, optimizer, _ = make("perceptron", "adam")
    fit = sf.fuse(
        fault_loss(model), optimizer, steps=12, chunk=CHUNK, mode=mode, on_nonfinite="raise"
    )
    assert fit(X, Y, torch.tensor(0), torch.tensor(0.0), steps=2).steps == 2  # clean call first
    reset("perceptron", model, optimizer)  # start again from step 0 of the trajectory ...
    fit.step = 0  # ... and of the counter
    with pytest.raises(NonFiniteError) as err:
        fit(X, Y, torch.tensor(2), torch.tensor(thr))
    assert err.value.step == FAULT_AT == err.value.trace.steps == fit.step
    assert err.value.trace.stop == Stop.NONFINITE and math.isinf(err.value.trace.loss[-1])
    assert f"step {FAULT_AT}" in str(err.value)
    ref_m, ref_o, _ = make("perceptron", "adam")
    reference_steps(ref_m, ref_o, FAULT_AT)
    assert_close_lists(params_of(model), params_of(ref_m))
    assert_same_state(state_of(optimizer), state_of(ref_o))
    if mode == "fused":
        assert_fused(fit)
        assert fit.compiles == 1


# -- 2. checkpoints ---------------------------------------------------------------------------

N = 10

# The problem as source, so this process and the restoring subprocess run the same code.
PROBLEM_SRC = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    import stepfuse.torch as sf
    from stepfuse.problems import blobs, mlp_init

    xn, yn = blobs()
    X, Y = torch.from_numpy(xn), torch.from_numpy(yn).long()

    def make():
        layers = mlp_init((2, 16, 2))
        model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        with torch.no_grad():
            for lin, p in zip((model[0], model[2]), layers):
                lin.weight.copy_(torch.from_numpy(p["kernel"].T))
                lin.bias.copy_(torch.from_numpy(p["bias"]))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        fit = sf.fuse(lambda x, y: F.cross_entropy(model(x), y), optimizer, steps=100, mode="stepwise")
        return model, optimizer, fit

    def save(path, model, optimizer, fit, **extra):
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": fit.step, **extra}, path)

    def load(path, model, optimizer, fit):
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        fit.step = ckpt["step"]
        return ckpt
    """
)
_ns: dict = {}
exec(PROBLEM_SRC, _ns)
ck_make, ck_save, ck_load = _ns["make"], _ns["save"], _ns["load"]


def opt_tensors(optimizer):
    """Every tensor of ``optimizer.state_dict()['state']``, in a fixed order."""
    st = optimizer.state_dict()["state"]
    return [st[i][k] for i in sorted(st) for k in sorted(st[i])]


def test_checkpoint_restored_in_a_new_process_continues_bitwise(tmp_path):
    model, optimizer, fit = ck_make()
    ref_loss = fit(X, Y, steps=2 * N).loss  # reference: 2N steps in one call
    ref_params, ref_state = params_of(model), opt_tensors(optimizer)

    model, optimizer, fit = ck_make()
    first = fit(X, Y, steps=N).loss
    ckpt, out = tmp_path / "half.pt", tmp_path / "final.pt"
    ck_save(ckpt, model, optimizer, fit)
    script = PROBLEM_SRC + textwrap.dedent(
        f"""
        model, optimizer, fit = make()
        ckpt = load({str(ckpt)!r}, model, optimizer, fit)
        assert fit.step == {N}, fit.step
        trace = fit(X, Y, steps={N})
        save({str(out)!r}, model, optimizer, fit, loss=torch.from_numpy(trace.loss),
             stop=int(trace.stop))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    model2, optimizer2, fit2 = ck_make()
    final = ck_load(out, model2, optimizer2, fit2)
    assert final["step"] == 2 * N and final["stop"] == Stop.STEPS
    assert_bitwise(params_of(model2), ref_params)
    assert_bitwise(opt_tensors(optimizer2), ref_state)  # Adam: step, exp_avg, exp_avg_sq
    np.testing.assert_array_equal(np.concatenate([first, final["loss"].numpy()]), ref_loss)


class Evil:
    """An object whose unpickling would run code (here: create a file)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_weights_only_loading_refuses_a_checkpoint_with_a_pickled_object(tmp_path):
    model, optimizer, fit = ck_make()
    fit(X, Y, steps=2)
    marker = tmp_path / "code-was-run"
    bad = tmp_path / "bad.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": fit.step,
            "extra": Evil(str(marker)),
        },
        bad,
    )
    before = params_of(model)
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only load failed"):
        ck_load(bad, model, optimizer, fit)
    assert not marker.exists()
    assert_bitwise(params_of(model), before)
    # the plain checkpoint of the same state loads
    good = tmp_path / "good.pt"
    ck_save(good, model, optimizer, fit)
    assert ck_load(good, model, optimizer, fit)["step"] == 2


@pytest.fixture(scope="module")
def fused_adam():
    """One compiled fused fit (seed perceptron, Adam) shared by the fused checks below."""
    model, optimizer, loss_fn = make("perceptron", "adam")
    fit = sf.fuse(loss_fn, optimizer, steps=12, chunk=CHUNK)
    return model, optimizer, fit


def test_fused_checkpoint_round_trip_is_bitwise(fused_adam, tmp_path):
    model, optimizer, fit = fused_adam
    reset("perceptron", model, optimizer)
    ref_loss = fit(X, Y, steps=2 * N).loss
    ref_params, ref_state = params_of(model), opt_tensors(optimizer)
    reset("perceptron", model, optimizer)
    first = fit(X, Y, steps=N).loss
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt"
    )
    reset("perceptron", model, optimizer)  # wipe: fresh parameters, empty state
    reference_steps(model, optimizer, 3)  # and some other state in place
    ckpt = torch.load(tmp_path / "c.pt", weights_only=True)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    second = fit(X, Y, steps=N).loss
    assert_bitwise(params_of(model), ref_params)
    assert_bitwise(opt_tensors(optimizer), ref_state)
    np.testing.assert_array_equal(np.concatenate([first, second]), ref_loss)
    assert_fused(fit)
    assert fit.compiles == 1


# -- 3. determinism ---------------------------------------------------------------------------


def run_split(model, optimizer, fit, split):
    reset("perceptron", model, optimizer)
    losses = []
    for n in split:
        trace = fit(X, Y, steps=n)
        assert_mode(fit, fit.opts.mode)
        assert trace.steps == n
        losses.append(trace.loss)
    return params_of(model), state_of(optimizer), np.concatenate(losses)


def test_same_inputs_give_bitwise_same_results(fused_adam):
    model, optimizer, fit = fused_adam
    a, b = run_split(model, optimizer, fit, [12]), run_split(model, optimizer, fit, [12])
    assert_bitwise(a[0], b[0])
    assert_bitwise(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])
    sm, so, _ = make("perceptron", "adam")
    sw = sf.fuse(lambda x, y: F.cross_entropy(sm(x), y), so, steps=12, mode="stepwise")
    c, d = run_split(sm, so, sw, [12]), run_split(sm, so, sw, [12])
    assert_bitwise(c[0], d[0])
    assert_bitwise(c[1], d[1])
    np.testing.assert_array_equal(c[2], d[2])


def test_splitting_the_steps_into_calls(fused_adam):
    """1x12, 3x4 and 12x1 fused calls: bitwise identical (measured; asserted).

    Fused vs stepwise (eager ``opt.step()``) is not bitwise (inductor fuses and
    vectorizes the arithmetic differently): bounded by 1e-6 relative.
    """
    model, optimizer, fit = fused_adam
    runs = {
        str(split): run_split(model, optimizer, fit, split) for split in ([12], [4] * 3, [1] * 12)
    }
    ref = runs["[12]"]
    for name, (p, s, loss) in runs.items():
        assert_bitwise(p, ref[0])
        assert_bitwise(s, ref[1])
        np.testing.assert_array_equal(loss, ref[2], err_msg=name)
    sm, so, _ = make("perceptron", "adam")
    sw = sf.fuse(lambda x, y: F.cross_entropy(sm(x), y), so, steps=12, mode="stepwise")
    for split in ([12], [4] * 3, [1] * 12):
        p, s, loss = run_split(sm, so, sw, split)
        assert max_rel(p, ref[0]) <= 1e-6
        np.testing.assert_allclose(loss, ref[2], rtol=1e-6)
    ref_m, ref_o, _ = make("perceptron", "adam")
    hand = reference_steps(ref_m, ref_o, 12)
    assert_bitwise(p, params_of(ref_m))  # stepwise == hand-written loop, bitwise
    np.testing.assert_array_equal(loss, hand.astype(np.float32))


# -- 4. progress ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["stepwise", "fused"])
def test_progress_bar_is_shown(fused_adam, mode, capsys):
    if mode == "fused":
        model, optimizer, fit = fused_adam
        reset("perceptron", model, optimizer)
        fit.opts = dataclasses.replace(fit.opts, progress=True, every=3)  # same compiled program
    else:
        model, optimizer, loss_fn = make("perceptron", "adam")
        fit = sf.fuse(loss_fn, optimizer, steps=12, progress=True, every=3, mode=mode)
    try:
        trace = fit(X, Y, steps=12)
    finally:
        fit.opts = dataclasses.replace(fit.opts, progress=False, every=None)
    out = capsys.readouterr().out
    assert trace.steps == 12
    assert_mode(fit, mode)
    assert "stepfuse.torch" in out and "12/12" in out, out
    if mode == "fused":
        assert fit.compiles == 1


def test_deprecation_warnings_as_errors_do_not_stop_fusion():
    """Under ``-W error::DeprecationWarning`` (a strict test suite) the program still
    compiles: torch's own deprecation warnings while it compiles (a module inductor
    imports) are not the user's, and failed the build into a stepwise fallback. A new
    process, where torch has imported nothing of inductor's yet."""
    script = textwrap.dedent(
        """
        import torch, torch.nn.functional as F
        import stepfuse.torch as sf
        from stepfuse.problems import blobs

        xn, yn = blobs()
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        fit = sf.fuse(lambda x, y: F.cross_entropy(model(x), y), opt, steps=4, chunk=2)
        trace = fit(torch.from_numpy(xn), torch.from_numpy(yn).long())
        print(fit.mode, trace.steps, fit.fallback_reason)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[:2] == ["fused", "4"], proc.stdout + proc.stderr[-3000:]
