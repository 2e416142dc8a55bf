"""The shared evaluation semantics: option checks, what ``eval_fn`` may return, the global
schedule and the stepwise reference's evaluations."""

import numpy as np
import pytest

import stepfuse
from stepfuse._core import check_eval_batch, check_options, eval_due, eval_values, run_stepwise
from stepfuse._core.evaluation import SCALAR, EvalTrace, host_evals


@pytest.mark.parametrize(
    "kwargs, name, exc",
    [
        ({"eval_every": 5}, "eval_every", ValueError),
        ({"eval_fn": 3}, "eval_fn", TypeError),
        ({"eval_fn": print, "eval_every": 0}, "eval_every", ValueError),
        ({"eval_fn": print, "eval_every": 2.0}, "eval_every", TypeError),
        ({"eval_fn": print, "eval_every": True}, "eval_every", TypeError),
    ],
)
def test_eval_options_rejected_by_name(kwargs, name, exc):
    with pytest.raises(exc, match=f"`{name}`"):
        check_options(steps=10, **kwargs)


def test_eval_every_defaults_to_steps():
    opts = check_options(steps=7, eval_fn=print)
    assert opts.eval_every == 7 and opts.eval_capacity == 1
    opts = check_options(steps=10, eval_fn=print, eval_every=3)
    assert opts.eval_capacity == 4  # e.g. step counts 2..11 hold 3, 6, 9 (and 0..9 four)
    assert check_options(steps=10).eval_capacity == 0


def test_eval_batch_forms():
    assert check_eval_batch(None, print) == ()
    assert check_eval_batch((1, 2), print) == (1, 2)
    x = np.zeros(3)
    assert check_eval_batch(x, print)[0] is x
    with pytest.raises(ValueError, match="`eval_batch`"):
        check_eval_batch((x,), None)


def test_eval_values_scalar_and_dict():
    assert eval_values(np.float32(2.0)) == {SCALAR: np.float32(2.0)}
    assert list(eval_values({"loss": 1.0, "acc": np.float32(0.5)})) == ["loss", "acc"]
    for bad in ({}, {"a": np.zeros(2)}, {1: 2.0}, np.zeros(3), "x", [1.0]):
        with pytest.raises(TypeError, match="`eval_fn`"):
            eval_values(bad)


def test_eval_due_is_the_global_schedule():
    assert [s for s in range(1, 13) if eval_due(s, 4)] == [4, 8, 12]
    assert eval_due(np.int64(6), 3) and not eval_due(np.int64(7), 3)


def _counter_fit(eval_every, tol=None):
    """A stepwise 'fit' of w -> w/2 whose loss is w; evaluation returns w and a count."""
    opts = check_options(steps=10, eval_fn=print, eval_every=eval_every, tol=tol)
    st = {"w": 1.0}

    def propose():
        w = st["w"]
        return np.float32(w), np.isfinite(w), w / 2

    def commit(token):
        st["w"] = token

    def evaluate():
        return {"w": np.float32(st["w"]), "n": np.int64(7)}

    return opts, st, propose, commit, evaluate


def test_stepwise_evaluates_at_global_multiples_across_calls():
    opts, st, propose, commit, evaluate = _counter_fit(eval_every=4)
    start, steps, ws = 0, [], []
    for n in (3, 3, 5, 1):  # 12 updates in calls that do not line up with eval_every
        trace = run_stepwise(propose, commit, n, opts, start, evaluate=evaluate)
        start += trace.steps
        steps += list(trace.eval.step)
        ws += list(trace.eval["w"])
        if len(trace.eval):
            assert trace.eval["w"].dtype == np.float32 and trace.eval["n"].dtype == np.int64
    assert steps == [4, 8, 12]
    np.testing.assert_array_equal(ws, np.float32([0.5**4, 0.5**8, 0.5**12]))


def test_stepwise_evaluates_nothing_after_a_refused_update():
    opts = check_options(steps=10, eval_fn=print, eval_every=1)
    st = {"i": 0}

    def propose():
        bad = st["i"] == 2
        return np.float32(np.nan if bad else 1.0), not bad, None

    def commit(token):
        st["i"] += 1

    trace = run_stepwise(propose, commit, 10, opts, 0, evaluate=lambda: np.float32(st["i"]))
    assert trace.stop == stepfuse.Stop.NONFINITE and trace.steps == 2
    np.testing.assert_array_equal(trace.eval.step, [1, 2])
    np.testing.assert_array_equal(trace.eval.value, np.float32([1, 2]))


def test_eval_trace_access():
    ev = host_evals([5, 10, -1], {"acc": np.float32([0.5, 0.75, np.nan])}, 2)
    assert len(ev) == 2 and list(ev) == ["acc"]
    np.testing.assert_array_equal(ev["acc"], np.float32([0.5, 0.75]))
    with pytest.raises(KeyError, match="'loss'"):
        _ = ev["loss"]
    with pytest.raises(KeyError):
        _ = ev.value
    empty = EvalTrace(np.zeros(0, np.int64), {})
    assert len(empty) == 0 and empty["anything"].shape == (0,)
    assert "evaluations=2" in repr(stepfuse.Trace([1.0], 1, stepfuse.Stop.STEPS, 1, ev))
