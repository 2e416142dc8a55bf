"""Evaluation inside the TF2 loop (`stepfuse.tf._eval`): ``eval_fn`` fused (with and without
XLA) == stepwise == the plain Keras loop (GradientTape + ``apply_gradients``) that evaluates
at the same global steps, over calls whose lengths do not line up with ``eval_every``; a
scalar and a dict ``eval_fn``; ``Epochs``, ``Batches`` and ``tf.data`` input; ``tol`` and a
refused update mid-call; a callback (the outer loop's launches); no retrace for new
``eval_batch`` values; a BatchNormalization model trained exactly as without evaluation;
bad input refused by name with nothing changed. The guide's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import stepfuse as sf
import stepfuse.tf as sft
from stepfuse import Stop

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "tf.md"
RTOL, ATOL = 1e-6, 1e-7

RNG = np.random.default_rng(4)
X = RNG.normal(size=(40, 3)).astype("float32")
Y = RNG.normal(size=(40,)).astype("float32")
XV = RNG.normal(size=(16, 3)).astype("float32")  # the held-out set
YV = RNG.normal(size=(16,)).astype("float32")
XS = RNG.normal(size=(14, 8, 3)).astype("float32")  # stacked minibatches
YS = RNG.normal(size=(14, 8)).astype("float32")
W0 = [
    (RNG.normal(size=(3, 4)) * 0.5).astype("float32"),
    np.zeros(4, "float32"),
    (RNG.normal(size=(4, 1)) * 0.5).astype("float32"),
    np.zeros(1, "float32"),
]
CALLS = (3, 3, 5)  # 11 updates in calls that do not line up with eval_every=4


def _model() -> Any:
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, "tanh"), keras.layers.Dense(1)]
    )
    model.set_weights(W0)
    return model


def _loss_of(model: Any) -> Any:
    def loss_fn(xb: Any, yb: Any) -> Any:
        return tf.reduce_mean((model(xb)[:, 0] - yb) ** 2)

    return loss_fn


def _eval_of(model: Any, kind: str) -> Any:
    def eval_dict(xv: Any, yv: Any) -> dict:
        err = model(xv)[:, 0] - yv
        return {
            "mse": tf.reduce_mean(err**2),
            "mae": tf.reduce_mean(tf.abs(err)),
            "hits": tf.reduce_sum(tf.cast(err < 0, tf.int32)),
        }

    def eval_scalar(xv: Any, yv: Any) -> Any:
        return tf.reduce_mean(tf.abs(model(xv)[:, 0] - yv))

    return eval_dict if kind == "dict" else eval_scalar


def make(kind: str = "dict", steps: int = 5, **options: Any) -> tuple[Any, Any]:
    model = _model()
    options.setdefault("eval_every", 4)
    fit = sft.fuse(
        _loss_of(model),
        keras.optimizers.Adam(1e-2),
        model,
        steps=steps,
        eval_fn=_eval_of(model, kind),
        **options,
    )
    return fit, model


def plain(
    batches: list,
    kind: str,
    eval_every: int,
    eval_batch: tuple = (XV, YV),
    model: Any = None,
    opt: Any = None,
    start: int = 0,
) -> dict:
    """The plain Keras loop over ``batches`` from global step ``start``: after each applied
    update that brings the step count to a multiple of ``eval_every`` it evaluates. It
    stops at a non-finite loss (that update not applied)."""
    model = model or _model()
    opt = opt or keras.optimizers.Adam(1e-2)
    loss_fn, eval_fn = _loss_of(model), _eval_of(model, kind)
    out: dict[str, Any] = {"losses": [], "eval_step": [], "values": {}}
    t = start
    for b in batches:
        with tf.GradientTape() as tape:
            loss = loss_fn(*b)
        out["losses"].append(float(loss))
        if not np.isfinite(float(loss)):
            break
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        t += 1
        if t % eval_every == 0:
            values = eval_fn(*eval_batch)
            values = values if isinstance(values, dict) else {"value": values}
            out["eval_step"].append(t)
            for k, v in values.items():
                out["values"].setdefault(k, []).append(v.numpy())
    out.update(model=model, opt=opt, step=t)
    return out


def close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def collect(traces: list) -> tuple[np.ndarray, dict]:
    steps = np.concatenate([t.eval.step for t in traces])
    names = list(traces[-1].eval.values)
    return steps, {k: np.concatenate([t.eval[k] for t in traces]) for k in names}


def agree(runs: dict, ref: dict) -> None:
    """Runs (``(fit, model, traces)``) evaluate where the plain loop does, with its values,
    and train as it does."""
    for fit, model, traces in runs.values():
        steps, values = collect(traces)
        assert steps.dtype == np.int64
        np.testing.assert_array_equal(steps, ref["eval_step"])
        assert list(values) == list(ref["values"])
        for k in values:
            assert values[k].dtype == np.asarray(ref["values"][k]).dtype
            close(values[k], np.asarray(ref["values"][k]))
        close(np.concatenate([t.loss for t in traces]), np.float32(ref["losses"]))
        for a, b in zip(model.get_weights(), ref["model"].get_weights()):
            close(a, b)
        assert fit.step == ref["step"]


def run_calls(fit: Any, calls: tuple, *batch: Any, eval_batch: Any = (XV, YV)) -> list:
    return [fit(*batch, steps=n, eval_batch=eval_batch) for n in calls]


@pytest.mark.parametrize(
    "kind, jit_compile", [("dict", True), ("scalar", False)], ids=["dict-xla", "scalar"]
)
def test_calls_across_the_schedule_fused_equals_stepwise_and_plain(
    kind: str, jit_compile: bool
) -> None:
    runs = {}
    for mode in ("fused", "stepwise"):
        fit, model = make(kind, mode=mode, jit_compile=jit_compile)
        traces = run_calls(fit, CALLS, X, Y)
        assert [len(t.eval) for t in traces] == [0, 1, 1]  # steps 4 and 8 of 11
        assert fit.jit_compile is jit_compile and fit.compiles == (1 if mode == "fused" else 2)
        runs[mode] = (fit, model, traces)
    ref = plain([(X, Y)] * sum(CALLS), kind, 4)
    assert ref["eval_step"] == [4, 8]
    agree(runs, ref)
    if kind == "scalar":
        trace = runs["fused"][2][1]
        assert list(trace.eval.values) == ["value"] and trace.eval.value.shape == (1,)


def test_new_eval_batch_values_and_steps_do_not_retrace() -> None:
    fit, model = make("scalar", eval_every=2, jit_compile=False)
    fit(X, Y, eval_batch=(XV, YV))
    trace = fit(X, Y, steps=3, eval_batch=(XV + 1, YV))
    trace = fit(X, Y, steps=2, eval_batch=(XV + 1, YV))
    assert fit.compiles == 1
    np.testing.assert_array_equal(trace.eval.step, [10])
    close(trace.eval.value, [_eval_of(model, "scalar")(XV + 1, YV).numpy()])


def test_epochs_fused_equals_stepwise_and_plain() -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=5)  # 5 steps an epoch
    runs = {}
    for mode in ("fused", "stepwise"):
        fit, model = make(steps=7, eval_every=3, mode=mode, jit_compile=False)
        runs[mode] = (fit, model, run_calls(fit, (4, 7, 2), data))
    agree(runs, plain([data.batch(t) for t in range(13)], "dict", 3))


def test_tf_data_iterator_fused_equals_stepwise_and_plain() -> None:
    ds = tf.data.Dataset.from_tensor_slices((XS.reshape(-1, 3), YS.reshape(-1))).batch(8)
    runs = {}
    for mode in ("fused", "stepwise"):
        fit, model = make(steps=6, eval_every=4, mode=mode, jit_compile=False)
        it = iter(ds)
        runs[mode] = (fit, model, run_calls(fit, (3, 6, 4), it))
    agree(runs, plain([(XS[i], YS[i]) for i in range(13)], "dict", 4))


def test_refused_update_brings_no_evaluation_and_the_next_call_continues() -> None:
    """The update after an evaluation (step 4) is refused: no evaluation at step 4 again,
    also in a call that starts there and refuses it again; a call past it evaluates at the
    fit's multiples."""
    xs = XS.copy()
    xs[4, 0, 0] = np.nan
    runs = {}
    for mode in ("fused", "stepwise"):
        fit, model = make(steps=8, eval_every=2, mode=mode, jit_compile=mode == "fused")
        first = fit(sf.Batches(xs[:8], YS[:8]), eval_batch=(XV, YV))
        assert first.stop == Stop.NONFINITE and first.steps == 4 and fit.step == 4
        np.testing.assert_array_equal(first.eval.step, [2, 4])
        again = fit(sf.Batches(xs[4:12], YS[4:12]), eval_batch=(XV, YV))
        assert again.stop == Stop.NONFINITE and again.steps == 0 and len(again.eval) == 0
        second = fit(sf.Batches(xs[5:13], YS[5:13]), eval_batch=(XV, YV))
        np.testing.assert_array_equal(second.eval.step, [6, 8, 10, 12])
        runs[mode] = (fit, model, [first, again, second])
    ref = plain([(xs[i], YS[i]) for i in range(5)], "dict", 2)  # stops at the NaN
    ref2 = plain(
        [(xs[i], YS[i]) for i in range(5, 13)],
        "dict",
        2,
        model=ref["model"],
        opt=ref["opt"],
        start=ref["step"],
    )
    joined = {
        "losses": ref["losses"] + ref["losses"][-1:] + ref2["losses"],
        "eval_step": ref["eval_step"] + ref2["eval_step"],
        "values": {k: ref["values"][k] + ref2["values"][k] for k in ref["values"]},
        "model": ref2["model"],
        "step": ref2["step"],
    }
    agree(runs, joined)


