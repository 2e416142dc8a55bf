"""The shared core: option checks, Trace, Stop, the stepwise driver."""

import math

import numpy as np
import pytest

import stepfuse
from stepfuse import Stop, Trace
from stepfuse._core import check_call_steps, check_options, host_trace, run_stepwise
from stepfuse._core.evaluation import check_eval_batch, eval_values


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True, None])
def test_steps_rejected_with_name_value_and_fix(bad):
    with pytest.raises((TypeError, ValueError)) as err:
        check_options(steps=bad)
    msg = str(err.value)
    assert "`steps`" in msg and repr(bad) in msg and "e.g. steps=" in msg


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"record_every": 0}, "record_every"),
        ({"record_every": 1.5}, "record_every"),
        ({"tol": -1e-3}, "tol"),
        ({"tol": float("nan")}, "tol"),
        ({"tol": "1e-3"}, "tol"),
        ({"callback": 3}, "callback"),
        ({"every": 10}, "every"),
        ({"callback": print, "every": 0}, "every"),
        ({"on_nonfinite": "ignore"}, "on_nonfinite"),
        ({"mode": "fast"}, "mode"),
        ({"progress": 1}, "progress"),
    ],
)
def test_option_rejected_names_the_argument(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
        check_options(steps=3, **kwargs)


def test_call_steps_capped_backend_rejects_more_than_built():
    opts = check_options(steps=5)
    assert check_call_steps(None, opts, capped=True) == 5
    assert check_call_steps(np.int64(2), opts, capped=True) == 2
    with pytest.raises(ValueError, match="fuse\\(..., steps=6\\)"):
        check_call_steps(6, opts, capped=True)
    assert check_call_steps(6, opts, capped=False) == 6


def test_every_defaults_to_about_100_notifications_per_call():
    assert check_options(steps=10_000, callback=print).every == 100
    assert check_options(steps=10, progress=True).every == 1


def test_stop_is_an_int_enum_with_messages():
    assert Stop.NONFINITE == 2 and Stop(1) is Stop.TOL
    assert "tol" in Stop.TOL.message
    assert stepfuse.Stop is Stop and stepfuse.Trace is Trace


def test_host_trace_keeps_the_refused_loss_after_nonfinite():
    t = host_trace(np.arange(10.0), steps=4, stop=Stop.NONFINITE, record_every=1)
    assert t.steps == 4 and t.stop is Stop.NONFINITE and list(t.loss) == [0, 1, 2, 3, 4]
    t = host_trace(np.arange(10.0), steps=7, stop=Stop.STEPS, record_every=3)
    assert list(t.loss) == [0, 1, 2] and list(t.index) == [0, 3, 6]


class _Quadratic:
    """x <- x - lr * 2x on f(x) = x^2, as a propose/commit pair."""

    def __init__(self, x, lr):
        self.x, self.lr = x, lr

    def propose(self):
        loss = self.x * self.x
        new = self.x - self.lr * 2 * self.x
        return loss, math.isfinite(loss) and math.isfinite(new), new

    def commit(self, new):
        self.x = new


def test_stepwise_driver_runs_all_steps_and_records_before_each_update():
    q = _Quadratic(1.0, 0.25)
    t = run_stepwise(q.propose, q.commit, 4, check_options(steps=4), 0)
    assert t.stop is Stop.STEPS and t.steps == 4
    np.testing.assert_allclose(t.loss, [1.0, 0.25, 0.0625, 0.015625])
    assert q.x == 0.5**4


def test_stepwise_driver_tol_applies_the_converged_update_then_stops():
    q = _Quadratic(1.0, 0.5)  # jumps to 0 at once: losses 1, 0, 0, ...
    t = run_stepwise(q.propose, q.commit, 10, check_options(steps=10, tol=0.0), 0)
    assert t.stop is Stop.TOL and t.steps == 3 and len(t.loss) == 3


def test_stepwise_driver_nonfinite_keeps_last_finite_state():
    q = _Quadratic(1.0, -1e154)  # grows until x*x overflows
    t = run_stepwise(q.propose, q.commit, 10, check_options(steps=10), 0)
    assert t.stop is Stop.NONFINITE and t.steps == 1 and math.isfinite(q.x)
    assert len(t.loss) == t.steps + 1 and math.isinf(t.loss[-1])


def test_stepwise_driver_notifies_on_global_step_multiples():
    seen = []
    q = _Quadratic(1.0, 0.1)
    opts = check_options(steps=10, callback=lambda s, l: seen.append(s), every=4)
    run_stepwise(q.propose, q.commit, 10, opts, 2, notify=lambda s, l: seen.append(s))
    assert seen == [4, 8, 12]


def test_deferred_interrupts_holds_ctrl_c_until_the_block_is_done():
    import os
    import signal

    from stepfuse._core import deferred_interrupts

    # Python's own handler, whatever this process was started with (a background job or
    # nohup starts with SIGINT ignored).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        done = []
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("finished the block first")
        assert done == ["finished the block first"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the one before
    finally:
        signal.signal(signal.SIGINT, before)


def test_deferred_interrupts_keeps_an_ignored_ctrl_c_ignored():
    import os
    import signal

    from stepfuse._core import deferred_interrupts

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        done = []
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("finished the block")
        assert done == ["finished the block"]  # and nothing raised: it was ignored before
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_notifier_watch_updates_the_bar_from_a_thread_and_shows_the_last_value():
    import threading
    import time

    from stepfuse._core import Notifier

    opts = check_options(steps=100, progress=True, every=10)
    published = [math.nan, math.nan]  # what a fused loop writes: (step, loss)
    seen_during = threading.Event()
    with Notifier(opts, 5, 100) as notifier:
        bar = notifier._bar
        notifier.watch(lambda: tuple(published), interval=0.01)
        notifier.watch(lambda: (0.0, 0.0))  # a second watch is ignored
        published[:] = [45.0, 0.25]
        for _ in range(500):
            if bar.tasks[0].completed == 40:
                seen_during.set()
                break
            time.sleep(0.01)
        published[:] = [105.0, 0.125]  # the end of the call: shown once the block exits
    assert seen_during.is_set()
    assert bar.tasks[0].completed == 100 and bar.tasks[0].fields["loss"] == 0.125
    # Nothing draws the bar once the block has ended, and the next call's bar is drawn
    # by the same thread (one drawing thread, kept between calls).
    drawers = [t for t in threading.enumerate() if t.name == "stepfuse-progress"]
    published[:] = [150.0, 0.5]  # would show 145 if anything still drew it
    time.sleep(0.1)
    assert bar.tasks[0].completed == 100 and bar.tasks[0].fields["loss"] == 0.125
    with Notifier(opts, 0, 100) as again:
        again.watch(lambda: (30.0, 0.5), interval=0.01)
        for _ in range(500):
            if again._bar.tasks[0].completed == 30:
                break
            time.sleep(0.01)
    assert again._bar.tasks[0].completed == 30
    assert [t for t in threading.enumerate() if t.name == "stepfuse-progress"] == drawers
    assert len(drawers) == 1


def test_notifier_calls_back_at_once_draws_the_latest_pair_and_never_moves_back():

    from stepfuse._core import Notifier

    seen = []
    opts = check_options(
        steps=100, progress=True, every=10, callback=lambda s, l: seen.append((s, l))
    )
    with Notifier(opts, 5, 100) as notifier:
        bar = notifier._bar
        for step in (15, 25, 35):
            notifier(step, step / 100)
        assert seen == [(15, 0.15), (25, 0.25), (35, 0.35)]  # the callback, synchronously
        notifier.done(100)  # the call applied 100 updates; the last notification was at 35
    assert bar.tasks[0].completed == 100 and bar.tasks[0].fields["loss"] == 0.35
    with Notifier(opts, 5, 100) as notifier:
        bar = notifier._bar
        notifier(15, 0.15)
        notifier.done(100, 0.75)  # the backend knows the loss before the last update
    assert bar.tasks[0].completed == 100 and bar.tasks[0].fields["loss"] == 0.75


def test_bench_harness_interleaves_rounds_until_each_contender_had_min_seconds():
    import time

    from stepfuse.bench._timing import measure

    calls = {"a": [], "b": []}

    def builder(name):
        def build():
            def run(n):
                calls[name].append(n)
                time.sleep(0.004)  # a sample (>= 20 ms) is at most 5 calls

            return run

        return build

    def timed(**kw):
        calls["a"].clear(), calls["b"].clear()
        t0 = time.perf_counter()
        rows = measure(
            {"a": builder("a"), "b": builder("b")},
            4,
            backend="x",
            problem="p",
            reference="a",
            repeats=2,
            steps_for={"b": 2},
            **kw,
        )
        took = time.perf_counter() - t0
        return {r.contender: r for r in rows}, len(calls["a"]) - 1, len(calls["b"]) - 1, took

    by, a, b, _ = timed(min_seconds=0.0)
    assert calls["a"][0] == 4 and set(calls["b"]) == {2}  # warm-up, then the steps asked for
    assert by["a"].ratio == 1.0 and by["b"].n == 4 and by["b"].steps == 2
    assert a <= 2 * 5 and b <= 2 * 5  # `repeats` rounds
    _, a, b, took = timed(min_seconds=0.3)
    assert took >= 2 * 0.3 and a > 2 and b > 2  # rounds went on until each was timed 0.3 s
    _, a, b, _ = timed(min_seconds=100.0, max_rounds=3)
    assert a <= 3 * 5 and b <= 3 * 5  # three rounds at most, not 100 s


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: stepfuse.Batches([[1.0, 2.0]], np.ones((1, 2))),
            r"`Batches\(\*arrays\)\[0\]` must be an array .*; got a list \(list\)\.",
        ),
        (lambda: stepfuse.Batches.from_iterable(5, 2), r"`iterable` must be .*got an int \(int\)"),
        (
            lambda: check_eval_batch((np.ones(2),), None),
            r"`eval_batch` must be passed only .*; got a tuple \(tuple\)\.",
        ),
        (lambda: eval_values(np.ones(3)), r"got a value of shape \(3,\) \(ndarray\)\."),
        (
            lambda: eval_values({"acc": np.ones(3)}),
            r"got a dict whose 'acc' is of shape \(3,\) \(dict\)\.",
        ),
    ],
)
def test_a_value_described_in_an_error_names_its_own_type(make, match):
    """A large or structured value is described, and "(type)" is its type, not ``str``."""
    with pytest.raises((TypeError, ValueError), match=match) as e:
        make()
    assert "(str)" not in str(e.value)
