"""Data streams on the JAX backend (`stepfuse.jax._data`): `Batches` and `Epochs` fused ==
stepwise == the plain optax loop (``optax.update`` / ``apply_updates`` per step) over the
same minibatches, across epoch boundaries and calls; resuming; a refused step; tol,
record_every and a callback with streams; a fixed argument beside a stream; jit, vmap
and grad; bad input refused before anything runs. The guide's example
(docs/guides/data_jax.md) runs as written."""

from __future__ import annotations

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
from stepfuse.jax._data import epoch_order

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "data_jax.md"

RNG = np.random.default_rng(0)
X = RNG.normal(size=(44, 3)).astype("float32")  # 44 rows, batch 8: 5 steps per epoch
Y = RNG.normal(size=(44,)).astype("float32")
XS = RNG.normal(size=(12, 8, 3)).astype("float32")
YS = RNG.normal(size=(12, 8)).astype("float32")
P0 = {
    "w": jnp.asarray(RNG.normal(size=(3, 8)) * 0.5, jnp.float32),
    "v": jnp.asarray(RNG.normal(size=(8,)) * 0.5, jnp.float32),
}


def loss_fn(p: Any, x: Any, y: Any) -> Any:
    return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)


def make(steps: int = 12, opt: Any = None, **kw: Any) -> Any:
    fit = sfj.fuse(loss_fn, opt or optax.adam(1e-2), steps=steps, **kw)
    if kw.get("mode", "fused") == "fused":
        assert_fused(fit)
    return fit


def plain(batches: list, params: Any = P0, opt_state: Any = None, opt: Any = None) -> tuple:
    """The plain optax loop over ``batches`` (each a step's arguments): ``(losses,
    params, opt_state)``. It stops at a non-finite loss, that update not applied."""
    opt = opt or optax.adam(1e-2)
    opt_state = opt.init(params) if opt_state is None else opt_state

    @jax.jit
    def step(p: Any, s: Any, *args: Any) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(p, *args)
        updates, s = opt.update(grads, s, p)
        return loss, optax.apply_updates(p, updates), s

    losses = []
    for args in batches:
        loss, new_p, new_s = step(params, opt_state, *args)
        losses.append(float(loss))
        if not np.isfinite(float(loss)):
            break
        params, opt_state = new_p, new_s
    return np.asarray(losses, np.float32), params, opt_state


def epoch_batches(data: sf.Epochs, start: int, n: int) -> list:
    return [data.batch(t) for t in range(start, start + n)]


def close(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def agree_with_plain(runs: dict, reference: tuple) -> None:
    """``runs[mode] = (state, losses)`` of the fused and stepwise fits: each equals the
    plain loop's ``(losses, params, opt_state)`` and the other."""
    ref, params, opt_state = reference
    (fs, fl), (ss, sl) = runs["fused"], runs["stepwise"]
    close(fl, ref)
    close(sl, fl)
    close(fs.params, params)
    close(fs.opt_state, opt_state)
    close(ss.params, fs.params)


def same(a: Any, b: Any) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_guide_example_runs() -> None:
    (block,) = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    scope: dict[str, Any] = {}
    exec(compile(block, str(GUIDE), "exec"), scope)
    assert_fused(scope["fit"])


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 12345])
def test_device_order_is_the_hosts(seed: int) -> None:
    data = sf.Epochs(np.zeros((1000, 2)), batch_size=10, seed=seed)
    order = jax.jit(lambda e: epoch_order(1000, seed, e))
    for epoch in (0, 1, 5, 123456):
        np.testing.assert_array_equal(np.asarray(order(jnp.int32(epoch))), data.order(epoch))


