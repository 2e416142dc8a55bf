"""Property tests (hypothesis): stepfuse.torch against the hand-written PyTorch loop.

1. ``mode="stepwise"`` vs ``opt.zero_grad(); loss.backward(); opt.step()`` written here,
   for random total steps (1..30) split at random into calls, ``record_every`` (1..5),
   ``tol`` (None or small), optimizer (SGD with momentum / Adam) and learning rate:
   same ``steps``, ``stop``, recorded losses and parameters / optimizer state, *bitwise*
   (both run torch's own eager update on the same tensors). No compile.
2. fused vs stepwise for random splits on ONE compiled fit (the learning rate, tol and
   record_every are baked into the compiled program, so they are fixed here); the fit
   is reset in place between examples: losses and state within 1e-6.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from helpers import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch_helpers import (
    X,
    Y,
    assert_close_lists,
    assert_mode,
    assert_same_state,
    make,
    params_of,
    reset,
    state_of,
)

import stepfuse.torch as sf
from stepfuse import Stop

MAX_STEPS = 30
OPTS = {"sgd_momentum": (1e-3, 0.5), "adam": (1e-3, 0.3)}


@st.composite
def splits(draw, max_steps=MAX_STEPS):
    total = draw(st.integers(1, max_steps))
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=5))) if total > 1 else []
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def hand_written(model, optimizer, n, record_every, tol, start_index=0):
    """The user's loop with stepfuse's semantics written out: (losses kept, applied, stop)."""
    kept, applied, prev = [], 0, None
    for i in range(n):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(X), Y)
        loss.backward()
        value = loss.item()
        if i % record_every == 0:
            kept.append(value)
        optimizer.step()
        applied += 1
        if tol is not None and i > 0 and abs(value - prev) <= tol:
            return kept, applied, Stop.TOL
        prev = value
    return kept, applied, Stop.STEPS


# 10 examples in CI, 20 with --runslow.
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    split=splits(),
    record_every=st.integers(1, 5),
    opt=st.sampled_from(sorted(OPTS)),
    lr_frac=st.floats(0, 1),
    tol=st.one_of(st.none(), st.sampled_from([1e-4, 1e-3, 5e-3])),
)
def test_stepwise_equals_the_hand_written_loop(split, record_every, opt, lr_frac, tol):
    lo, hi = OPTS[opt]
    lr = lo * (hi / lo) ** lr_frac  # log-uniform
    model, optimizer, loss_fn = make("perceptron", opt)
    ref_m, ref_o, _ = make("perceptron", opt)
    for o in (optimizer, ref_o):
        o.param_groups[0]["lr"] = lr
    fit = sf.fuse(
        loss_fn, optimizer, steps=MAX_STEPS, record_every=record_every, tol=tol, mode="stepwise"
    )
    for n in split:
        trace = fit(X, Y, steps=n)
        kept, applied, stop = hand_written(ref_m, ref_o, n, record_every, tol)
        assert (trace.steps, trace.stop) == (applied, stop)
        np.testing.assert_array_equal(trace.loss, np.asarray(kept, np.float32))
        for p, q in zip(model.parameters(), ref_m.parameters()):
            assert torch.equal(p, q)
        assert_same_state(state_of(optimizer), state_of(ref_o), rtol=0, atol=0)


_FUSED: dict = {}


def fused_pair():
    """One compiled fused fit and a stepwise twin (seed perceptron, Adam lr 0.01, chunk 2)."""
    if not _FUSED:
        for mode in ("fused", "stepwise"):
            model, optimizer, loss_fn = make("perceptron", "adam")
            _FUSED[mode] = (
                model,
                optimizer,
                sf.fuse(loss_fn, optimizer, steps=MAX_STEPS, chunk=2, mode=mode),
            )
    return _FUSED


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split=splits(), warm=st.booleans())
def test_fused_equals_stepwise_for_any_split(split, warm):
    out = {}
    for mode, (model, optimizer, fit) in fused_pair().items():
        reset("perceptron", model, optimizer)  # in place: same tensors, empty state
        if warm:  # start from an existing optimizer state (no eager first step)
            fit(X, Y, steps=1)
        traces = [fit(X, Y, steps=n) for n in split]
        assert_mode(fit, mode)
        assert [t.steps for t in traces] == split and all(t.stop == Stop.STEPS for t in traces)
        out[mode] = (
            np.concatenate([t.loss for t in traces]),
            params_of(model),
            state_of(optimizer),
        )
    np.testing.assert_allclose(out["fused"][0], out["stepwise"][0], rtol=1e-6, atol=1e-7)
    assert out["fused"][0].dtype == out["stepwise"][0].dtype == np.float32  # as the model's
    assert_close_lists(out["fused"][1], out["stepwise"][1])
    assert_same_state(out["fused"][2], out["stepwise"][2])
    assert fused_pair()["fused"][2].compiles == 1
