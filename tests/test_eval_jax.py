"""Evaluation inside the JAX loop (`stepfuse.jax._eval`): ``eval_fn`` fused == stepwise ==
the plain optax loop (``optax.update`` per step) that evaluates at the same global steps,
over calls whose lengths do not line up with ``eval_every``; a scalar and a dict
``eval_fn``; ``Epochs`` data; ``tol`` and a refused update mid-call; callbacks,
``record_every`` and ``has_state``; ``jax.jit``, ``jax.vmap`` over several models and
``jax.grad``; one compiled program whose steps' loop is the one a fit without ``eval_fn``
runs; bad input refused by name. The guide's example runs as written."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ATOL, RTOL, assert_fused

import stepfuse as sf
import stepfuse.jax as sfj
from stepfuse import NonFiniteError, Stop

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "jax.md"

RNG = np.random.default_rng(3)
X = RNG.normal(size=(40, 3)).astype("float32")
Y = RNG.normal(size=(40,)).astype("float32")
XV = RNG.normal(size=(16, 3)).astype("float32")  # the held-out set
YV = RNG.normal(size=(16,)).astype("float32")
XS = RNG.normal(size=(14, 8, 3)).astype("float32")  # stacked minibatches
YS = RNG.normal(size=(14, 8)).astype("float32")
P0 = {
    "w": jnp.asarray(RNG.normal(size=(3, 6)) * 0.5, jnp.float32),
    "v": jnp.asarray(RNG.normal(size=(6,)) * 0.5, jnp.float32),
}
CALLS = (3, 3, 5)  # 11 updates in calls that do not line up with eval_every=4


def predict(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w"]) @ p["v"]


def loss_fn(p: Any, x: Any, y: Any) -> Any:
    return jnp.mean((predict(p, x) - y) ** 2)


def eval_dict(p: Any, x: Any, y: Any) -> dict:
    err = predict(p, x) - y
    return {"mse": jnp.mean(err**2), "mae": jnp.mean(jnp.abs(err)), "hits": jnp.sum(err < 0)}


def eval_scalar(p: Any, x: Any, y: Any) -> Any:
    return jnp.mean(jnp.abs(predict(p, x) - y))


def plain(
    batches: list,
    eval_fn: Any,
    eval_every: int,
    eval_batch: tuple = (XV, YV),
    params: Any = P0,
    opt_state: Any = None,
    start: int = 0,
    tx: Any = None,
    loss: Any = loss_fn,
) -> dict:
    """The plain optax loop over ``batches`` (each a step's arguments), from global step
    ``start``: after each applied update that brings the step count to a multiple of
    ``eval_every`` it evaluates ``eval_fn``. It stops at a non-finite loss (that update not
    applied). Returns losses, params, opt_state, step and the evaluations' steps and values."""
    tx = tx or optax.adam(1e-2)
    opt_state = tx.init(params) if opt_state is None else opt_state

    @jax.jit
    def step(p: Any, s: Any, *args: Any) -> tuple:
        value, grads = jax.value_and_grad(loss)(p, *args)
        updates, s = tx.update(grads, s, p)
        return value, optax.apply_updates(p, updates), s

    evaluate = jax.jit(eval_fn)
    out: dict[str, Any] = {"losses": [], "eval_step": [], "values": {}}
    t = start
    for args in batches:
        value, new_p, new_s = step(params, opt_state, *args)
        out["losses"].append(float(value))
        if not np.isfinite(float(value)):
            break
        params, opt_state, t = new_p, new_s, t + 1
        if t % eval_every == 0:
            values = evaluate(params, *eval_batch)
            values = values if isinstance(values, dict) else {"value": values}
            out["eval_step"].append(t)
            for k, v in values.items():
                out["values"].setdefault(k, []).append(np.asarray(v))
    out.update(params=params, opt_state=opt_state, step=t)
    return out


def close(a: Any, b: Any) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=RTOL, atol=ATOL)


