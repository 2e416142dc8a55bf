"""Data streams on the PyTorch backend (`stepfuse.torch._data`): `Batches` and `Epochs`
fused == stepwise == the plain ``zero_grad(); backward(); step()`` loop over the same
minibatches, across epoch boundaries and calls; a refused step; tol, record_every and a
callback with streams; a fixed argument beside a stream; `Batches.from_iterable` over a
DataLoader; bad input refused with nothing changed.

Compile budget: three programs in the whole file by default (each costs 10-60 s here).
The guide's example (docs/guides/data_torch.md, run as written) builds the first two (an
`Epochs` layout and a `Batches` one on one fit), which most tests then reuse: a test copies
the fit's model and optimizer as they are and runs the plain loop from there. The third
is `tol` / `record_every` / `callback` with a fixed argument. More under ``slow``.
"""

from __future__ import annotations

import copy
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_fused

import stepfuse as sf
import stepfuse.torch as sft
from stepfuse import Stop
from stepfuse.torch._data import epoch_order

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "data_torch.md"
RTOL, ATOL = 1e-6, 1e-7


def _guide_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def guide() -> dict[str, Any]:
    """The guide's example, run as written (two compiled programs): its scope."""
    (block,) = _guide_blocks()
    scope: dict[str, Any] = {}
    exec(compile(block, str(GUIDE), "exec"), scope)
    assert_fused(scope["fit"])
    assert scope["fit"].compiles == 2
    return scope


# -- plain PyTorch over the same minibatches -----------------------------------------------


def replica(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
    """A copy of ``model`` and ``opt`` as they are now (state copied, not shared)."""
    m = copy.deepcopy(model)
    o = type(opt)(m.parameters(), **opt.defaults)
    o.load_state_dict(copy.deepcopy(opt.state_dict()))
    return m, o


def plain(model, opt, loss, batches, tol=None, record_every=1, every=None, start=0):
    """The plain loop with stepfuse's semantics: ``(recorded losses, steps, stop, callback
    pairs)``; ``batches`` the arguments of each step, ``loss(model, *args)``."""
    losses, seen, prev = [], [], None
    steps, stop = 0, Stop.STEPS
    for i, args in enumerate(batches):
        opt.zero_grad()
        value = loss(model, *args)
        value.backward()
        v = float(value.detach())
        if i % record_every == 0:
            losses.append(v)
        if not np.isfinite(v):
            stop = Stop.NONFINITE
            break
        opt.step()
        steps += 1
        if every is not None and (start + steps) % every == 0:
            seen.append((start + steps, v))
        if tol is not None and prev is not None and abs(np.float64(v) - prev) <= tol:
            stop = Stop.TOL
            break
        prev = np.float64(np.float32(v))
    return np.asarray(losses, np.float32), steps, stop, seen


def ce(model, x, y):
    return F.cross_entropy(model(x), y)


def epoch_batches(data: sf.Epochs, start: int, n: int) -> list[tuple]:
    """The minibatches of global steps ``start .. start + n - 1``, built on the host from
    ``data.order(epoch)`` (the formula, not `Epochs.batch`)."""
    out = []
    for t in range(start, start + n):
        epoch, at = divmod(t, data.steps_per_epoch)
        rows = data.order(epoch)[at * data.batch_size : (at + 1) * data.batch_size]
        out.append(tuple(torch.as_tensor(np.asarray(a)[rows]) for a in data.arrays))
    return out


def assert_same(model_a, model_b) -> None:
    # inductor's fused kernels round otherwise than eager ops: after a few dozen steps the
    # parameters differ by up to ~1.5e-7 on some CPUs, within the suite's 1e-6 float32 bar
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=RTOL, atol=1e-6)


def stepwise_twin(fit, model, opt, loss, **options):
    """A stepwise fit over a copy of ``model``/``opt`` at ``fit.step`` (as restored from a
    checkpoint)."""
    m, o = replica(model, opt)
    twin = sft.fuse(
        lambda *a: loss(m, *a), o, steps=fit.opts.steps, model=m, mode="stepwise", **options
    )
    twin.step = fit.step
    return twin, m