@pytest.mark.parametrize("shuffle", [True, False])
def test_epochs_across_boundaries_fused_equals_stepwise_and_plain(shuffle: bool) -> None:
    data = sf.Epochs(X, Y, batch_size=8, shuffle=shuffle, seed=7)
    runs = {}
    for mode in ("fused", "stepwise"):
        fit = make(mode=mode)
        s, t1 = fit(fit.init(P0), data)  # 12 steps: into epoch 2
        s, t2 = fit(s, data, steps=5)  # 17: into epoch 3, the same program
        assert int(s.step) == 17 and t1.steps == 12 and t2.steps == 5
        assert fit.compiles == 1
        runs[mode] = (s, np.concatenate([t1.loss, t2.loss]))
    agree_with_plain(runs, plain(epoch_batches(data, 0, 17)))


def test_epochs_resume_k_then_rest_equals_one_call_bitwise() -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=3)
    fit = make(steps=16)
    one, t = fit(fit.init(P0), data)
    for k in (3, 5, 11):
        s, a = fit(fit.init(P0), data, steps=k)
        s, b = fit(s, data, steps=16 - k)
        same(s, one)
        np.testing.assert_array_equal(np.concatenate([a.loss, b.loss]), t.loss)
    # a state saved and restored as arrays (what a checkpoint holds) continues the same
    s, _ = fit(fit.init(P0), data, steps=5)
    restored = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a)), s)
    s, _ = fit(restored, data, steps=11)
    same(s, one)
    assert fit.compiles == 1


def test_batches_over_calls_fused_equals_stepwise_and_plain() -> None:
    runs = {}
    for mode in ("fused", "stepwise"):
        fit = make(mode=mode)
        s, t1 = fit(fit.init(P0), sf.Batches(XS, YS), steps=7)
        s, t2 = fit(s, sf.Batches(XS[7:], YS[7:]), steps=5)
        assert (t1.steps, t2.steps, int(s.step)) == (7, 5, 12)
        runs[mode] = (s, np.concatenate([t1.loss, t2.loss]))
    agree_with_plain(runs, plain(list(zip(XS, YS))))


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_batches_of_another_frameworks_tensors_equal_numpys(framework: str) -> None:
    # They passed the stream check, then jit refused them ("as an abstract array").
    mod = pytest.importorskip(framework)
    convert = mod.from_numpy if framework == "torch" else mod.constant
    fit = make()
    want = fit(fit.init(P0), sf.Batches(XS, YS), steps=6)
    got = fit(fit.init(P0), sf.Batches(convert(XS), convert(YS)), steps=6)
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fixed_arguments_beside_streams() -> None:
    y_fixed = YS[0]
    fit = make()
    s, t = fit(fit.init(P0), sf.Batches(XS), y_fixed)
    ref, params, _ = plain([(XS[i], y_fixed) for i in range(12)])
    close(t.loss, ref)
    close(s.params, params)
    # an Epochs beside a fixed first argument: loss_fn(p, XS[0], Y[rows])
    data = sf.Epochs(Y, batch_size=8, seed=1)
    s, t = fit(fit.init(P0), XS[0], data, steps=9)
    ref, params, _ = plain([(XS[0], *data.batch(k)) for k in range(9)])
    close(t.loss, ref)
    close(s.params, params)


def test_steps_below_the_built_reuse_the_program() -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=4)
    fit = make(steps=12)
    s = fit.init(P0)
    for n in (1, 4, 12, 2):
        s, t = fit(s, data, steps=n)
        assert t.steps == n
    s, t = fit(s, sf.Batches(XS, YS), steps=3)
    s, t = fit(s, sf.Batches(XS, YS), steps=12)
    assert fit.compiles == 2 and int(s.step) == 34


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_nonfinite_minibatch_mid_call_then_the_next_call_starts_there(mode: str) -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=1)
    row = int(data.order(0)[-1])  # left out of epoch 0 (44 rows, 40 used): first in epoch 1
    t_bad = next(t for t in range(5, 10) if row in data.indices(t))
    bad_x = X.copy()
    bad_x[row] = np.nan
    bad = sf.Epochs(bad_x, Y, batch_size=8, seed=1)
    fit = make(mode=mode)
    s, trace = fit(fit.init(P0), bad)
    assert trace.stop == Stop.NONFINITE and trace.steps == t_bad and int(s.step) == t_bad
    assert np.isnan(trace.loss[t_bad]) and np.all(np.isfinite(trace.loss[:t_bad]))
    ref, params, opt_state = plain(epoch_batches(data, 0, t_bad))
    close(trace.loss[:t_bad], ref)
    close(s.params, params)  # the refused update left nothing behind
    close(s.opt_state, opt_state)
    good, _ = fit(fit.init(P0), data, steps=t_bad)
    same(s, good)
    s2, again = fit(s, bad, steps=2)  # the refused step's minibatch again
    assert again.steps == 0 and again.stop == Stop.NONFINITE and int(s2.step) == t_bad
    s3, rest = fit(s2, data, steps=3)  # continues at the refused step's minibatch
    ref2, params, _ = plain(epoch_batches(data, t_bad, 3), params, opt_state)
    close(rest.loss, ref2)
    close(s3.params, params)