def collect(traces: list) -> tuple[np.ndarray, dict]:
    """The evaluations of several calls, joined: (steps, values by name)."""
    steps = np.concatenate([t.eval.step for t in traces])
    names = next(list(t.eval.values) for t in traces if len(t.eval))
    return steps, {k: np.concatenate([t.eval[k] for t in traces]) for k in names}


def run_calls(fit: Any, calls: tuple, *batch: Any, state: Any = None, **kw: Any) -> tuple:
    state = fit.init(P0) if state is None else state
    traces = []
    for n in calls:
        state, trace = fit(state, *batch, steps=n, eval_batch=(XV, YV), **kw)
        traces.append(trace)
    return state, traces


def agree(runs: dict, ref: dict) -> None:
    """Fused and stepwise runs (``(state, traces)``) evaluate where the plain loop does,
    with its values, and train as it does."""
    for state, traces in runs.values():
        steps, values = collect(traces)
        assert steps.dtype == np.int64
        np.testing.assert_array_equal(steps, ref["eval_step"])
        assert list(values) == list(ref["values"])
        for k in values:
            assert values[k].dtype == np.asarray(ref["values"][k]).dtype
            close(values[k], np.asarray(ref["values"][k]))
        close(np.concatenate([t.loss for t in traces]), np.float32(ref["losses"]))
        close(state.params, ref["params"])
        assert int(state.step) == ref["step"]


@pytest.mark.parametrize("eval_fn", [eval_dict, eval_scalar], ids=["dict", "scalar"])
def test_calls_across_the_schedule_fused_equals_stepwise_and_plain(eval_fn: Any) -> None:
    runs = {}
    for mode in ("fused", "stepwise"):
        fit = sfj.fuse(loss_fn, optax.adam(1e-2), steps=5, eval_fn=eval_fn, eval_every=4, mode=mode)
        runs[mode] = run_calls(fit, CALLS, X, Y)
        assert [len(t.eval) for t in runs[mode][1]] == [0, 1, 1]  # steps 4 and 8 of 11
        if mode == "fused":
            assert_fused(fit)
            assert fit.compiles == 1  # every steps=n and eval_batch: one program
    ref = plain([(X, Y)] * sum(CALLS), eval_fn, 4)
    assert ref["eval_step"] == [4, 8]
    agree(runs, ref)
    if eval_fn is eval_scalar:
        assert list(runs["fused"][1][1].eval.values) == ["value"]
        np.testing.assert_array_equal(
            runs["fused"][1][1].eval.value, runs["fused"][1][1].eval["value"]
        )


def test_split_calls_evaluate_as_one_call_bit_for_bit() -> None:
    fit = sfj.fuse(loss_fn, optax.adam(1e-2), steps=11, eval_fn=eval_dict, eval_every=2)
    _, one = run_calls(fit, (11,), X, Y)
    _, split = run_calls(fit, CALLS, X, Y)
    a, b = collect(one), collect(split)
    np.testing.assert_array_equal(a[0], [2, 4, 6, 8, 10])
    np.testing.assert_array_equal(b[0], a[0])
    for k in a[1]:
        np.testing.assert_array_equal(b[1][k], a[1][k])


def test_a_fit_with_eval_fn_trains_exactly_as_one_without() -> None:
    with_eval = sfj.fuse(loss_fn, optax.adam(1e-2), steps=6, eval_fn=eval_dict, eval_every=1)
    without = sfj.fuse(loss_fn, optax.adam(1e-2), steps=6)
    s1, t1 = with_eval(with_eval.init(P0), X, Y, eval_batch=(XV, YV))
    s2, t2 = without(without.init(P0), X, Y)
    assert len(t1.eval) == 6 and t2.eval is None
    np.testing.assert_array_equal(t1.loss, t2.loss)
    for a, b in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(s2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_epochs_fused_equals_stepwise_and_plain() -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=5)  # 5 steps an epoch
    runs = {}
    for mode in ("fused", "stepwise"):
        fit = sfj.fuse(
            loss_fn, optax.adam(1e-2), steps=7, eval_fn=eval_dict, eval_every=3, mode=mode
        )
        runs[mode] = run_calls(fit, (4, 7, 2), data)
    agree(runs, plain([data.batch(t) for t in range(13)], eval_dict, 3))