def state_of(fit, model, opt) -> tuple:
    params = [p.detach().clone() for p in model.parameters()]
    return params, copy.deepcopy(opt.state_dict()), fit.step, fit.compiles


def assert_unchanged(before: tuple, fit, model, opt) -> None:
    params, opt_state, step, compiles = before
    for a, b in zip(params, model.parameters()):
        assert torch.equal(a, b.detach())
    now = opt.state_dict()
    for k, st in opt_state["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(now["state"][k][name])), name
    assert (fit.step, fit.compiles) == (step, compiles)


# -- the epochs' order on the device ---------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7, 2**63 + 1])
def test_device_order_is_the_hosts(seed):
    data = sf.Epochs(np.zeros((257, 1)), batch_size=16, seed=seed)
    for epoch in (0, 1, 5, 2**32 + 1):
        got = epoch_order(257, seed, epoch, torch.device("cpu"))
        assert got.dtype == torch.int64
        assert np.array_equal(got.numpy(), data.order(epoch))


# -- Epochs (the guide's first program) ------------------------------------------------------


def test_guide_example_runs_and_equals_the_plain_loop(guide):
    """Run by the fixture; here: it ran fused and the trace has every step's loss."""
    assert guide["trace"].steps == 6 and guide["trace"].stop == Stop.STEPS


def test_epochs_across_boundaries_fused_equals_stepwise_and_plain(guide):
    fit, model, opt, data = guide["fit"], guide["model"], guide["opt"], guide["data"]
    compiles = fit.compiles
    ref_m, ref_o = replica(model, opt)
    twin, twin_m = stepwise_twin(fit, model, opt, ce)
    start = fit.step
    traces = [fit(data, steps=17), fit(data), fit(data, steps=3)]  # several epochs each
    assert_fused(fit)
    assert fit.compiles == compiles  # smaller steps, other epochs: the same program
    got = np.concatenate([t.loss for t in traces])
    assert fit.step == start + 40
    want, steps, stop, _ = plain(ref_m, ref_o, ce, epoch_batches(data, start, 40))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert_same(model, ref_m)
    wise = np.concatenate([twin(data, steps=17).loss, twin(data).loss, twin(data, steps=3).loss])
    np.testing.assert_allclose(wise, want, rtol=RTOL, atol=ATOL)
    assert_same(twin_m, ref_m)


def test_epochs_of_another_seed_run_on_the_same_program(guide):
    fit, model, opt = guide["fit"], guide["model"], guide["opt"]
    other = sf.Epochs(guide["x"], guide["y"], batch_size=16, seed=12345)
    compiles, start = fit.compiles, fit.step
    ref_m, ref_o = replica(model, opt)
    trace = fit(other, steps=9)
    assert fit.compiles == compiles
    want, *_ = plain(ref_m, ref_o, ce, epoch_batches(other, start, 9))
    np.testing.assert_allclose(trace.loss, want, rtol=RTOL, atol=ATOL)


def test_resume_k_then_rest_equals_one_call(guide):
    fit, model, opt, data = guide["fit"], guide["model"], guide["opt"], guide["data"]
    start = fit.step
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    one = fit(data, steps=15).loss
    after_one = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(saved[0])  # a checkpoint restored: model, optimizer, step
    opt.load_state_dict(saved[1])
    fit.step = start
    two = np.concatenate([fit(data, steps=4).loss, fit(data, steps=11).loss])
    assert fit.step == start + 15
    np.testing.assert_allclose(two, one, rtol=RTOL, atol=ATOL)
    for a, b in zip(after_one, model.parameters()):
        np.testing.assert_allclose(a.numpy(), b.detach().numpy(), rtol=RTOL, atol=ATOL)


def test_nonfinite_minibatch_mid_call_then_the_next_call_starts_there(guide):
    fit, model, opt, data = guide["fit"], guide["model"], guide["opt"], guide["data"]
    spe = data.steps_per_epoch
    if fit.step % spe == 0:
        fit(data, steps=2)  # start mid-epoch: some rows come back only after the boundary
    start = fit.step
    first_seen: dict[int, int] = {}
    for t in range(start, start + 2 * spe):
        for r in data.indices(t):
            first_seen.setdefault(int(r), t)
    row, bad = max(first_seen.items(), key=lambda kv: kv[1])
    assert bad >= (start // spe + 1) * spe  # after an epoch boundary within the call
    x_nan = guide["x"].clone()
    x_nan[row, 1] = float("nan")
    poisoned = sf.Epochs(x_nan, guide["y"], batch_size=16, seed=0)
    ref_m, ref_o = replica(model, opt)
    trace = fit(poisoned, steps=2 * spe)
    assert trace.stop == Stop.NONFINITE
    assert trace.steps == bad - start and fit.step == bad
    want, steps, stop, _ = plain(ref_m, ref_o, ce, epoch_batches(poisoned, start, 2 * spe))
    assert (steps, stop) == (bad - start, Stop.NONFINITE)
    np.testing.assert_allclose(trace.loss, want, rtol=RTOL, atol=ATOL, equal_nan=True)
    assert_same(model, ref_m)  # at the last finite step
    # the next call starts at the refused step's minibatch (clean data now)
    nxt = fit(data, steps=3)
    want, *_ = plain(ref_m, ref_o, ce, epoch_batches(data, bad, 3))
    np.testing.assert_allclose(nxt.loss, want, rtol=RTOL, atol=ATOL)
    assert_same(model, ref_m)


# -- Batches (the guide's second program: 6 stacked batches of 16) ---------------------------


def test_batches_over_calls_fused_equals_stepwise_and_plain(guide):
    fit, model, opt = guide["fit"], guide["model"], guide["opt"]
    compiles = fit.compiles
    g = torch.Generator().manual_seed(3)
    stacks = [
        (torch.randn(6, 16, 4, generator=g), torch.randint(0, 2, (6, 16), generator=g))
        for _ in range(2)
    ]
    ref_m, ref_o = replica(model, opt)
    twin, twin_m = stepwise_twin(fit, model, opt, ce)
    got = [fit(sf.Batches(*stacks[0]), steps=6).loss, fit(sf.Batches(*stacks[1]), steps=4).loss]
    assert fit.compiles == compiles  # steps=4 of 6 stacked: the same program
    batches = [(xs[i], ys[i]) for xs, ys in stacks for i in range(6)]
    want, *_ = plain(ref_m, ref_o, ce, batches[:10])
    np.testing.assert_allclose(np.concatenate(got), want, rtol=RTOL, atol=ATOL)
    assert_same(model, ref_m)
    wise = [twin(sf.Batches(*stacks[0]), steps=6).loss, twin(sf.Batches(*stacks[1]), steps=4).loss]
    np.testing.assert_allclose(np.concatenate(wise), want, rtol=RTOL, atol=ATOL)
    assert_same(twin_m, ref_m)


def test_batches_from_a_dataloader(guide):
    fit, model, opt, x, y = (guide[k] for k in ("fit", "model", "opt", "x", "y"))
    compiles = fit.compiles

    def loader():
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y),
            batch_size=16,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(11),
        )

    ref_m, ref_o = replica(model, opt)
    stacked = sf.Batches.from_iterable(loader(), 6)
    assert stacked.n == 6 and tuple(stacked.arrays[0].shape) == (6, 16, 4)
    trace = fit(stacked, steps=6)
    assert fit.compiles == compiles
    want, *_ = plain(ref_m, ref_o, ce, list(loader()))  # the same shuffle: the same batches
    np.testing.assert_allclose(trace.loss, want, rtol=RTOL, atol=ATOL)
    assert_same(model, ref_m)


