"""The shared semantics (/work/shared/API.md), one suite for every backend.

Each case runs on ``jax``, ``tf2``, ``tf1`` and ``torch`` through `adapters` (the public
API only) and compares the fused fit with the same backend's ``mode="stepwise"`` fit, the
reference the fused loop is defined against. Fits are built and run once per backend by
module-scoped fixtures, and the cases read their results: a torch program compiles in
10-30 s on a small CPU, so this module builds four fused torch fits in all (one per
option set: plain, tol/record_every/callback, non-finite stop, non-finite raise).
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from adapters import BITWISE_FUSED, attempt, build
from helpers import (
    ATOL,
    BACKENDS,
    RTOL,
    X,
    Y,
    assert_close,
    assert_fused,
    assert_max_compiles,
    concat,
    splits,
)

from stepfuse import NonFiniteError, Stop


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


def snapshot(run):
    return SimpleNamespace(params=run.params(), opt_state=run.opt_state(), step=run.step)


# A momentum buffer is a running sum of gradients: an entry near zero carries the float32
# rounding of the larger terms it summed, not of its own size (TF1, the MLP after 24 steps:
# -0.0043254 against -0.0043255, 1.5e-7 apart). Parameters and losses keep the contract.
STATE_ATOL = 1e-6


def assert_same_point(got, want, rtol=RTOL, atol=ATOL, what=""):
    """Same step, parameters and optimizer state (bit for bit when rtol = atol = 0)."""
    assert got.step == want.step, f"{what}: step {got.step} against {want.step}"
    assert_close(got.params, want.params, rtol, atol, what=f"{what} params")
    state_atol = 0 if rtol == atol == 0 else max(atol, STATE_ATOL)
    assert_close(got.opt_state, want.opt_state, rtol, state_atol, what=f"{what} optimizer state")


# -- fused == stepwise over split calls -------------------------------------------------------

SPLIT = splits(12, 4)  # 3 calls of 4 steps, then one call of 12


@pytest.fixture(scope="module")
def split(backend):
    """The MLP with SGD momentum: fused calls of 4, 4, 4 then 12 steps; the stepwise fit 12 + 12;
    then fused calls with other ``steps`` and new batch values of the same shapes; and for
    `BITWISE_FUSED` another fused fit's single call of 12 steps."""
    fused = build(backend, "mlp", "momentum", steps=12)
    ref = build(backend, "mlp", "momentum", mode="stepwise", steps=12)
    out = SimpleNamespace(fused=fused)
    out.split = [fused(steps=n) for n in SPLIT]
    out.compiles_first = getattr(fused.fit, "compiles", None)
    out.at_12 = snapshot(fused)
    out.ref_first = ref(steps=12)
    out.ref_at_12 = snapshot(ref)
    out.one_call = fused(steps=12)
    out.at_24 = snapshot(fused)
    out.ref_second = ref(steps=12)
    out.ref_at_24 = snapshot(ref)
    new_batch = (X + np.float32(0.5), Y[::-1].copy())
    out.more = [fused(steps=n, batch=new_batch) for n in (1, 7)] + [fused()]
    if backend in BITWISE_FUSED:  # one fused call of 12 steps from the start
        single = build(backend, "mlp", "momentum", steps=12)
        out.single, out.single_fit = single(steps=12), single.fit
        out.single_at_12 = snapshot(single)
    return out


def _loop_of(fit) -> object:
    """Which compiled loop a fit runs (its ``plan``'s choice of XLA, where it has one)."""
    plan = getattr(fit, "plan", None)
    return plan.get("xla") if isinstance(plan, dict) else None


def test_split_calls_equal_the_stepwise_steps(split, backend):
    assert_fused(split.fused.fit)
    for trace in split.split:
        assert (trace.steps, trace.stop, len(trace.loss)) == (4, Stop.STEPS, 4), trace
    assert split.ref_first.steps == 12 and split.ref_first.stop == Stop.STEPS
    assert abs(split.split[0].loss[0] - math.log(2)) > 1e-3  # the MLP, not the seed
    assert_close(concat(split.split), split.ref_first.loss, what="losses")
    assert_same_point(split.at_12, split.ref_at_12, what="after 3 x 4 steps")
    # == one fused call of 12, bit for bit, where both fits run the same loop: a fit left to
    # choose its loop by timing (TF's jit_compile="auto") may pick XLA in one and
    # TensorFlow's kernels in the other, whose results differ by rounding.
    if backend in BITWISE_FUSED and _loop_of(split.fused.fit) == _loop_of(split.single_fit):
        assert_fused(split.single_fit)
        assert (split.single.steps, split.single.stop) == (12, Stop.STEPS), split.single
        assert_close(concat(split.split), split.single.loss, 0, 0, what="losses")
        assert_same_point(split.at_12, split.single_at_12, 0, 0, what="against one call of 12")