def _quadratic(p: Any, x: Any) -> Any:
    return jnp.sum((p["w"] - x) ** 2)


def test_tol_stop_mid_call_evaluates_up_to_its_last_update() -> None:
    """SGD on a quadratic: consecutive losses differ less and less, so ``tol`` between two
    consecutive differences stops the call where the plain loop's losses say: after its
    8th update (no evaluation since the 6th), or its 9th (evaluated: an evaluation's step)."""
    w0, target = {"w": jnp.zeros(3, jnp.float32)}, jnp.ones(3, jnp.float32)
    tx = optax.sgd(0.05)
    ref = plain([(target,)] * 12, _quadratic, 3, (target,), w0, tx=tx, loss=_quadratic)
    d = np.abs(np.diff(np.float32(ref["losses"])))
    assert np.all(d[:-1] > d[1:])  # strictly decreasing differences
    # update i compares losses i and i - 1: d[i - 1]; d[6] is the first <= tol at update 7
    tol = float(np.sqrt(d[5] * d[6]))
    for mode in ("fused", "stepwise"):
        fit = sfj.fuse(
            _quadratic, tx, steps=12, tol=tol, eval_fn=_quadratic, eval_every=3, mode=mode
        )
        state, trace = fit(fit.init(w0), target, eval_batch=target)
        assert trace.stop == Stop.TOL and trace.steps == 8 and int(state.step) == 8
        np.testing.assert_array_equal(trace.eval.step, [3, 6])
        close(trace.eval.value, np.asarray(ref["values"]["value"][:2]))
    tol = float(np.sqrt(d[6] * d[7]))
    fit = sfj.fuse(_quadratic, tx, steps=12, tol=tol, eval_fn=_quadratic, eval_every=3)
    state, trace = fit(fit.init(w0), target, eval_batch=target)
    assert trace.stop == Stop.TOL and trace.steps == 9
    np.testing.assert_array_equal(trace.eval.step, [3, 6, 9])  # the stopping update's too
    close(trace.eval.value, np.asarray(ref["values"]["value"][:3]))


def test_refused_update_brings_no_evaluation_and_the_next_call_continues() -> None:
    """The update after an evaluation (step 4) is refused: no evaluation at step 4 again,
    also in a call that starts there and refuses it again; a call past it evaluates at the
    fit's multiples."""
    xs = XS.copy()
    xs[4, 0, 0] = np.nan
    runs = {}
    for mode in ("fused", "stepwise"):
        fit = sfj.fuse(
            loss_fn, optax.adam(1e-2), steps=8, eval_fn=eval_dict, eval_every=2, mode=mode
        )
        state, first = fit(fit.init(P0), sf.Batches(xs[:8], YS[:8]), eval_batch=(XV, YV))
        assert first.stop == Stop.NONFINITE and first.steps == 4 and int(state.step) == 4
        np.testing.assert_array_equal(first.eval.step, [2, 4])
        state, again = fit(state, sf.Batches(xs[4:12], YS[4:12]), eval_batch=(XV, YV))
        assert again.stop == Stop.NONFINITE and again.steps == 0 and len(again.eval) == 0
        state, second = fit(state, sf.Batches(xs[5:13], YS[5:13]), eval_batch=(XV, YV))
        np.testing.assert_array_equal(second.eval.step, [6, 8, 10, 12])
        runs[mode] = (state, [first, again, second])
    ref = plain([(xs[i], YS[i]) for i in range(5)], eval_dict, 2)  # stops at the NaN
    ref2 = plain(
        [(xs[i], YS[i]) for i in range(5, 13)],
        eval_dict,
        2,
        params=ref["params"],
        opt_state=ref["opt_state"],
        start=ref["step"],
    )
    joined = {
        "losses": ref["losses"] + ref["losses"][-1:] + ref2["losses"],
        "eval_step": ref["eval_step"] + ref2["eval_step"],
        "values": {k: ref["values"][k] + ref2["values"][k] for k in ref["values"]},
        "params": ref2["params"],
        "step": ref2["step"],
    }
    agree(runs, joined)