def test_tol_stop_mid_call_evaluates_up_to_its_last_update() -> None:
    """SGD on a quadratic: consecutive losses differ less and less, so ``tol`` between two
    consecutive differences stops the call after its 9th update, an evaluation's step."""
    target = tf.constant(np.ones(3, "float32"))

    def build() -> tuple[Any, Any, Any]:
        w = tf.Variable(tf.zeros(3))
        return w, (lambda t: tf.reduce_sum((w - t) ** 2)), keras.optimizers.SGD(0.05)

    w, loss, opt = build()
    losses, evals = [], []
    for t in range(1, 13):
        with tf.GradientTape() as tape:
            value = loss(target)
        losses.append(float(value))
        opt.apply_gradients([(tape.gradient(value, w), w)])
        if t % 3 == 0:
            evals.append(float(loss(target)))
    d = np.abs(np.diff(np.float32(losses)))
    assert np.all(d[:-1] > d[1:])
    tol = float(np.sqrt(d[6] * d[7]))  # update i compares losses i, i - 1: stops at update 8
    for mode in ("fused", "stepwise"):
        w, loss, opt = build()
        fit = sft.fuse(
            loss,
            opt,
            [w],
            steps=12,
            tol=tol,
            eval_fn=loss,
            eval_every=3,
            mode=mode,
            jit_compile=False,
        )
        trace = fit(target, eval_batch=target)
        assert trace.stop == Stop.TOL and trace.steps == 9 and fit.step == 9
        np.testing.assert_array_equal(trace.eval.step, [3, 6, 9])
        close(trace.eval.value, evals[:3])