def test_one_call_of_12_equals_the_stepwise_steps(split):
    assert_fused(split.fused.fit)
    trace = split.one_call
    assert (trace.steps, trace.stop, len(trace.loss)) == (12, Stop.STEPS, 12), trace
    assert_close(trace.loss, split.ref_second.loss, what="losses")
    assert_same_point(split.at_24, split.ref_at_24, what="after 12 more steps")
    losses = concat(split.split + [trace])
    assert losses[-1] < 0.5 * losses[0]  # it trains


def test_one_compile_serves_every_steps_and_new_batch_values(split):
    fit = split.fused.fit
    assert_fused(fit)
    assert [t.steps for t in split.more] == [1, 7, 12]
    assert_max_compiles(fit, 1)
    assert split.compiles_first == 1, f"compiles after the first call: {split.compiles_first}"


# -- tol, record_every, callback/every: one fit with the three options -----------------------

TOL = 8e-3  # the perceptron with Adam(0.01): consecutive losses first differ by <= 8e-3
# between steps 26 and 27 (8.24e-3, then 7.84e-3: the tol is 2% from either)
EVERY, RECORD_EVERY, CALLS = 4, 3, (5, 40)


@pytest.fixture(scope="module")
def options_run(backend):
    """A fused fit with tol, record_every=3 and a callback every 4 steps, called with 5
    then 40 steps; the stepwise fit with the same tol and callback keeping every loss."""
    seen = {"fused": [], "stepwise": []}
    runs = {
        mode: build(
            backend,
            "perceptron",
            "adam",
            mode=mode,
            steps=40,
            tol=TOL,
            every=EVERY,
            record_every=RECORD_EVERY if mode == "fused" else 1,
            callback=lambda step, loss, mode=mode: seen[mode].append((step, float(loss))),
        )
        for mode in ("fused", "stepwise")
    }
    traces = {mode: [run(steps=n) for n in CALLS] for mode, run in runs.items()}
    return SimpleNamespace(
        fit=runs["fused"].fit,
        traces=traces["fused"],
        ref=traces["stepwise"],
        seen=seen["fused"],
        ref_seen=seen["stepwise"],
        at=snapshot(runs["fused"]),
        ref_at=snapshot(runs["stepwise"]),
    )


def test_tol_stops_at_the_stepwise_step_and_costs_only_those_steps(options_run):
    r = options_run
    assert_fused(r.fit)
    first, second = r.traces
    assert first.stop == Stop.STEPS and first.steps == CALLS[0]
    assert second.stop == r.ref[1].stop == Stop.TOL, (second, r.ref[1])
    assert second.steps == r.ref[1].steps, (second, r.ref[1])
    # where the stepwise losses first differ by <= tol: update i applied, then it stops
    met = np.nonzero(np.abs(np.diff(r.ref[1].loss.astype(np.float64))) <= TOL)[0]
    assert len(met) == 1 and second.steps == met[0] + 2, (met, r.ref[1].loss)
    assert 1 < second.steps < CALLS[1]
    assert r.at.step == r.ref_at.step == CALLS[0] + second.steps  # the converged call's cost
    assert_same_point(r.at, r.ref_at, what="after the converged call")