def test_raise_keeps_the_calls_evaluations() -> None:
    fit = sfj.fuse(
        loss_fn, optax.adam(1e-2), steps=8, eval_fn=eval_scalar, eval_every=2, on_nonfinite="raise"
    )
    xs = XS.copy()
    xs[3] = np.inf
    with pytest.raises(NonFiniteError) as info:
        fit(fit.init(P0), sf.Batches(xs[:8], YS[:8]), eval_batch=(XV, YV))
    np.testing.assert_array_equal(info.value.trace.eval.step, [2])
    assert int(info.value.state.step) == 3


def test_callback_record_every_and_eval_fused_equals_stepwise() -> None:
    seen: dict[str, list] = {"fused": [], "stepwise": []}
    runs = {}
    for mode in ("fused", "stepwise"):
        fit = sfj.fuse(
            loss_fn,
            optax.adam(1e-2),
            steps=7,
            record_every=2,
            eval_fn=eval_dict,
            eval_every=3,
            callback=lambda s, l, m=mode: seen[m].append(s),
            every=2,
            mode=mode,
        )
        runs[mode] = run_calls(fit, (5, 7), X, Y)
    assert seen["fused"] == seen["stepwise"] == [2, 4, 6, 8, 10, 12]
    ref = plain([(X, Y)] * 12, eval_dict, 3)
    for state, traces in runs.values():
        steps, values = collect(traces)
        np.testing.assert_array_equal(steps, [3, 6, 9, 12])
        close(state.params, ref["params"])
        for k in values:
            close(values[k], np.asarray(ref["values"][k]))
        close(traces[1].loss, np.float32(ref["losses"][5::2]))


def test_has_state_eval_gets_the_model_state_and_leaves_it() -> None:
    def loss_s(p: Any, ms: Any, x: Any, y: Any) -> tuple:
        h = jnp.tanh(x @ p["w"])
        return jnp.mean((h @ p["v"] - y) ** 2), 0.9 * ms + 0.1 * jnp.mean(h, 0)

    def eval_s(p: Any, ms: Any, x: Any, y: Any) -> dict:
        return {"mse": jnp.mean(((jnp.tanh(x @ p["w"]) - ms) @ p["v"] - y) ** 2), "ms": jnp.sum(ms)}

    ms0 = jnp.zeros(6, jnp.float32)
    out = {}
    for mode in ("fused", "stepwise"):
        fit = sfj.fuse(
            loss_s, optax.sgd(0.1), steps=5, has_state=True, eval_fn=eval_s, eval_every=2, mode=mode
        )
        state, traces = run_calls(fit, CALLS, X, Y, state=fit.init(P0, ms0))
        out[mode] = (state, collect(traces))
    plain_fit = sfj.fuse(loss_s, optax.sgd(0.1), steps=11, has_state=True)
    ref, _ = plain_fit(plain_fit.init(P0, ms0), X, Y)
    for state, (steps, values) in out.values():
        np.testing.assert_array_equal(steps, [2, 4, 6, 8, 10])
        close(state.model_state, ref.model_state)  # evaluations change no model state
        close(values["ms"][-1], np.sum(np.asarray(_state_at(loss_s, ms0, 10))))
    close(out["fused"][1][1]["mse"], out["stepwise"][1][1]["mse"])


def _state_at(loss_s: Any, ms0: Any, n: int) -> Any:
    fit = sfj.fuse(loss_s, optax.sgd(0.1), steps=n, has_state=True)
    return fit(fit.init(P0, ms0), X, Y)[0].model_state