def test_callback_launches_gather_the_evaluations() -> None:
    """With a callback the loop runs one XLA launch per `every` steps in a graph loop; the
    evaluations of every launch reach the trace."""
    seen: dict[str, list] = {"fused": [], "stepwise": []}
    runs = {}
    for mode in ("fused", "stepwise"):
        fit, model = make(
            steps=7,
            eval_every=3,
            record_every=2,
            callback=lambda s, loss, m=mode: seen[m].append(s),
            every=2,
            mode=mode,
            jit_compile=mode == "fused",
        )
        runs[mode] = (fit, model, run_calls(fit, (5, 7), X, Y))
    assert seen["fused"] == seen["stepwise"] == [2, 4, 6, 8, 10, 12]
    ref = plain([(X, Y)] * 12, "dict", 3)
    for fit, model, traces in runs.values():
        assert fit.step == 12
        steps, values = collect(traces)
        np.testing.assert_array_equal(steps, [3, 6, 9, 12])
        for k in values:
            close(values[k], np.asarray(ref["values"][k]))
        close(traces[1].loss, np.float32(ref["losses"][5::2]))
        for a, b in zip(model.get_weights(), ref["model"].get_weights()):
            close(a, b)


def test_a_call_longer_than_a_launch_gathers_every_launchs_evaluations() -> None:
    """With ``eval_fn`` a launch runs at most 63 evaluations' steps here (252): a call of
    600 runs three launches in the graph loop, whose evaluations all reach the trace, as
    120 calls of 5 steps (one launch each) evaluate."""
    fit, model = make(steps=5, eval_every=4, jit_compile=False)
    assert fit._steps_per_launch == 252
    trace = fit(X, Y, steps=600, eval_batch=(XV, YV))
    assert fit.compiles == 1 and trace.steps == 600
    short, short_model = make(steps=5, eval_every=4, jit_compile=False)
    steps, values = collect(run_calls(short, (5,) * 120, X, Y))
    np.testing.assert_array_equal(trace.eval.step, np.arange(4, 601, 4))
    np.testing.assert_array_equal(trace.eval.step, steps)
    for k in values:
        np.testing.assert_array_equal(trace.eval[k], values[k])
    for a, b in zip(model.get_weights(), short_model.get_weights()):
        np.testing.assert_array_equal(a, b)