def test_batches_from_a_dataloader_of_dicts(guide):
    """A DataLoader over a dataset of dicts: the values reach loss_fn in sorted key order."""
    fit, model, opt, x, y = (guide[k] for k in ("fit", "model", "opt", "x", "y"))
    compiles = fit.compiles

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return {"label": y[i], "features": x[i]}  # sorted: features, label

    def loader():
        g = torch.Generator().manual_seed(5)
        return torch.utils.data.DataLoader(Rows(), 16, shuffle=True, drop_last=True, generator=g)

    ref_m, ref_o = replica(model, opt)
    stacked = sf.Batches.from_iterable(loader(), 6)  # 6, as above: no new compile
    trace = fit(stacked, steps=6)
    assert fit.compiles == compiles
    batches = [(b["features"], b["label"]) for b in loader()][:6]
    want, *_ = plain(ref_m, ref_o, ce, batches)
    np.testing.assert_allclose(trace.loss, want, rtol=RTOL, atol=ATOL)
    assert_same(model, ref_m)


# -- bad input: refused before anything runs or changes --------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda x, y: (sf.Batches(x[:80].reshape(5, 16, 4), y[:80].reshape(5, 16)),), "Batches"),
        (lambda x, y: (sf.Epochs(x.to("meta"), y, batch_size=16),), r"batch\[0\] \(Epochs array 0"),
        (
            lambda x, y: (sf.Batches(x.reshape(6, 16, 4), y.reshape(6, 16).to("meta")),),
            r"batch\[0\] \(Batches array 1",
        ),
        (lambda x, y: (sf.Epochs(torch.zeros(96, 3), y, batch_size=16),), "batch"),
    ],
    ids=[
        "fewer-batches-than-steps",
        "epochs-on-another-device",
        "batches-on-another-device",
        "shape",
    ],
)
def test_bad_streams_raise_naming_the_argument_and_change_nothing(guide, make, match):
    fit, model, opt = guide["fit"], guide["model"], guide["opt"]
    before = state_of(fit, model, opt)
    with pytest.raises(ValueError, match=match):
        fit(*make(guide["x"], guide["y"]), steps=6)
    assert_unchanged(before, fit, model, opt)