def test_record_every_keeps_every_kth_stepwise_loss(options_run):
    r = options_run
    assert_fused(r.fit)
    for got, full in zip(r.traces, r.ref):
        assert got.record_every == RECORD_EVERY and got.steps == full.steps
        assert len(full.loss) == full.steps  # nothing refused: one loss per applied step
        assert len(got.loss) == -(-full.steps // RECORD_EVERY)
        np.testing.assert_array_equal(got.index, np.arange(len(got.loss)) * RECORD_EVERY)
        assert_close(got.loss, full.loss[::RECORD_EVERY], what="recorded losses")


def test_callback_fires_at_the_stepwise_steps_and_losses_across_calls(options_run):
    r = options_run
    assert_fused(r.fit)
    total = r.at.step
    steps = [s for s, _ in r.seen]
    assert steps == [s for s, _ in r.ref_seen] == list(range(EVERY, total + 1, EVERY))
    assert CALLS[0] % EVERY and any(s > CALLS[0] for s in steps)  # numbering across calls
    assert_close([v for _, v in r.seen], [v for _, v in r.ref_seen], what="callback losses")
    # the loss handed over is the one before the notified update (recorded or not)
    full = concat(r.ref)
    assert_close([v for _, v in r.ref_seen], full[np.array(steps) - 1], what="stepwise losses")


# -- NONFINITE at step k ------------------------------------------------------------------------

DIVERGING = ("perceptron", "diverging")  # SGD lr=1e37, momentum 0.9: refused at step 4


@pytest.fixture(scope="module")
def nonfinite(backend):
    """One fused call of up to 10 steps that meets a non-finite update at step k; the
    stepwise fit's call; a stepwise fit (and, for `BITWISE_FUSED`, a fused fit) run for
    exactly k steps."""
    fused = build(backend, *DIVERGING, steps=10)
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        out = SimpleNamespace(fit=fused.fit, trace=fused())
    out.at = snapshot(fused)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        out.again = fused(steps=5)  # starts finite, refuses the same update again
    out.stuck = [
        [str(w.message) for w in ws if "applied no update" in str(w.message)]
        for ws in (first, again)
    ]
    out.at_again = snapshot(fused)
    ref = build(backend, *DIVERGING, mode="stepwise", steps=10)
    out.ref = ref()
    out.k = k = out.ref.steps
    exact = build(backend, *DIVERGING, mode="stepwise", steps=10)
    out.exact_trace = exact(steps=k)
    out.exact = snapshot(exact)
    if backend in BITWISE_FUSED:
        exact_fused = build(backend, *DIVERGING, steps=10)
        out.exact_fused_trace, out.exact_fused_fit = exact_fused(steps=k), exact_fused.fit
        out.exact_fused = snapshot(exact_fused)
    return out


def test_nonfinite_stops_at_step_k_with_the_state_of_k_steps(nonfinite, backend):
    r = nonfinite
    assert_fused(r.fit)
    assert r.ref.stop == Stop.NONFINITE and 1 < r.k < 10, r.ref
    assert r.trace.stop == Stop.NONFINITE and r.trace.steps == r.k, r.trace
    assert len(r.trace.loss) == r.k + 1  # the refused point's loss is kept
    assert_close(r.trace.loss[: r.k], r.ref.loss[: r.k], what="losses")
    assert r.exact_trace.stop == Stop.STEPS and r.exact_trace.steps == r.k
    assert_same_point(r.at, r.exact, what=f"after the refusal at step {r.k}")
    assert all(np.all(np.isfinite(a)) for a in r.at.params + r.at.opt_state)
    if backend in BITWISE_FUSED:
        assert_fused(r.exact_fused_fit)
        assert r.exact_fused_trace.stop == Stop.STEPS
        assert_same_point(r.at, r.exact_fused, rtol=0, atol=0, what="against k fused steps")


def test_a_call_after_a_refusal_refuses_the_same_update_again(nonfinite):
    r = nonfinite
    assert_fused(r.fit)
    assert r.again.stop == Stop.NONFINITE and r.again.steps == 0, r.again
    assert_same_point(r.at_again, r.at, rtol=0, atol=0, what="after the second call")
    # a call that applied nothing says so (the first applied k updates: it says nothing)
    first, again = r.stuck
    assert not first and len(again) == 1, r.stuck
    assert f"at the fit's step {r.k}, was refused" in again[0], again


@pytest.fixture(scope="module")
def raised(backend):
    """``on_nonfinite="raise"``: calls of 3 steps until one raises."""
    run = build(backend, *DIVERGING, steps=3, on_nonfinite="raise")
    out = SimpleNamespace(fit=run.fit, calls=0, error=None)
    for _ in range(10):
        try:
            run()
        except NonFiniteError as err:
            out.error = err
            break
        out.calls += 1
    out.at = snapshot(run)
    return out


def test_on_nonfinite_raise_names_the_global_step_and_keeps_its_state(raised, nonfinite):
    r, k = raised, nonfinite.k
    assert_fused(r.fit)
    assert r.error is not None, f"no NonFiniteError in {r.calls} calls"
    assert r.calls == k // 3  # the call holding step k raised
    assert r.error.step == k and f"step {k}" in str(r.error)
    assert r.error.trace.stop == Stop.NONFINITE and r.error.trace.steps == k - 3 * r.calls
    assert_same_point(r.at, nonfinite.exact, what=f"after the raise at step {k}")


# -- the shared option errors -------------------------------------------------------------------

BAD_OPTIONS = {
    "steps": (dict(steps=0), 0),
    "tol": (dict(steps=3, tol=-1.0), -1.0),
    "record_every": (dict(steps=3, record_every=0), 0),
    "every": (dict(steps=3, every=5), 5),  # without callback
    "on_nonfinite": (dict(steps=3, on_nonfinite="x"), "x"),
    "mode": (dict(steps=3, mode="x"), "x"),
}


@pytest.mark.parametrize("name", BAD_OPTIONS)
def test_bad_option_raises_a_value_error_naming_it_before_anything_is_built(backend, name):
    options, value = BAD_OPTIONS[name]
    run, error = attempt(backend, "perceptron", "sgd", **options)
    assert type(error) is ValueError, f"{type(error).__name__}: {error}"
    message = str(error)
    assert f"`{name}`" in message and repr(value) in message, message
    assert run.loss_calls == 0  # loss_fn was neither called nor traced
    if backend == "tf1":  # no op was added to the graph
        assert len(run.graph.get_operations()) == run.ops_before_fuse
    if backend == "torch":
        assert_close([p.detach() for p in run.model.parameters()], [np.ones((2, 2)), np.zeros(2)])