def test_nonfinite_batches_raise_with_the_state_of_the_last_finite_step() -> None:
    xs = XS.copy()
    xs[2, 0, 0] = np.inf
    fit = make(steps=5, on_nonfinite="raise")
    with pytest.raises(NonFiniteError) as err:
        fit(fit.init(P0), sf.Batches(xs, YS))
    assert err.value.trace.steps == 2
    _, params, _ = plain([(XS[i], YS[i]) for i in range(2)])
    close(err.value.state.params, params)
    assert int(err.value.state.step) == 2


def test_nonfinite_under_jit_and_vmap() -> None:
    xs = np.stack([XS, XS])
    xs[1, 4, 0, 0] = np.nan  # model 1 stops at step 4, model 0 runs all
    fit = make(steps=8)
    states = jax.vmap(fit.init)(jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), P0))
    run = jax.jit(jax.vmap(lambda s, a, b: fit(s, sf.Batches(a, b))))
    new, traces = run(states, xs, np.stack([YS, YS]))
    assert traces.steps.tolist() == [8, 4]
    assert [Stop(int(c)) for c in traces.stop] == [Stop.STEPS, Stop.NONFINITE]
    for m, n in ((0, 8), (1, 4)):
        _, params, _ = plain([(XS[i], YS[i]) for i in range(n)])
        close(jax.tree_util.tree_map(lambda a, m=m: a[m], new.params), params, 1e-5, 1e-6)


def test_tol_record_every_and_callback_with_streams() -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=2)
    ref, _, _ = plain(epoch_batches(data, 0, 20))
    diffs = np.abs(np.diff(ref.astype(np.float64)))
    tol = float(np.sort(diffs[:14])[0]) * 1.0001  # met first somewhere before step 15
    seen: dict[str, list] = {"fused": [], "stepwise": []}
    traces = {}
    for mode in seen:
        fit = make(
            steps=20,
            mode=mode,
            tol=tol,
            record_every=3,
            every=4,
            callback=lambda s, loss, mode=mode: seen[mode].append((s, loss)),
        )
        traces[mode] = fit(fit.init(P0), data)[1]
    f, s = traces["fused"], traces["stepwise"]
    assert f.stop == s.stop == Stop.TOL and f.steps == s.steps < 20
    close(f.loss, s.loss)
    close(f.loss, ref[: f.steps : 3])
    want = [4 * j for j in range(1, f.steps // 4 + 1)]
    assert [k for k, _ in seen["fused"]] == [k for k, _ in seen["stepwise"]] == want
    close([v for _, v in seen["fused"]], [v for _, v in seen["stepwise"]])
    close([v for _, v in seen["fused"]], [ref[k - 1] for k in want])


def test_progress_bar_with_epochs(capsys: Any) -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=2)
    fit = make(steps=12, progress=True)
    s, t = fit(fit.init(P0), data)
    assert t.steps == 12
    captured = capsys.readouterr()
    assert "12/12" in captured.out + captured.err


def test_jit_of_fit_equals_fit() -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=5)
    fit = make()
    s, t = fit(fit.init(P0), data)
    js, jt = jax.jit(lambda s, d: fit(s, d))(fit.init(P0), data)
    close(js.params, s.params)
    close(jt.loss, t.loss)
    # closing over the data (concrete inside the user's trace), and over Batches
    cs, ct = jax.jit(lambda s: fit(s, data))(fit.init(P0))
    close(cs.params, s.params)
    bs, bt = fit(fit.init(P0), sf.Batches(XS, YS))
    jbs, jbt = jax.jit(lambda s, d: fit(s, d))(fit.init(P0), sf.Batches(XS, YS))
    close(jbs.params, bs.params)
    close(jbt.loss, bt.loss)