def test_jit_of_fit_equals_the_plain_call_with_padded_evaluations() -> None:
    fit = sfj.fuse(loss_fn, optax.adam(1e-2), steps=7, eval_fn=eval_dict, eval_every=3)
    state = fit.init(P0)
    _, host = fit(state, X, Y, steps=5, eval_batch=(XV, YV))
    jitted = jax.jit(fit, static_argnames="steps")
    new, traced = jitted(state, X, Y, steps=5, eval_batch=(XV, YV))
    assert isinstance(traced.eval, sf.EvalTrace)
    cap = fit.opts.eval_capacity  # ceil(7 / 3) = 3 slots: 3 evaluated (-1 and NaN after)
    assert traced.eval.step.shape == (cap,)
    np.testing.assert_array_equal(np.asarray(traced.eval.step), [3, -1, -1])
    for k in ("mse", "mae"):
        np.testing.assert_array_equal(np.asarray(traced.eval[k])[:1], host.eval[k])
        assert np.isnan(np.asarray(traced.eval[k])[1:]).all()
    np.testing.assert_array_equal(np.asarray(traced.eval["hits"]), [host.eval["hits"][0], 0, 0])
    assert int(new.step) == 5


def test_vmap_over_models_evaluates_each_model() -> None:
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = jax.vmap(
        lambda k: jax.tree_util.tree_map(lambda a: a + 0.1 * jax.random.normal(k, a.shape), P0)
    )(keys)
    fit = sfj.fuse(loss_fn, optax.adam(1e-2), steps=7, eval_fn=eval_dict, eval_every=2)
    states, traces = jax.vmap(lambda p: fit(fit.init(p), X, Y, eval_batch=(XV, YV)))(stacked)
    assert traces.eval.step.shape == (3, 4)
    np.testing.assert_array_equal(np.asarray(traces.eval.step), [[2, 4, 6, -1]] * 3)
    for m in range(3):
        params = jax.tree_util.tree_map(lambda a, m=m: a[m], stacked)
        ref = plain([(X, Y)] * 7, eval_dict, 2, params=params)
        for k in ("mse", "mae"):
            close(np.asarray(traces.eval[k])[m, :3], np.asarray(ref["values"][k]))
            assert np.isnan(np.asarray(traces.eval[k])[m, 3])
        close(jax.tree_util.tree_map(lambda a, m=m: a[m], states.params), ref["params"])


def test_grad_through_a_fit_with_eval_fn() -> None:
    tx = optax.sgd(0.05)
    with_eval = sfj.fuse(loss_fn, tx, steps=6, eval_fn=eval_dict, eval_every=2)
    without = sfj.fuse(loss_fn, tx, steps=6)

    def final_loss(fit: Any, p: Any, **kw: Any) -> Any:
        state, _ = fit(fit.init(p), X, Y, **kw)
        return loss_fn(state.params, XV, YV)

    g1 = jax.grad(lambda p: final_loss(with_eval, p, eval_batch=(XV, YV)))(P0)
    g2 = jax.grad(lambda p: final_loss(without, p))(P0)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(g1))
    close(g1, g2)
    # the evaluations of the differentiable loop (the masked scan) are those of a plain call
    _, plain_call = with_eval(with_eval.init(P0), X, Y, eval_batch=(XV, YV))
    scanned = sfj.fuse(loss_fn, tx, steps=6, eval_fn=eval_dict, eval_every=2, differentiable=True)
    _, st = scanned(scanned.init(P0), X, Y, eval_batch=(XV, YV))
    np.testing.assert_array_equal(st.eval.step, plain_call.eval.step)
    close(st.eval["mse"], plain_call.eval["mse"])


