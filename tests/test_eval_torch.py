"""Evaluation inside the torch loop (`stepfuse.torch._eval`): ``eval_fn`` fused == stepwise ==
the plain PyTorch loop that evaluates at the same global steps, over calls whose lengths do
not line up with ``eval_every``; a dict (with an integer series) and a scalar ``eval_fn``; new
``eval_batch`` values without a new compile; a refused update and ``tol`` (no evaluation
after the last applied update); a callback (program calls ending at its steps); a model
with dropout evaluated in eval mode (``model.eval()`` / ``model.train()`` inside
``eval_fn``); bad input refused by name with nothing changed. Two compiled fits in all
(module-scoped), each run by several tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import stepfuse as sf
import stepfuse.torch as sft
from stepfuse import Stop

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "torch.md"
RTOL, ATOL = 2e-5, 1e-6

G = torch.Generator().manual_seed(7)
X = torch.randn(40, 3, generator=G)
Y = torch.randn(40, generator=G)
Y_NAN = Y.clone()
Y_NAN[5] = float("nan")  # a refused update: its loss is NaN
XV, YV = torch.randn(16, 3, generator=G), torch.randn(16, generator=G)  # the held-out set
XV2, YV2 = torch.randn(16, 3, generator=G), torch.randn(16, generator=G)  # new values
XS, YS = X.expand(8, 40, 3), Y.expand(8, 40).contiguous()  # stacked minibatches (fit B)
YS_NAN = YS.clone()
YS_NAN[3, 0] = float("nan")  # a refused update mid-call: a call's 4th step


def _mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(3)
    layers: list[nn.Module] = [nn.Linear(3, 8), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(8, 1))


def _loss_of(model: nn.Module) -> Any:
    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((model(x)[:, 0] - y) ** 2).mean()

    return loss_fn


def _eval_dict(model: nn.Module) -> Any:
    def eval_fn(xv: torch.Tensor, yv: torch.Tensor) -> dict:
        err = model(xv)[:, 0] - yv
        return {"mse": (err**2).mean(), "mae": err.abs().mean(), "hits": (err < 0).sum()}

    return eval_fn


def _eval_in_eval_mode(model: nn.Module) -> Any:
    """The guide's recommendation for a model with dropout: eval mode inside ``eval_fn``."""

    def eval_fn(xv: torch.Tensor, yv: torch.Tensor) -> torch.Tensor:
        model.eval()
        out = (model(xv)[:, 0] - yv).abs().mean()
        model.train()
        return out

    return eval_fn


# -- fit A: Adam, a dict eval_fn, a callback ---------------------------------------------------

A_EVERY, A_CB_EVERY = 4, 2
A_CALLS = [  # (y, steps, eval_batch): 3 + 3 + 5 + 4 updates, a refused one, then 2 more
    (Y, 3, (XV, YV)),
    (Y, 3, (XV, YV)),
    (Y, 5, (XV, YV)),
    (Y, 4, (XV2, YV2)),
    (Y_NAN, 3, (XV2, YV2)),
    (Y, 2, (XV2, YV2)),
]


def _fit_a(mode: str, seen: list) -> tuple[Any, nn.Module]:
    model = _mlp()
    fit = sft.fuse(
        _loss_of(model),
        torch.optim.Adam(model.parameters(), lr=1e-2),
        steps=5,
        chunk=2,  # evaluations inside a chunk, at less compile time than the default 4
        eval_fn=_eval_dict(model),
        eval_every=A_EVERY,
        callback=lambda step, loss: seen.append((step, loss)),
        every=A_CB_EVERY,
        mode=mode,
    )
    return fit, model