def test_vmap_over_models_with_shared_and_per_model_data() -> None:
    fit = make()
    ps = jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.5 * a, -a]), P0)
    one = lambda m: jax.tree_util.tree_map(lambda a: a[m], ps)  # noqa: E731
    data = sf.Epochs(X, Y, batch_size=8, seed=6)
    states = jax.vmap(fit.init)(ps)
    new, traces = jax.vmap(fit, in_axes=(0, None))(states, data)  # one dataset for all
    for m in range(3):
        s, t = fit(fit.init(one(m)), data)
        close(traces.loss[m], t.loss, 1e-5, 1e-6)
        close(jax.tree_util.tree_map(lambda a, m=m: a[m], new.params), s.params, 1e-5, 1e-6)
    # models at different steps (so in different epochs) in one call
    staggered = states._replace(step=jnp.asarray([0, 4, 9], jnp.int32))
    new, traces = jax.vmap(fit, in_axes=(0, None))(staggered, data)
    for m, start in enumerate((0, 4, 9)):
        ref, params, _ = plain(epoch_batches(data, start, 12), one(m))
        close(traces.loss[m], ref, 1e-5, 1e-6)
    # per-model stacked batches, and per-model datasets
    xs, ys = np.stack([XS, XS[::-1], 2 * XS]), np.stack([YS, YS[::-1], YS])
    new, traces = jax.vmap(fit)(states, sf.Batches(xs, ys))
    for m in range(3):
        ref, _, _ = plain(list(zip(xs[m], ys[m])), one(m))
        close(traces.loss[m], ref, 1e-5, 1e-6)
    xm, ym = np.stack([X, X[::-1], X]), np.stack([Y, Y[::-1], -Y])
    new, traces = jax.vmap(lambda s, x, y: fit(s, sf.Epochs(x, y, batch_size=8, seed=6)))(
        states, xm, ym
    )
    for m in range(3):
        per = sf.Epochs(xm[m], ym[m], batch_size=8, seed=6)
        ref, _, _ = plain(epoch_batches(per, 0, 12), one(m))
        close(traces.loss[m], ref, 1e-5, 1e-6)


def _unrolled(params: Any, batches: list, lr: float) -> Any:
    for args in batches:
        grads = jax.grad(loss_fn)(params, *args)
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return params


def test_grad_through_fixed_steps_with_batches_and_epochs() -> None:
    fit = make(steps=5, opt=optax.sgd(0.05))

    def final(p: Any, xs: Any) -> Any:
        s, _ = fit(fit.init(p), sf.Batches(xs, YS[:5]))
        return loss_fn(s.params, X, Y)

    def final_unrolled(p: Any, xs: Any) -> Any:
        return loss_fn(_unrolled(p, list(zip(xs, YS[:5])), 0.05), X, Y)

    for argnums in (0, 1):
        close(
            jax.grad(final, argnums)(P0, XS[:5]),
            jax.grad(final_unrolled, argnums)(P0, XS[:5]),
            1e-5,
            1e-6,
        )
    data = sf.Epochs(X, Y, batch_size=8, seed=8)  # 5 steps an epoch: steps 3..7 cross one

    def final_epochs(p: Any) -> Any:
        s = fit.init(p)._replace(step=jnp.int32(3))
        s, _ = fit(s, data)
        return loss_fn(s.params, X, Y)

    want = jax.grad(lambda p: loss_fn(_unrolled(p, epoch_batches(data, 3, 5), 0.05), X, Y))(P0)
    close(jax.grad(final_epochs)(P0), want, 1e-5, 1e-6)
    close(jax.jit(jax.grad(final_epochs))(P0), want, 1e-5, 1e-6)