def _count(jaxpr: Any, name: str) -> int:
    """Occurrences of primitive ``name`` in a jaxpr and every jaxpr inside it."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for sub in _subs(eqn):
            n += _count(sub, name)
    return n


def _subs(eqn: Any) -> list:
    out = []
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                out.append(x.jaxpr)
            elif hasattr(x, "eqns"):
                out.append(x)
    return out


@pytest.mark.parametrize("steps", [3, 12])
def test_one_copy_of_the_step_and_one_of_eval_fn(steps: int) -> None:
    def loss_sin(p: Any, x: Any, y: Any) -> Any:
        return jnp.mean((jnp.sin(x @ p["w"]) @ p["v"] - y) ** 2)

    def eval_erf(p: Any, x: Any, y: Any) -> Any:
        return jnp.mean(jax.lax.erf(x @ p["w"]) @ p["v"] - y)

    fit = sfj.fuse(loss_sin, optax.sgd(0.1), steps=steps, eval_fn=eval_erf, eval_every=2)
    # the program of a plain call (`Fit._compiled_text`'s)
    program = functools.partial(fit._run, scan_steps=None, host_id=None, pack=True, rebuild=False)
    args = (fit.init(P0), (X, Y), (XV, YV), np.int32(steps), np.int32(1))
    jaxpr = jax.make_jaxpr(program)(*args).jaxpr
    assert _count(jaxpr, "sin") == 1 and _count(jaxpr, "cos") == 1  # forward, backward
    assert _count(jaxpr, "erf") == 1


def test_the_steps_loop_is_the_one_without_eval_fn(benchmark_script: Any) -> None:
    """The innermost loop body (the steps) compiles to the same kernels with and without
    ``eval_fn``; the evaluation adds a loop of segments around the chunks."""
    loop_bodies = benchmark_script("jax_kernels").loop_bodies
    without = sfj.fuse(loss_fn, optax.adam(1e-2), steps=40)
    with_eval = sfj.fuse(loss_fn, optax.adam(1e-2), steps=40, eval_fn=eval_dict, eval_every=8)
    a = sorted((k for _, k in loop_bodies(without._compiled_text(without.init(P0), X, Y))))
    b = sorted(
        k
        for _, k in loop_bodies(
            with_eval._compiled_text(with_eval.init(P0), X, Y, eval_batch=(XV, YV))
        )
    )
    assert len(b) == len(a) + 1 and max(b) == max(a)


def test_new_eval_batch_values_and_steps_reuse_the_program() -> None:
    fit = sfj.fuse(loss_fn, optax.adam(1e-2), steps=6, eval_fn=eval_scalar, eval_every=2)
    state = fit.init(P0)
    state, a = fit(state, X, Y, eval_batch=(XV, YV))
    state, b = fit(state, X, Y, steps=2, eval_batch=(XV + 1, YV))
    assert fit.compiles == 1 and len(b.eval) == 1
    ref = jax.jit(eval_scalar)(state.params, XV + 1, YV)
    np.testing.assert_allclose(b.eval.value[0], np.asarray(ref), rtol=RTOL)
    assert not np.allclose(b.eval.value[0], np.asarray(eval_scalar(state.params, XV, YV)))


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_bad_input_is_refused_by_name(mode: str) -> None:
    plain_fit = sfj.fuse(loss_fn, optax.sgd(0.1), steps=3, mode=mode)
    with pytest.raises(ValueError, match="`eval_batch`"):
        plain_fit(plain_fit.init(P0), X, Y, eval_batch=(XV, YV))
    bad = {
        "vector": (lambda p, x, y: predict(p, x) - y, TypeError, r"`eval_fn`.*scalar"),
        "empty": (lambda p, x, y: {}, TypeError, r"`eval_fn`.*non-empty dict"),
        "dict of vectors": (lambda p, x, y: {"e": predict(p, x)}, TypeError, r"`eval_fn`.*'e'"),
        "fails to trace": (lambda p, x: jnp.sum(x @ p["v"]), TypeError, r"`eval_fn\(params"),
    }
    for eval_fn, exc, match in bad.values():
        fit = sfj.fuse(loss_fn, optax.sgd(0.1), steps=3, eval_fn=eval_fn, mode=mode)
        with pytest.raises(exc, match=match):
            fit(fit.init(P0), X, Y, eval_batch=(XV, YV))
    fit = sfj.fuse(loss_fn, optax.sgd(0.1), steps=3, eval_fn=eval_scalar, mode=mode)
    with pytest.raises((TypeError, ValueError), match="`eval_fn"):  # shapes that do not fit
        fit(fit.init(P0), X, Y, eval_batch=(XV[:, :2], YV))


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