def _plain_a() -> dict:
    """The plain PyTorch loop of fit A's calls: a NaN loss is not applied and ends its call."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn, eval_fn = _loss_of(model), _eval_dict(model)
    out: dict[str, Any] = {"losses": [], "step": [], "values": {}, "seen": []}
    t = 0
    for y, n, eb in A_CALLS:
        for _ in range(n):
            opt.zero_grad()
            loss = loss_fn(X, y)
            out["losses"].append(loss.item())
            if not torch.isfinite(loss):
                break
            loss.backward()
            opt.step()
            t += 1
            if t % A_EVERY == 0:
                with torch.no_grad():
                    values = eval_fn(*eb)
                out["step"].append(t)
                for k, v in values.items():
                    out["values"].setdefault(k, []).append(v.numpy())
            if t % A_CB_EVERY == 0:
                out["seen"].append((t, float(loss)))
    out.update(model=model, t=t)
    return out


@pytest.fixture(scope="module")
def runs_a() -> dict:
    got: dict[str, Any] = {"plain": _plain_a()}
    for mode in ("fused", "stepwise"):
        seen: list = []
        fit, model = _fit_a(mode, seen)
        traces, compiles = [], []
        for y, n, eb in A_CALLS:
            traces.append(fit(X, y, steps=n, eval_batch=eb))
            compiles.append(fit.compiles)
        got[mode] = {"fit": fit, "model": model, "traces": traces, "compiles": compiles}
        got[mode]["seen"] = seen
    return got


def _close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_fused_equals_stepwise_equals_plain_across_calls(runs_a: dict) -> None:
    ref = runs_a["plain"]
    assert ref["step"] == [4, 8, 12, 16]  # calls that do not line up with eval_every
    for mode in ("fused", "stepwise"):
        run = runs_a[mode]
        assert run["fit"].mode == mode
        traces = run["traces"]
        steps = np.concatenate([t.eval.step for t in traces])
        assert steps.dtype == np.int64
        np.testing.assert_array_equal(steps, ref["step"])
        # which call evaluated what: the global schedule
        assert [list(t.eval.step) for t in traces] == [[], [4], [8], [12], [], [16]]
        for k in ("mse", "mae", "hits"):
            got = np.concatenate([t.eval[k] for t in traces])
            want = np.asarray(ref["values"][k])
            assert got.dtype == (np.int64 if k == "hits" else np.float32), (k, got.dtype)
            _close(got, want)
        _close(np.concatenate([t.loss for t in traces]), np.float32(ref["losses"]))
        for p, q in zip(run["model"].parameters(), ref["model"].parameters()):
            _close(p.detach(), q.detach())
        assert run["fit"].step == ref["t"] == 17
        assert len(traces[0].eval) == 0 and list(traces[0].eval.values) == ["mse", "mae", "hits"]


def test_new_eval_batch_values_reuse_the_compiled_program(runs_a: dict) -> None:
    fused = runs_a["fused"]
    assert fused["compiles"] == [1] * len(A_CALLS)  # eval_batch XV2 from the 4th call on
    # the values are those of the new eval_batch: the plain loop's at step 12 and 16
    _close(fused["traces"][3].eval["mse"], runs_a["plain"]["values"]["mse"][2:3])


def test_refused_update_brings_no_evaluation(runs_a: dict) -> None:
    for mode in ("fused", "stepwise"):
        refused = runs_a[mode]["traces"][4]  # its first step (the fit's 16th) is NaN
        assert refused.stop == Stop.NONFINITE and refused.steps == 0
        assert len(refused.eval) == 0  # step 16 is due, but nothing was applied
        assert list(runs_a[mode]["traces"][5].eval.step) == [16]  # the next call evaluates it


def test_callback_sees_the_plain_loops_steps_and_program_calls_gather(runs_a: dict) -> None:
    want = runs_a["plain"]["seen"]
    for mode in ("fused", "stepwise"):
        seen = runs_a[mode]["seen"]
        assert [s for s, _ in seen] == [s for s, _ in want]
        _close([v for _, v in seen], [v for _, v in want])


def test_bad_call_input_is_refused_by_name_with_nothing_changed(runs_a: dict) -> None:
    fit, model = runs_a["fused"]["fit"], runs_a["fused"]["model"]
    before = [p.detach().clone() for p in model.parameters()]
    step, compiles = fit.step, fit.compiles
    with pytest.raises(TypeError, match=r"failed while checking it with eval_batch \[\]"):
        fit(X, Y, steps=2)  # no eval_batch: eval_fn() misses its arguments
    with pytest.raises(TypeError, match=r"eval_fn\(\*eval_batch\)` failed while checking"):
        fit(X, Y, steps=2, eval_batch=(XV,))  # eval_fn takes two
    with pytest.raises(RuntimeError, match=r"eval_fn\(\*eval_batch\)` failed while checking"):
        fit(X, Y, steps=2, eval_batch=(torch.randn(4, 5), YV))  # wrong width
    assert fit.step == step and fit.compiles == compiles
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)


# -- fit B: SGD with tol, dropout, an eval_fn in eval mode ------------------------------------

B_EVERY, B_TOL = 3, 2e-3
B_CALLS = [(YS, 8), (YS, 8), (YS, 8), (YS_NAN, 8), (YS, 5)]


def _sgd_evaluating_in_eval_mode(net: nn.Module, steps: int, every: int, **kw: Any) -> Any:
    """SGD(0.05) on the squared error, ``eval_fn`` switching the model to eval mode."""
    return sft.fuse(
        _loss_of(net),
        torch.optim.SGD(net.parameters(), lr=0.05),
        steps=steps,
        eval_fn=_eval_in_eval_mode(net),
        eval_every=every,
        **kw,
    )


def _fit_b(mode: str) -> tuple[Any, nn.Module]:
    model = _mlp(dropout=0.2)
    fit = _sgd_evaluating_in_eval_mode(model, 8, B_EVERY, tol=B_TOL, mode=mode)
    return fit, model


@pytest.fixture(scope="module")
def runs_b() -> dict:
    got: dict[str, Any] = {}
    for mode in ("fused", "stepwise"):
        fit, model = _fit_b(mode)
        torch.manual_seed(11)  # the dropout masks: the same draws in every run
        traces = [fit(sf.Batches(XS, ys), steps=n, eval_batch=(XV, YV)) for ys, n in B_CALLS]
        got[mode] = {"fit": fit, "model": model, "traces": traces}
    return got


def _plain_b(applied: list[int], refused: list[bool]) -> dict:
    """The plain loop that runs each call's ``applied`` updates (where ``tol`` or a NaN
    ended it), dropout in train mode, evaluating in eval mode. A ``refused`` call's NaN
    step ran its forward pass (its dropout draws) and updated nothing."""
    model = _mlp(dropout=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn, eval_fn = _loss_of(model), _eval_in_eval_mode(model)
    torch.manual_seed(11)
    out: dict[str, Any] = {"step": [], "value": []}
    t = 0
    for (ys, _), n in zip(B_CALLS, applied):
        for i in range(n):
            opt.zero_grad()
            loss_fn(XS[i], ys[i]).backward()
            opt.step()
            t += 1
            if t % B_EVERY == 0:
                with torch.no_grad():
                    out["value"].append(float(eval_fn(XV, YV)))
                out["step"].append(t)
        if refused.pop(0):
            loss_fn(XS[n], ys[n])  # the refused step's forward: it drew its masks
    out.update(model=model, t=t)
    return out


def test_tol_and_a_refused_update_mid_call_with_dropout_in_eval_mode(runs_b: dict) -> None:
    fused, step = runs_b["fused"], runs_b["stepwise"]
    assert fused["fit"].mode == "fused" and fused["fit"].compiles == 1
    stops = [t.stop for t in fused["traces"]]
    assert stops == [t.stop for t in step["traces"]]
    assert Stop.TOL in stops and stops[3] == Stop.NONFINITE, stops
    applied = [int(t.steps) for t in fused["traces"]]
    assert applied == [int(t.steps) for t in step["traces"]]
    assert 0 < applied[3] < B_CALLS[3][1]  # the refused update came mid-call
    ref = _plain_b(applied, [t.stop == Stop.NONFINITE for t in fused["traces"]])
    for run in (fused, step):
        traces = run["traces"]
        steps = np.concatenate([t.eval.step for t in traces])
        np.testing.assert_array_equal(steps, ref["step"])
        _close(np.concatenate([t.eval.value for t in traces]), ref["value"])
        for t, start in zip(traces, np.cumsum([0, *applied[:-1]])):
            # evaluations up to the call's last applied update only
            assert all(start < s <= start + t.steps for s in t.eval.step)
        for p, q in zip(run["model"].parameters(), ref["model"].parameters()):
            _close(p.detach(), q.detach())
        assert run["model"].training  # eval_fn put it back in train mode
    _close(
        np.concatenate([t.loss for t in fused["traces"]]),
        np.concatenate([t.loss for t in step["traces"]]),
    )


# -- bad input at build time and on the first call (no compile) --------------------------------


def _fresh() -> tuple[nn.Module, Any, Any]:
    model = _mlp()
    return model, _loss_of(model), torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "options, exc, pattern",
    [
        ({"eval_every": 3}, ValueError, r"`eval_every` must be used with `eval_fn`"),
        ({"eval_fn": "f", "eval_every": 3}, TypeError, r"`eval_fn` must be a function"),
        ({"eval_fn": len, "eval_every": 0}, ValueError, r"`eval_every` must be an int >= 1"),
        ({"eval_fn": len, "eval_every": -2}, ValueError, r"`eval_every` must be an int >= 1"),
        ({"eval_fn": len, "eval_every": 1.5}, TypeError, r"`eval_every` must be an int >= 1"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict, exc: type, pattern: str) -> None:
    _, loss_fn, opt = _fresh()
    with pytest.raises(exc, match=pattern):
        sft.fuse(loss_fn, opt, steps=4, **options)


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_bad_eval_fn_output_is_refused_before_anything_runs(mode: str) -> None:
    model, loss_fn, opt = _fresh()
    before = [p.detach().clone() for p in model.parameters()]
    cases = [
        (lambda xv, yv: model(xv)[:, 0] - yv, TypeError, r"`eval_fn` must be a scalar or a dict"),
        (lambda xv, yv: {"err": model(xv)}, TypeError, r"`eval_fn` must be a dict of scalars"),
        (lambda xv, yv: {}, TypeError, r"a non-empty dict of scalars"),
        (
            lambda xv, yv: nn.functional.dropout(model(xv), 0.5).mean(),
            ValueError,
            r"`eval_fn` must be a function that draws no random numbers.*model\.eval\(\)",
        ),
    ]
    for eval_fn, exc, pattern in cases:
        fit = sft.fuse(loss_fn, opt, steps=4, eval_fn=eval_fn, eval_every=2, mode=mode)
        with pytest.raises(exc, match=pattern):
            fit(X, Y, eval_batch=(XV, YV))
        assert fit.step == 0 and fit.compiles == 0 and not opt.state
    plain_fit = sft.fuse(loss_fn, opt, steps=4, mode=mode)
    with pytest.raises(ValueError, match=r"`eval_batch` must be passed only to a fit built with"):
        plain_fit(X, Y, eval_batch=(XV, YV))
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)


def test_fit_without_eval_fn_builds_no_evaluation() -> None:
    """Without ``eval_fn`` the program's body and inputs are those it had before: no `Spec`,
    no evaluation inputs after the batch, no evaluation tensors in the carry."""
    model, loss_fn, opt = _fresh()
    fit = sft.fuse(loss_fn, opt, steps=4)
    assert fit._evals is None
    fit._fed = sft._data.Fed((X, Y), torch.device("cpu"), 0, 4)
    assert fit._inputs(0) == fit._fed.inputs(0)
    assert fit._body(capturable=False).evaluate is None if fit._resolved else False


@pytest.mark.slow  # a compile more; the fused == plain test above is the same training
def test_guide_example_runs() -> None:
    text = GUIDE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = [b for b in blocks if "eval_fn=" in b and "eval_batch=" in b]
    assert example, "the torch guide has an example with eval_fn and eval_batch"
    scope: dict = {}
    exec(compile(example[0], str(GUIDE), "exec"), scope)  # noqa: S102 - the guide's own code
    trace = scope["trace"]
    assert scope["fit"].mode == "fused"
    assert len(trace.eval) > 0 and np.all(np.isfinite(trace.eval["loss"]))


def _sgd_fit_with_eval(model: nn.Module, steps: int, eval_every: int) -> Any:
    """SGD(0.1) on cross-entropy, evaluated on the same loss every ``eval_every`` steps."""
    ce = torch.nn.functional.cross_entropy
    return sft.fuse(
        lambda a, b: ce(model(a), b),
        torch.optim.SGD(model.parameters(), lr=0.1),
        steps=steps,
        model=model,
        eval_fn=lambda a, b: ce(model(a), b),
        eval_every=eval_every,
    )


def test_convolution_model_with_eval_fn_runs_fused_and_equals_the_plain_loop() -> None:
    """A Conv2d model with ``eval_fn``: inductor's channels-last layout inside the
    evaluation's ``torch.cond`` failed its own stride check when the program ran (torch 2.13);
    the program is now compiled without layout optimization, and equals the plain loop."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Flatten(), nn.Linear(64, 3))

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 1, 4, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    xv, yv = torch.randn(5, 1, 4, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
    ce = torch.nn.functional.cross_entropy
    model, plain = net(), net()
    fit = _sgd_fit_with_eval(model, steps=4, eval_every=2)
    trace = fit(x, y, eval_batch=(xv, yv))
    assert fit.mode == "fused", fit.fallback_reason
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses, evals = [], []
    for t in range(4):
        opt.zero_grad()
        loss = ce(plain(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (t + 1) % 2 == 0:
            with torch.no_grad():
                evals.append(ce(plain(xv), yv).item())
    np.testing.assert_allclose(trace.loss, losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(trace.eval.value, evals, rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), plain.parameters()):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


def test_a_program_that_fails_when_it_first_runs_falls_back_saying_why(monkeypatch) -> None:
    """The build runs one step (and an evaluation) of a new program, results dropped: a
    program inductor compiles but whose code fails when it runs (here the channels-last
    convolution inside ``torch.cond`` of before, restored) falls back with the error,
    instead of failing in every call."""
    from stepfuse.torch import _program

    monkeypatch.setattr(_program, "options_for", lambda spec, base: base)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(32, 3))
    x, y = torch.randn(4, 1, 4, 4), torch.randint(0, 3, (4,))
    fit = _sgd_fit_with_eval(model, steps=2, eval_every=1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="could not be built.*stride"):
        trace = fit(x, y, eval_batch=(x, y))
    assert fit.mode == "stepwise" and trace.steps == 2 and len(trace.eval) == 2
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_an_eval_fn_that_switches_to_train_mode_is_put_back_with_a_warning(mode: str) -> None:
    """A model trained in eval mode (BatchNorm's statistics frozen) with the guide's
    ``eval_fn`` (``model.eval()`` ... ``model.train()``): the fused program failed to trace
    (the evaluation's branch left ``training`` changed) and fell back to stepwise. Now each
    evaluation's module attributes are put back in both modes, with a warning that a plain
    loop calling this eval_fn would go on in train mode; the steps run in eval mode."""

    def net() -> nn.Module:
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))

    model, plain = net(), net()
    for m in (model, plain):
        m(X)  # running statistics of their own, which eval mode then reads
        m.eval()
    fit = _sgd_evaluating_in_eval_mode(model, 4, 2, model=model, mode=mode)
    with pytest.warns(UserWarning, match=r"eval_fn leaves module attributes changed \(Sequent"):
        trace = fit(X, Y, eval_batch=(XV, YV))
    assert fit.mode == mode, fit.fallback_reason
    assert not model.training and not model[1].training
    opt, losses, evals = torch.optim.SGD(plain.parameters(), lr=0.05), [], []
    for t in range(4):  # the plain loop in eval mode, its evaluation leaving the mode alone
        opt.zero_grad()
        loss = _loss_of(plain)(X, Y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (t + 1) % 2 == 0:
            with torch.no_grad():
                evals.append(float((plain(XV)[:, 0] - YV).abs().mean()))
    _close(trace.loss, losses)
    _close(trace.eval.value, evals)
    for p, q in zip(model.state_dict().values(), plain.state_dict().values()):
        _close(p, q)