def _bn_fit(eval_fn: bool) -> tuple[Any, Any]:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )

    def loss_fn(xb: Any, yb: Any) -> Any:
        return tf.reduce_mean((model(xb, training=True)[:, 0] - yb) ** 2)

    def evaluate(xv: Any, yv: Any) -> Any:
        return tf.reduce_mean((model(xv, training=False)[:, 0] - yv) ** 2)

    kw = {"eval_fn": evaluate, "eval_every": 1} if eval_fn else {}
    fit = sft.fuse(loss_fn, keras.optimizers.Adam(1e-2), model, steps=6, jit_compile=False, **kw)
    return fit, model


def test_evaluation_changes_no_state_batchnorm_statistics_included() -> None:
    with_eval, m1 = _bn_fit(True)
    without, m2 = _bn_fit(False)
    a = [with_eval(X, Y, steps=n, eval_batch=(XV, YV)) for n in (4, 6)]
    b = [without(X, Y, steps=n) for n in (4, 6)]
    assert [len(t.eval) for t in a] == [4, 6] and b[0].eval is None
    assert len(m1.non_trainable_variables) == 2  # the moving mean and variance
    for ta, tb in zip(a, b):
        np.testing.assert_array_equal(ta.loss, tb.loss)
    for u, v in zip(m1.get_weights(), m2.get_weights()):  # the statistics too
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_bad_input_is_refused_by_name_with_nothing_changed(mode: str) -> None:
    model = _model()
    plain_fit = sft.fuse(_loss_of(model), keras.optimizers.SGD(0.1), model, steps=3, mode=mode)
    with pytest.raises(ValueError, match="`eval_batch`"):
        plain_fit(X, Y, eval_batch=(XV, YV))
    bad = {
        "vector": (lambda xv, yv: model(xv)[:, 0] - yv, TypeError, r"`eval_fn`.*scalar"),
        "empty": (lambda xv, yv: {}, TypeError, r"`eval_fn`.*non-empty dict"),
        "dict of vectors": (lambda xv, yv: {"e": model(xv)}, TypeError, r"`eval_fn`.*'e'"),
        "fails to trace": (lambda xv: model(xv), TypeError, r"`eval_fn\(\*eval_batch\)`"),
        "numpy": (lambda xv, yv: model(xv).numpy().sum(), TypeError, r"`eval_fn`.*numpy"),
    }
    fits = [plain_fit]
    for eval_fn, exc, match in bad.values():
        fit = sft.fuse(
            _loss_of(model), keras.optimizers.SGD(0.1), model, steps=3, eval_fn=eval_fn, mode=mode
        )
        with pytest.raises(exc, match=match):
            fit(X, Y, eval_batch=(XV, YV))
        fits.append(fit)
    for fit in fits:
        assert fit.step == 0
    for a, b in zip(model.get_weights(), W0):
        np.testing.assert_array_equal(a, b)


def test_guide_example_runs() -> None:
    blocks = [
        b
        for b in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
        if "eval_fn" in b
    ]
    assert len(blocks) == 1
    scope: dict[str, Any] = {}
    exec(compile(blocks[0], str(GUIDE), "exec"), scope)
    assert len(scope["trace"].eval) >= 1