# -- tol, record_every, callback, a fixed argument beside a stream (the third program) -----


def _teacher_problem():
    torch.manual_seed(4)
    x = torch.randn(48, 4)
    w = torch.randn(4, 2)  # fixed: the same at every step
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return x, w, model


def mse(model, xb, w):
    return F.mse_loss(model(xb), xb @ w)


@pytest.fixture(scope="module")
def teacher():
    """A fit with tol, record_every=2 and a callback every 4 updates over
    ``fit(Epochs(x), w)``; tol is picked from a dry run of the plain loop so that the
    first call stops at the smallest loss difference of its 24 steps (4 epochs)."""
    x, w, model = _teacher_problem()
    data = sf.Epochs(x, batch_size=8, seed=5)
    m0, o0 = replica(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    losses, *_ = plain(m0, o0, mse, [(b[0], w) for b in epoch_batches(data, 0, 24)])
    d = np.abs(np.diff(losses.astype(np.float64)))
    lo, second = np.sort(d)[:2]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen: list[tuple[int, float]] = []
    fit = sft.fuse(
        lambda xb, wb: mse(model, xb, wb),
        opt,
        steps=24,
        model=model,
        tol=float((lo + second) / 2),
        record_every=2,
        callback=lambda step, loss: seen.append((step, loss)),
        every=4,
    )
    return dict(
        fit=fit, model=model, opt=opt, data=data, w=w, seen=seen, stop_at=int(d.argmin()) + 1
    )


@pytest.mark.slow  # a compile of its own (tol, record_every, callback): the conformance
# suite and test_torch.py test them fused; over Epochs with a fixed argument: --runslow
def test_tol_record_every_and_callback_with_epochs_and_a_fixed_argument(teacher):
    fit, model, opt, data, w, seen = (
        teacher[k] for k in ("fit", "model", "opt", "data", "w", "seen")
    )
    opts = dict(tol=fit.opts.tol, record_every=2, every=4)
    for call, steps in enumerate([None, 10, 13]):
        start = fit.step
        ref_m, ref_o = replica(model, opt)
        wise_seen: list = []
        twin, twin_m = stepwise_twin(
            fit, model, opt, mse, callback=lambda s, v: wise_seen.append((s, v)), **opts
        )
        seen.clear()
        n = steps or 24
        trace = fit(data, w, steps=steps)
        assert_fused(fit)
        assert fit.compiles == 1
        batches = [(b[0], w) for b in epoch_batches(data, start, n)]
        want, k, stop, pairs = plain(ref_m, ref_o, mse, batches, fit.opts.tol, 2, 4, start)
        if call == 0:
            assert (k, stop) == (teacher["stop_at"] + 1, Stop.TOL)
        assert (trace.steps, trace.stop) == (k, stop)
        np.testing.assert_allclose(trace.loss, want, rtol=RTOL, atol=ATOL)
        assert [s for s, _ in seen] == [s for s, _ in pairs]
        np.testing.assert_allclose([v for _, v in seen], [v for _, v in pairs], rtol=RTOL)
        assert_same(model, ref_m)
        wise = twin(data, w, steps=steps)
        assert (wise.steps, wise.stop) == (k, stop)
        np.testing.assert_allclose(wise.loss, want, rtol=RTOL, atol=ATOL)
        assert [s for s, _ in wise_seen] == [s for s, _ in pairs]


def test_stepwise_batches_beside_a_fixed_argument_and_two_epochs():
    """No compile: ``fit(Batches(xs), y)`` calls ``loss_fn(xs[i], y)``; two Epochs of
    other batch sizes step through their own epochs."""
    x, w, model = _teacher_problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_m, ref_o = replica(model, opt)
    fit = sft.fuse(lambda xb, wb: mse(model, xb, wb), opt, steps=5, mode="stepwise")
    xs = x[:40].reshape(5, 8, 4)
    trace = fit(sf.Batches(xs), w)
    want, *_ = plain(ref_m, ref_o, mse, [(xs[i], w) for i in range(5)])
    np.testing.assert_allclose(trace.loss, want, rtol=RTOL, atol=ATOL)
    a = sf.Epochs(x, batch_size=8, seed=1)  # 6 steps an epoch
    b = sf.Epochs(x[:, :2] @ w[:2], batch_size=8, shuffle=False)  # identity order

    def two(model, xa, yb):
        return F.mse_loss(model(xa)[:, :1], yb[:, :1])

    fit2 = sft.fuse(lambda xa, yb: two(model, xa, yb), opt, steps=9, mode="stepwise")
    trace = fit2(a, b)
    pairs = [(p[0], q[0]) for p, q in zip(epoch_batches(a, 0, 9), epoch_batches(b, 0, 9))]
    want, *_ = plain(ref_m, ref_o, two, pairs)
    np.testing.assert_allclose(trace.loss, want, rtol=RTOL, atol=ATOL)
    assert_same(model, ref_m)


def test_epochs_copies_a_numpy_dataset_once_as_jax_and_tf_do():
    """An `Epochs` of NumPy arrays is copied to the device at the first call: changing the
    arrays in place afterwards changes nothing the fit sees (it shared their memory on the
    CPU, so torch alone trained on the changed values)."""
    x, w, model = _teacher_problem()
    xn = x.numpy().copy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_m, ref_o = replica(model, opt)
    fit = sft.fuse(lambda xb, wb: mse(model, xb, wb), opt, steps=3, mode="stepwise")
    data = sf.Epochs(xn, batch_size=8, seed=2)
    kept = xn.copy()
    fit(data, w)
    xn *= 10.0
    trace = fit(data, w)
    batches = [(torch.from_numpy(kept[data.indices(t)]), w) for t in range(6)]
    want, *_ = plain(ref_m, ref_o, mse, batches)
    np.testing.assert_allclose(trace.loss, want[3:], rtol=RTOL, atol=ATOL)
    assert_same(model, ref_m)


# -- slow: more programs ----------------------------------------------------------------------


@pytest.mark.slow
def test_dropout_with_epochs_checks_a_real_minibatch_and_equals_the_plain_loop():
    torch.manual_seed(0)
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_m, ref_o = replica(model, opt)
    data = sf.Epochs(x, y, batch_size=8, shuffle=False)
    fit = sft.fuse(lambda a, b: ce(model, a, b), opt, steps=12, model=model)
    torch.manual_seed(1)
    trace = fit(data)
    assert_fused(fit)
    torch.manual_seed(1)
    want, *_ = plain(ref_m, ref_o, ce, epoch_batches(data, 0, 12))
    np.testing.assert_allclose(trace.loss, want, rtol=1e-5, atol=1e-6)
    assert_same(model, ref_m)


@pytest.mark.slow
def test_fused_batches_beside_a_fixed_argument_and_two_epochs():
    x, w, model = _teacher_problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_m, ref_o = replica(model, opt)
    fit = sft.fuse(lambda xb, wb: mse(model, xb, wb), opt, steps=5, model=model, chunk=2)
    xs = x[:40].reshape(5, 8, 4)
    trace = fit(sf.Batches(xs), w)
    assert_fused(fit)
    want, *_ = plain(ref_m, ref_o, mse, [(xs[i], w) for i in range(5)])
    np.testing.assert_allclose(trace.loss, want, rtol=RTOL, atol=ATOL)
    a = sf.Epochs(x, batch_size=8, seed=1)
    b = sf.Epochs(x[:, :2] @ w[:2], batch_size=6, shuffle=False)  # 8 steps an epoch

    def two(model, xa, yb):
        return F.mse_loss(model(xa)[:6, :1], yb[:, :1])

    start = fit.step
    fit2 = sft.fuse(lambda xa, yb: two(model, xa, yb), opt, steps=20, model=model)
    fit2.step = start
    trace = fit2(a, b)
    assert_fused(fit2)
    pairs = [(p[0], q[0]) for p, q in zip(epoch_batches(a, start, 20), epoch_batches(b, start, 20))]
    want, *_ = plain(ref_m, ref_o, two, pairs)
    np.testing.assert_allclose(trace.loss, want, rtol=RTOL, atol=ATOL)
    assert_same(model, ref_m)


@pytest.mark.slow
def test_benchmark_script_runs(benchmark_script, monkeypatch):
    script = benchmark_script("data_torch")
    monkeypatch.setitem(sys.modules, "data_torch", script)  # dynamo imports the loss's module
    from stepfuse.bench import data

    rows = script.main(
        ["--problems", "small", "--steps", "64", "--loop-steps", "16", "--rounds", "1"]
    )
    assert [r["contender"] for r in rows] == list(data.CONTENDERS["torch"])
    assert rows[0]["mode"] == "fused"
    assert all(r["us_per_step"] > 0 for r in rows)


def test_numpy_arrays_with_negative_strides_are_taken() -> None:
    # x[::-1] failed with torch's "negative stride" error (JAX and TF took it).
    g = np.random.default_rng(3)
    x = g.normal(size=(8, 3)).astype(np.float32)[::-1]
    y = g.normal(size=(8,)).astype(np.float32)[::-1]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    plain = torch.nn.Linear(3, 1)
    plain.load_state_dict(model.state_dict())

    def loss(m, a, b):
        return ((m(a)[:, 0] - b) ** 2).mean()

    fit = sft.fuse(
        lambda a, b: loss(model, a, b),
        torch.optim.SGD(model.parameters(), lr=0.1),
        steps=4,
        model=model,
        mode="stepwise",
    )
    data = sf.Epochs(x, y, batch_size=4, seed=2)
    trace = fit(data)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    want = []
    for t in range(4):
        a, b = (torch.from_numpy(np.ascontiguousarray(v)) for v in data.batch(t))
        opt.zero_grad()
        out = loss(plain, a, b)
        out.backward()
        opt.step()
        want.append(out.item())
    np.testing.assert_allclose(trace.loss, want, rtol=1e-6)
    xs = x[:8].reshape(2, 4, 3)[::-1]
    assert fit(sf.Batches(xs, y.reshape(2, 4)), steps=2).steps == 2


def test_epochs_at_step_0_after_the_optimizer_has_stepped_warns_to_set_fit_step():
    """No compile. A fit rebuilt after loading the model's and optimizer's state_dicts
    alone started its Epochs again at epoch 0 without a word (they hold no fit step)."""
    x, w, model = _teacher_problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = sf.Epochs(x, x[:, :2] @ w[:2], batch_size=8, seed=1)

    def fit_of():
        return sft.fuse(
            lambda a, b: F.mse_loss(model(a)[:, :1], b[:, :1]), opt, steps=3, mode="stepwise"
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fresh optimizer: nothing to say
        fit_of()(data)
    with pytest.warns(RuntimeWarning, match=r"already taken 3 steps.*fit.step = 3") as seen:
        fit_of()(data)
    assert seen[0].filename == __file__
    resumed = fit_of()
    resumed.step = 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed(data)