@pytest.mark.parametrize(
    "make_data, error, match",
    [
        (lambda: sf.Batches(XS, YS[:5]), ValueError, "same leading length"),
        (lambda: sf.Batches(XS, 3.0), ValueError, r"Batches\(\*arrays\)\[1\]"),
        (lambda: sf.Batches(XS, [1, 2]), ValueError, r"Batches\(\*arrays\)\[1\]"),
        (lambda: sf.Epochs(X, Y[:40], batch_size=8), ValueError, "same leading length"),
        (lambda: sf.Epochs(X, Y, batch_size=0), ValueError, "batch_size"),
        (lambda: sf.Epochs(X, Y, batch_size=-3), ValueError, "batch_size"),
        (lambda: sf.Epochs(X, Y, batch_size=45), ValueError, "batch_size"),
        (lambda: sf.Epochs(X, Y, batch_size=2.0), TypeError, "batch_size"),
        (lambda: sf.Epochs(X, Y, batch_size=8, seed=-1), ValueError, "seed"),
    ],
)
def test_bad_streams_raise_naming_the_argument(make_data: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make_data()


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_bad_calls_raise_before_anything_runs(mode: str) -> None:
    fit = make(steps=6, mode=mode)
    state = fit.init(P0)
    with pytest.raises(ValueError, match="`Batches` holds 4 minibatches but the call runs 6"):
        fit(state, sf.Batches(XS[:4], YS[:4]))
    with pytest.raises(ValueError, match="`Batches` holds 4 minibatches but the call runs 5"):
        fit(state, sf.Batches(XS[:4]), YS[0], steps=5)
    assert fit.compiles == 0
    # a minibatch that does not fit loss_fn: loss_fn's error with one step's shapes
    with pytest.raises(TypeError, match=r"loss_fn\(params, \*batch\)"):
        fit(state, sf.Batches(XS[:, :, :2], YS))
    # beneath vmap, the checks read one model's arrays: 2 models of 4 minibatches each
    if mode == "fused":
        states = jax.vmap(fit.init)(jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), P0))
        with pytest.raises(ValueError, match="`Batches` holds 4 minibatches"):
            jax.vmap(fit)(states, sf.Batches(np.stack([XS[:4]] * 2), np.stack([YS[:4]] * 2)))
        with pytest.raises(ValueError, match="batch_size"):
            jax.vmap(lambda s, x: fit(s, sf.Epochs(x, batch_size=8)), in_axes=(0, 0))(
                states, np.zeros((2, 5, 3), np.float32)
            )
    assert int(state.step) == 0


def test_streams_are_pytrees_and_a_dataset_is_placed_once() -> None:
    data = sf.Epochs(X, Y, batch_size=8, shuffle=False, seed=9)
    leaves, tree = jax.tree_util.tree_flatten(data)
    assert len(leaves) == 2
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert (back.rows, back.batch_size, back.shuffle, back.seed, back.steps_per_epoch) == (
        44,
        8,
        False,
        9,
        5,
    )
    b = jax.tree_util.tree_map(lambda a: a[:3], sf.Batches(XS, YS))
    assert isinstance(b, sf.Batches) and b.n == 3
    fit = make()
    s, _ = fit(fit.init(P0), data, steps=2)
    placed = data._placed[("jax",)]
    assert all(isinstance(a, jax.Array) for a in placed)
    fit(s, data, steps=2)
    assert data._placed[("jax",)] is placed and fit.compiles == 1


@pytest.mark.slow
def test_benchmark_script_runs(benchmark_script: Any) -> None:
    script = benchmark_script("data_jax")
    out = script.main(["--problems", "small", "--steps", "64", "--rows", "512", "--repeat", "1"])
    assert set(out["small"]) == {"stepfuse Epochs", "lax.scan by hand", "jax.jit step"}
    assert all(v > 0 for v in out["small"].values())
