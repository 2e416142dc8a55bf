"""JAX backend: fused calls against optax's own stepwise loop (`optax.update` per step)."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    ATOL,
    CATALOGUES,
    NOTIFICATION_CASES,
    RTOL,
    assert_tol_stops_where_the_recorded_losses_say,
    slow_params,
)

import stepfuse.jax as sf
from stepfuse import NonFiniteError, Stop
from stepfuse.bench.jax import mlp_loss  # a tanh MLP with softmax cross-entropy
from stepfuse.problems import blobs, mlp_init, perceptron_init

X, Y = blobs()


def perceptron_loss(params, x, y):
    logits = x @ params["kernel"] + params["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


PROBLEMS = {
    "perceptron": (perceptron_loss, perceptron_init),
    "mlp": (mlp_loss, lambda: mlp_init((2, 16, 2))),
}
OPTIMIZERS = CATALOGUES["jax"]
# What the reference passes to `update` beyond (grads, state, params), as optax's docs call
# each of them; stepfuse must give at least these, with these values.
EXTRA_ARGS = {
    "lbfgs": ("value", "grad", "value_fn"),
    "adam_reduce_on_plateau": ("value",),
    "polyak_sgd": ("value",),
    "sgd_backtracking_linesearch": ("value", "grad", "value_fn"),
    "sam": ("grad_fn",),
    "clip_sam": ("grad_fn",),
    "adam_reduce_on_plateau_every_3": ("value",),
}


def optax_stepwise(loss_fn, optimizer, params, n, *batch, extra_args=()):
    """The reference: optax's own per-step loop, written the usual way."""
    params = jax.tree_util.tree_map(jnp.asarray, params)
    opt_state = optimizer.init(params)
    step = jax.jit(lambda p, s: _one(loss_fn, optimizer, p, s, *batch, extra_args=extra_args))
    losses = []
    for _ in range(n):
        loss, params, opt_state = step(params, opt_state)
        losses.append(float(loss))
    return params, opt_state, np.array(losses, np.float32)


def _one(loss_fn, optimizer, params, opt_state, *batch, extra_args=()):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    extra = {
        "value": loss,
        "grad": grads,
        "value_fn": lambda p: loss_fn(p, *batch),
        "grad_fn": lambda p, i: jax.grad(loss_fn)(p, *batch),
    }
    extra = {k: extra[k] for k in extra_args}
    updates, opt_state = optimizer.update(grads, opt_state, params, **extra)
    return loss, optax.apply_updates(params, updates), opt_state


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    jax.tree_util.tree_map(
        lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol), a, b
    )


# CI runs every optimizer on the perceptron and a sample on the mlp (a plain, a stateful,
# a wrapping and an extra-argument one); the rest of the mlp's, the line searches among
# them (15-30 s each on a 2-core CPU), run with --runslow.
CI_ON_MLP = ("sgd_momentum", "adam", "multi_steps_adam", "clip_sam")


@pytest.mark.parametrize(
    "problem, opt_name",
    [
        pytest.param(p, o, marks=pytest.mark.slow) if p == "mlp" and o not in CI_ON_MLP else (p, o)
        for p in PROBLEMS
        for o in OPTIMIZERS
    ],
)
def test_fused_calls_equal_optax_stepwise_loop(problem, opt_name):
    loss_fn, init = PROBLEMS[problem]
    calls = [5, 1, 7, 5, 2]  # several calls, different steps, one program
    fit = sf.fuse(loss_fn, OPTIMIZERS[opt_name](), steps=7)
    state, losses = fit.init(init()), []
    for n in calls:
        state, trace = fit(state, X, Y, steps=n)
        assert trace.steps == n and trace.stop is Stop.STEPS and len(trace.loss) == n
        losses.extend(trace.loss)
    params, opt_state, ref_losses = optax_stepwise(
        loss_fn,
        OPTIMIZERS[opt_name](),
        init(),
        sum(calls),
        X,
        Y,
        extra_args=EXTRA_ARGS.get(opt_name, ()),
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert_trees_close(state.params, params)
    assert_trees_close(state.opt_state, opt_state)
    assert int(state.step) == sum(calls)


@pytest.mark.parametrize("opt_name", slow_params(["sgd_momentum", "adam", "lbfgs"], {"lbfgs"}))
def test_stepwise_mode_equals_fused_mode(opt_name):
    runs = []
    for mode in ("fused", "stepwise"):
        fit = sf.fuse(mlp_loss, OPTIMIZERS[opt_name](), steps=6, mode=mode, record_every=2)
        state = fit.init(mlp_init((2, 16, 2)))
        traces = []
        for n in (6, 3):
            state, trace = fit(state, X, Y, steps=n)
            traces.append(trace)
        runs.append((state, traces))
    (s1, t1), (s2, t2) = runs
    assert_trees_close(s1.params, s2.params)
    for a, b in zip(t1, t2):
        assert (a.steps, a.stop) == (b.steps, b.stop)
        np.testing.assert_allclose(a.loss, b.loss, rtol=RTOL, atol=ATOL)


NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}  # an XLA:CPU option (see `fuse`)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")
def test_compiler_options_reach_the_fused_program_and_keep_the_results():
    loss_fn, init = PROBLEMS["perceptron"]
    opt = OPTIMIZERS["adam"]
    fits = {
        mode: sf.fuse(loss_fn, opt(), steps=8, mode=mode, compiler_options=NO_YNN)
        for mode in ("fused", "stepwise")
    }
    out = {mode: fit(fit.init(init()), X, Y) for mode, fit in fits.items()}
    ref_params, _, ref_losses = optax_stepwise(loss_fn, opt(), init(), 8, X, Y)
    for state, trace in out.values():
        assert trace.steps == 8
        assert_trees_close(state.params, ref_params)
        np.testing.assert_allclose(trace.loss, ref_losses, rtol=RTOL, atol=ATOL)
    fit, state = fits["fused"], fits["fused"].init(init())

    plain = sf.fuse(loss_fn, opt(), steps=8)._compiled_text(state, X, Y)
    if "ynn_fusion" not in plain:
        pytest.skip("this XLA:CPU does not fuse the matmul with YNN: nothing to compare")
    assert "ynn_fusion" not in fit._compiled_text(state, X, Y)  # the option reached the compiler


def test_seed_table_row_k_of_3_steps_equals_row_3k_of_1_step():
    tables = {}
    for n in (1, 3):
        fit = sf.fuse(perceptron_loss, optax.sgd(0.01), steps=n)
        state, rows = fit.init(perceptron_init()), []
        for _ in range(30 if n == 1 else 10):
            state, trace = fit(state, X, Y)
            rows.append(trace.loss[0])  # the loss before this call, as the seed prints it
        tables[n] = np.array(rows)
    assert tables[1][0] == pytest.approx(math.log(2), abs=1e-6)
    np.testing.assert_allclose(tables[3], tables[1][::3], rtol=1e-6)
    assert not np.allclose(tables[3], tables[1][:10])  # the 3-step table really moves faster


def test_gradient_is_recomputed_at_every_step():
    n, opt = 20, optax.sgd(0.5)
    fit = sf.fuse(perceptron_loss, opt, steps=n)
    state, _ = fit(fit.init(perceptron_init()), X, Y)
    # The seed's worry: applying the first gradient n times.
    params = jax.tree_util.tree_map(jnp.asarray, perceptron_init())
    g0 = jax.grad(perceptron_loss)(params, X, Y)
    stale = jax.tree_util.tree_map(lambda p, g: p - 0.5 * n * g, params, g0)
    ref, _, _ = optax_stepwise(perceptron_loss, opt, perceptron_init(), n, X, Y)
    assert_trees_close(state.params, ref)
    assert not np.allclose(state.params["kernel"], stale["kernel"], rtol=1e-3)


def test_one_trace_across_steps_and_batch_values():
    traces = []

    def counting_loss(params, x, y):
        traces.append(1)
        return perceptron_loss(params, x, y)

    fit = sf.fuse(counting_loss, optax.adam(0.01), steps=50)
    state = fit.init(perceptron_init())
    for n, seed in [(50, 0), (1, 1), (17, 2), (50, 3), (3, 4)]:
        x, y = blobs(seed=seed)
        state, trace = fit(state, x, y, steps=n)
        assert trace.steps == n
    assert len(traces) == 1


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_compiles_counts_one_program_per_batch_shape_and_mode_is_reported(mode):
    from stepfuse._core import FitLike

    fit = sf.fuse(perceptron_loss, optax.adam(0.01), steps=20, mode=mode)
    assert isinstance(fit, FitLike)
    assert (fit.mode, fit.compiles) == (mode, 0)
    state = fit.init(perceptron_init())
    for n, seed in [(20, 0), (1, 1), (7, 2), (20, 3)]:  # other steps=n, other batch values
        x, y = blobs(seed=seed)
        state, trace = fit(state, x, y, steps=n)
        assert trace.steps == n
    assert fit.compiles == 1
    fit(state, X[:-1], Y[:-1], steps=3)  # a new batch shape: a new program
    assert fit.compiles == 2
    fit(state, X[:-1], Y[:-1], steps=5)
    assert (fit.mode, fit.compiles) == (mode, 2)


def test_a_weakly_typed_optimizer_state_compiles_one_program_for_every_call():
    # optax's line searches start their state with weakly typed leaves; a call returns
    # them strongly typed, which must not make the second call compile again
    def init(params):
        return {"count": jnp.asarray(0.0)}  # weakly typed

    def update(grads, state, params=None):
        return jax.tree_util.tree_map(lambda g: -0.01 * g, grads), {"count": state["count"] + 1}

    fit = sf.fuse(perceptron_loss, optax.GradientTransformation(init, update), steps=5)
    state = fit.init(perceptron_init())
    assert not any(getattr(x, "weak_type", False) for x in jax.tree_util.tree_leaves(state))
    for _ in range(3):
        state, trace = fit(state, X, Y)
    assert (fit.compiles, trace.steps, float(state.opt_state["count"])) == (1, 5, 15.0)


def test_weakly_typed_parameters_compile_one_program_for_every_call():
    """A Python float (weakly typed) parameter: fit.init makes it strong, as a call returns
    it (the second call compiled the program again)."""
    fit = sf.fuse(
        lambda p, x: jnp.sum((x * p["w"] - 1.0) ** 2) + p["b"] ** 2, optax.sgd(0.1), steps=3
    )
    state = fit.init({"w": jnp.ones(2), "b": 0.5})
    assert not any(getattr(x, "weak_type", False) for x in jax.tree_util.tree_leaves(state))
    for _ in range(3):
        state, _ = fit(state, jnp.ones(2))
    assert fit.compiles == 1


def test_complex_parameters_are_refused_naming_the_fix():
    fit = sf.fuse(lambda p: jnp.sum(jnp.abs(p["w"]) ** 2), optax.adam(0.1), steps=2)
    with pytest.raises(TypeError, match=r"complex64 at params\['w'\].*real and imaginary"):
        fit.init({"w": jnp.ones(2, jnp.complex64)})


def test_an_optimizer_that_wants_per_example_gradients_fails_with_a_note_saying_why():
    fit = sf.fuse(mlp_loss, optax.contrib.dpsgd(0.01, 1.0, 0.1, seed=0), steps=3)
    state = fit.init(mlp_init((2, 16, 2)))
    with pytest.raises(ValueError, match="batch dimension") as info:
        fit(state, X, Y)
    assert "optax.contrib.dpsgd wants one per example" in "".join(info.value.__notes__)
    assert int(state.step) == 0


def test_fuse_docstring_lists_the_shared_options_among_its_args():
    doc = sf.fuse.__doc__
    assert "{options}" not in doc
    for name in ("loss_fn", "steps", "tol", "on_nonfinite", "mode", "has_aux"):
        assert f"\n      {name}: " in doc  # indented like every other entry of Args


def test_state_keeps_its_structure_shapes_and_dtypes():
    fit = sf.fuse(mlp_loss, optax.adamw(0.01), steps=4)
    state0 = fit.init(mlp_init((2, 16, 2)))
    state1, _ = fit(state0, X, Y)
    a, b = jax.tree_util.tree_structure(state0), jax.tree_util.tree_structure(state1)
    assert a == b
    for u, v in zip(jax.tree_util.tree_leaves(state0), jax.tree_util.tree_leaves(state1)):
        assert (u.shape, u.dtype) == (v.shape, v.dtype)


def quadratic(w, target):
    return jnp.sum((w - target) ** 2)


def test_tol_stops_early_inside_the_loop():
    fit = sf.fuse(quadratic, optax.sgd(0.1), steps=10_000, tol=1e-9)
    state, trace = fit(fit.init(jnp.zeros(3)), jnp.ones(3))
    ref = sf.fuse(quadratic, optax.sgd(0.1), steps=10_000, tol=1e-9, mode="stepwise")
    rstate, rtrace = ref(ref.init(jnp.zeros(3)), jnp.ones(3))
    assert trace.stop is Stop.TOL and 10 < trace.steps < 200
    assert trace.steps == rtrace.steps and int(state.step) == trace.steps
    diffs = np.abs(np.diff(trace.loss))
    assert diffs[-1] <= 1e-9 and np.all(diffs[:-1] > 1e-9)
    np.testing.assert_allclose(state.params, rstate.params, rtol=RTOL)


# float64 (the same comparison in the loss's dtype; x64 losses: the callback test's) runs
# with --runslow.
@pytest.mark.parametrize("dtype", slow_params(["float32", "float64"], {"float64"}))
def test_tol_at_the_last_bit_stops_where_the_recorded_losses_say(dtype):
    with jax.enable_x64(dtype == "float64"):
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), perceptron_init())
        batch = (jnp.asarray(X, dtype), jnp.asarray(Y))

        def run(tol):
            fit = sf.fuse(perceptron_loss, optax.adam(0.05), steps=60, tol=tol)
            return fit(fit.init(params), *batch)[1]

        assert_tol_stops_where_the_recorded_losses_say(run, run(None).loss)


@pytest.mark.parametrize("loss_dtype", ["float32", "bfloat16"])
def test_tol_compares_the_exact_difference_of_losses_far_apart(loss_dtype):
    # Losses falling ~2.8x a step: their difference rounded in the loss dtype crossed tol
    # (float32: at the last bit; a bfloat16 loss: at tol=0.702 against a recorded 0.70117).
    def loss(w):
        return jnp.sum(w**2).astype(loss_dtype)

    w0 = jnp.array([1.0, 0.3])

    def run(tol, mode="fused"):
        fit = sf.fuse(loss, optax.sgd(0.2), steps=8, tol=tol, mode=mode)
        return fit(fit.init(w0))[1]

    losses = run(None).loss
    assert_tol_stops_where_the_recorded_losses_say(run, losses, at=(0, 2, 4))
    for tol in (0.702, 0.00422):
        fused, stepwise = run(tol), run(tol, "stepwise")
        assert (fused.steps, fused.stop) == (stepwise.steps, stepwise.stop), tol


def diverging_loss(w, x, t):
    return jnp.mean((x @ w - t) ** 2)


def first_nonfinite_update(loss_fn, optimizer, params, batch, limit):
    """The stepwise oracle: k = the number of updates applied before a non-finite one."""
    opt_state = optimizer.init(params)
    for k in range(limit):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        leaves = jax.tree_util.tree_leaves((loss, grads, new_params, new_opt))
        if not all(bool(jnp.all(jnp.isfinite(v))) for v in leaves):
            return k, params, opt_state
        params, opt_state = new_params, new_opt
    raise AssertionError("did not diverge")


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_losses_of_other_widths_reach_the_host_whole(dtype):
    # A float32/float64 trace comes back as one integer array (the losses' bits, then
    # applied and stop); other widths as three arrays. Either way, the stepwise trace.
    with jax.enable_x64(dtype == "float64"):
        x, t = jnp.asarray(X[:, :2], dtype), jnp.asarray(Y, dtype)
        w0 = jnp.ones((2,), dtype)
        lr, steps, rtol = (3.0, 500, 1e-12) if dtype == "float64" else (0.05, 40, 1e-2)
        fused = sf.fuse(diverging_loss, optax.sgd(lr), steps=steps)
        ref = sf.fuse(diverging_loss, optax.sgd(lr), steps=steps, mode="stepwise")
        (s1, t1), (s2, t2) = fused(fused.init(w0), x, t), ref(ref.init(w0), x, t)
        assert t1.steps == t2.steps and t1.stop is t2.stop
        assert t1.stop is (Stop.NONFINITE if dtype == "float64" else Stop.STEPS)
        assert t1.loss.dtype == (np.float64 if dtype == "float64" else np.float32)
        # the same width under jit (the trace then holds the device's array)
        jitted = jax.jit(lambda s: fused(s, x, t)[1].loss)(fused.init(w0))
        assert jitted.dtype == t1.loss.dtype
        assert len(t1.loss) == len(t2.loss) and 0 < t1.steps
        np.testing.assert_allclose(t1.loss, t2.loss, rtol=rtol)
        np.testing.assert_allclose(
            np.asarray(s1.params, np.float64), np.asarray(s2.params, np.float64), rtol=rtol
        )


@pytest.mark.parametrize(
    "opt", [optax.sgd(3.0), optax.sgd(1.0, momentum=0.9)], ids=["sgd", "momentum"]
)
def test_nonfinite_stops_before_the_bad_update_at_the_oracles_step(opt):
    x = jnp.asarray(X[:, :2])
    batch = (x, jnp.asarray(Y, jnp.float32))
    w0 = jnp.ones((2,))
    k, ref_params, ref_opt = first_nonfinite_update(diverging_loss, opt, w0, batch, 500)
    fit = sf.fuse(diverging_loss, opt, steps=500)
    state, trace = fit(fit.init(w0), *batch)
    assert trace.stop is Stop.NONFINITE and trace.steps == k and int(state.step) == k
    assert len(trace.loss) == k + 1  # the refused point's loss is kept
    np.testing.assert_allclose(state.params, ref_params, rtol=1e-5)
    assert_trees_close(state.opt_state, ref_opt, rtol=1e-5)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(state))
    # Split into calls, the same point is reached; and on_nonfinite="raise" names the step.
    fit2 = sf.fuse(diverging_loss, opt, steps=7, on_nonfinite="raise")
    state2 = fit2.init(w0)
    with pytest.raises(NonFiniteError, match=f"step {k}") as err:
        for _ in range(100):
            state2, _ = fit2(state2, *batch)
    assert err.value.step == k
    # ... and hands back the state the call reached, which the caller does not hold
    assert int(err.value.state.step) == k
    np.testing.assert_allclose(err.value.state.params, ref_params, rtol=1e-5)


STATEFUL = {
    "adam": lambda: optax.adam(0.3),
    "sgd_momentum": lambda: optax.sgd(0.01, momentum=0.9),
    "rmsprop": lambda: optax.rmsprop(0.1),
}


def wall_loss(w, target):
    """Finite while w[0] < 3, NaN past it; the target draws w[0] beyond it when above 3."""
    return jnp.sum((w - target) ** 2) + jnp.sqrt(3.0 - w[0]), w


@pytest.mark.parametrize("notify", [False, True], ids=["plain", "callback"])
@pytest.mark.parametrize("opt_name", STATEFUL)
def test_nonfinite_with_optimizer_state_gives_the_state_of_a_call_stopping_there_bitwise(
    opt_name, notify
):
    # The loop applies a step before its test reads the step's check; a refused update is
    # undone by running the call's finite steps again. The state, trace and aux must be
    # those of a call of exactly those steps (bit for bit) and of optax's loop.
    opt, target, w0 = STATEFUL[opt_name](), jnp.array([5.0, -1.0]), jnp.zeros(2)
    k, ref_params, ref_opt = first_nonfinite_update(
        lambda w, t: wall_loss(w, t)[0], opt, w0, (target,), 300
    )
    assert k > 5
    seen = []
    notified = {"callback": lambda s, l: seen.append((s, l)), "every": 3} if notify else {}
    fit = sf.fuse(wall_loss, opt, steps=300, has_aux=True, **notified)
    state, trace, aux = fit(fit.init(w0), target)
    assert trace.stop is Stop.NONFINITE and trace.steps == k and int(state.step) == k
    assert len(trace.loss) == k + 1 and np.isnan(trace.loss[-1])
    exact = sf.fuse(wall_loss, opt, steps=300, has_aux=True)
    s_k, t_k, _ = exact(exact.init(w0), target, steps=k)
    assert t_k.stop is Stop.STEPS
    assert_trees_close(state, s_k, rtol=0, atol=0)  # bit for bit
    np.testing.assert_array_equal(trace.loss[:k], t_k.loss)
    np.testing.assert_array_equal(aux, state.params)  # the aux of the refused point: its params
    assert_trees_close(state.params, ref_params, rtol=1e-5)
    assert_trees_close(state.opt_state, ref_opt, rtol=1e-5)
    if notify:  # every applied multiple of 3, once, with the loss before it
        assert [s for s, _ in seen] == list(range(3, k + 1, 3))
        np.testing.assert_allclose([l for _, l in seen], trace.loss[2:k:3], rtol=1e-6)
    else:  # inside a user's jit the program undoes the refused update itself
        j_state, j_trace, j_aux = jax.jit(fit)(fit.init(w0), target)
        assert int(j_trace.stop) == Stop.NONFINITE and int(j_trace.steps) == k == int(j_state.step)
        assert_trees_close(j_state, state, rtol=1e-6)
        np.testing.assert_allclose(j_trace.loss[: k + 1], trace.loss, rtol=1e-6)
        np.testing.assert_array_equal(j_aux, j_state.params)


def test_vmap_with_models_stopping_at_different_steps_equals_separate_fits():
    # Under vmap the loop runs while any model runs, and undoes a refused update only for
    # the models that met one.
    fit = sf.fuse(wall_loss, optax.adam(0.1), steps=80, has_aux=True)
    w0 = jnp.zeros((4, 2))
    targets = jnp.array(
        [[5.0, -1.0], [2.0, 1.0], [9.0, 0.0], [4.0, 3.0]]
    )  # the second never hits the wall
    states, traces, _ = jax.vmap(lambda w, t: fit(fit.init(w), t))(w0, targets)
    stops = []
    for i in range(4):
        state, trace, _ = fit(fit.init(w0[i]), targets[i])
        stops.append(trace.stop)
        assert int(traces.steps[i]) == trace.steps and int(traces.stop[i]) == trace.stop
        np.testing.assert_allclose(states.params[i], state.params, rtol=1e-5)
        assert_trees_close(
            jax.tree_util.tree_map(lambda a: a[i], states.opt_state),
            state.opt_state,
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_allclose(traces.loss[i, : len(trace.loss)], trace.loss, rtol=1e-5)
    assert stops.count(Stop.NONFINITE) == 3 and len(set(int(s) for s in traces.steps)) == 4


def inf_entry_that_returns(finite_at: int, inf_at: int) -> optax.GradientTransformation:
    """Passes the gradient on; its state holds an entry that is inf at init, 1.0 from
    update ``finite_at`` (0-based) and inf again from update ``inf_at``."""

    def init(params):
        return {"x": jnp.array(jnp.inf, jnp.float32), "n": jnp.zeros((), jnp.int32)}

    def update(grads, state, params=None):
        n = state["n"]
        x = jnp.where(n >= inf_at, jnp.inf, jnp.where(n >= finite_at, 1.0, state["x"]))
        return grads, {"x": x.astype(jnp.float32), "n": n + 1}

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("steps_per_call", [1, 3, 20])
def test_a_state_entry_left_inf_is_no_nonfinite_update_but_one_made_inf_again_is(steps_per_call):
    # An entry inf from init and left so counts as finite; once finite, an update that makes
    # it inf again is refused, whether or not the call began with the entry at inf.
    opt = optax.chain(inf_entry_that_returns(finite_at=2, inf_at=5), optax.sgd(0.1))
    for mode in ("fused", "stepwise"):
        fit = sf.fuse(perceptron_loss, opt, steps=steps_per_call, mode=mode)
        state, applied = fit.init(perceptron_init()), 0
        for _ in range(20 // steps_per_call):
            state, trace = fit(state, X, Y)
            applied += trace.steps
            if trace.stop is Stop.NONFINITE:
                break
        assert trace.stop is Stop.NONFINITE and applied == 5 == int(state.step), mode
        assert float(state.opt_state[0]["x"]) == 1.0


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_a_call_that_applies_no_update_says_so_and_why(mode):
    """sqrt(|w|) at w = 0: the loss is finite, its gradient inf, so the first update is
    refused and the call applies none; a loop reading the losses saw training stall, and
    only trace.stop said why. The call warns now, naming the step and the gradient."""
    fit = sf.fuse(lambda w: jnp.sqrt(jnp.abs(w)).sum(), optax.sgd(0.1), steps=3, mode=mode)
    state = fit.init(jnp.zeros(2))
    with pytest.warns(RuntimeWarning, match="applied no update") as caught:
        state, trace = fit(state)
    assert trace.stop is Stop.NONFINITE and trace.steps == 0 and int(state.step) == 0
    message = str(caught[0].message)
    assert "at the fit's step 0" in message and "a gradient or the update itself" in message
    assert caught[0].filename == __file__


def test_vmap_over_8_initialisations_equals_8_separate_fits():
    fit = sf.fuse(mlp_loss, optax.adam(0.01), steps=20)
    inits = [mlp_init((2, 16, 2), seed=s) for s in range(8)]
    batched = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *inits)
    states, traces = jax.vmap(lambda p: fit(fit.init(p), X, Y))(batched)
    assert traces.loss.shape == (8, 20)
    for i, p in enumerate(inits):
        state, trace = fit(fit.init(p), X, Y)
        assert_trees_close(
            jax.tree_util.tree_map(lambda a: a[i], states.params), state.params, rtol=1e-5
        )
        np.testing.assert_allclose(traces.loss[i], trace.loss, rtol=1e-5)
        assert int(traces.steps[i]) == 20 and int(traces.stop[i]) == Stop.STEPS


def test_jit_of_fit_equals_fit():
    fit = sf.fuse(perceptron_loss, optax.adam(0.01), steps=10)
    state = fit.init(perceptron_init())
    s1, t1 = fit(state, X, Y)
    s2, t2 = jax.jit(lambda s, x, y: fit(s, x, y))(state, X, Y)
    assert_trees_close(s1.params, s2.params)
    np.testing.assert_allclose(t1.loss, np.asarray(t2.loss)[: t1.steps], rtol=RTOL)


def test_jit_of_fit_closing_over_its_inputs_equals_fit():
    # No argument of `fit` is a tracer, yet it runs inside a trace: the results come back
    # as arrays of the outer program, and the fit still works outside it afterwards.
    fit = sf.fuse(perceptron_loss, optax.adam(0.01), steps=10)
    state = fit.init(perceptron_init())
    s2, t2 = jax.jit(lambda: fit(state, X, Y, steps=7))()
    s1, t1 = fit(state, X, Y, steps=7)
    assert_trees_close(s1.params, s2.params)
    assert int(t2.steps) == t1.steps == 7 and int(t2.stop) == Stop.STEPS
    np.testing.assert_allclose(t1.loss, np.asarray(t2.loss)[:7], rtol=RTOL)


def test_grad_through_fixed_steps_matches_finite_differences():
    def final_loss(w0, target):
        fit = sf.fuse(quadratic, optax.sgd(0.02, momentum=0.5), steps=5)
        state, _ = fit(fit.init(w0), target)
        return quadratic(state.params, target)

    w0, target = jnp.array([0.3, -0.2, 0.5]), jnp.array([1.0, 2.0, -1.0])
    g = jax.grad(final_loss)(w0, target)
    eps, fd = 1e-2, []
    for i in range(3):
        e = jnp.zeros(3).at[i].set(eps)
        fd.append((final_loss(w0 + e, target) - final_loss(w0 - e, target)) / (2 * eps))
    np.testing.assert_allclose(g, fd, rtol=2e-3, atol=1e-5)
    assert np.all(np.abs(g) > 1e-2)
    # Also inside jax.jit with differentiable=True, and w.r.t. the batch.
    fit = sf.fuse(quadratic, optax.sgd(0.02, momentum=0.5), steps=5, differentiable=True)

    @jax.jit
    def final_loss_jit(w0, target):
        state, _ = fit(fit.init(w0), target)
        return quadratic(state.params, target)

    np.testing.assert_allclose(jax.grad(final_loss_jit)(w0, target), g, rtol=1e-5)
    assert np.all(np.isfinite(jax.grad(final_loss_jit, argnums=1)(w0, target)))


def test_has_aux_returns_the_aux_of_the_last_step():
    def loss_with_aux(params, x, y):
        loss = perceptron_loss(params, x, y)
        return loss, {"loss_again": loss, "kernel_sum": params["kernel"].sum()}

    fit = sf.fuse(loss_with_aux, optax.sgd(0.1), steps=4, has_aux=True)
    state, trace, aux = fit(fit.init(perceptron_init()), X, Y)
    assert float(aux["loss_again"]) == pytest.approx(trace.loss[-1], rel=1e-6)
    ref = sf.fuse(loss_with_aux, optax.sgd(0.1), steps=4, has_aux=True, mode="stepwise")
    _, _, raux = ref(ref.init(perceptron_init()), X, Y)
    np.testing.assert_allclose(aux["kernel_sum"], raux["kernel_sum"], rtol=RTOL)


def test_record_every_thins_the_trace():
    full = sf.fuse(perceptron_loss, optax.sgd(0.1), steps=100)
    thin = sf.fuse(perceptron_loss, optax.sgd(0.1), steps=100, record_every=7)
    _, tf_ = full(full.init(perceptron_init()), X, Y)
    _, tt = thin(thin.init(perceptron_init()), X, Y)
    assert len(tt.loss) == 15 and list(tt.index[:3]) == [0, 7, 14]
    np.testing.assert_allclose(tt.loss, tf_.loss[::7], rtol=RTOL)


def test_callback_fires_from_inside_the_loop_at_global_steps():
    seen = []
    fit = sf.fuse(
        perceptron_loss,
        optax.sgd(0.1),
        steps=10,
        callback=lambda s, l: seen.append((s, l)),
        every=4,
    )
    state, t1 = fit(fit.init(perceptron_init()), X, Y)
    state, t2 = fit(state, X, Y)
    assert [s for s, _ in seen] == [4, 8, 12, 16, 20]
    assert seen[0][1] == pytest.approx(t1.loss[3], rel=1e-6)  # the loss before update 4


@pytest.mark.parametrize("record_every", [1, 3])
@pytest.mark.parametrize("differentiable", [False, True], ids=["while", "scan"])
def test_callback_losses_are_the_stepwise_losses_recorded_or_not(record_every, differentiable):
    # The loss handed to the callback is that of the step before the notified update,
    # whether the trace keeps that step (record_every) or not.
    seen = []
    fit = sf.fuse(
        perceptron_loss,
        optax.adam(0.05),
        steps=40,
        every=5,
        record_every=record_every,
        callback=lambda s, l: seen.append((s, l)),
        differentiable=differentiable,
    )
    state, _ = fit(fit.init(perceptron_init()), X, Y)
    fit(state, X, Y, steps=40)
    ref = sf.fuse(perceptron_loss, optax.adam(0.05), steps=80, mode="stepwise")
    _, full = ref(ref.init(perceptron_init()), X, Y)
    assert [s for s, _ in seen] == list(range(5, 81, 5))
    np.testing.assert_allclose([l for _, l in seen], full.loss[4::5], rtol=1e-6)


def test_callbacks_through_stepfuse_ffi_target_match_jax_debug_callback(monkeypatch):
    """On CPU the loop calls the host through stepfuse's own FFI target; without it
    (another backend, or a jaxlib whose FFI layout it doesn't know) jax.debug.callback."""
    from stepfuse.jax import _host as _jax_host

    def run():
        seen = []
        fit = sf.fuse(
            perceptron_loss,
            optax.adam(0.05),
            steps=12,
            callback=lambda s, l: seen.append((s, l)),
            every=5,
        )
        state, t1 = fit(fit.init(perceptron_init()), X, Y)
        fit(state, X, Y, steps=9)
        return fit, seen, t1

    fast, seen_fast, t1 = run()
    if jax.default_backend() == "cpu":
        assert fast._host_id is not None and _jax_host.available()
    monkeypatch.setattr(_jax_host, "register", lambda receiver: None)
    slow, seen_slow, _ = run()
    assert slow._host_id is None
    assert [s for s, _ in seen_fast] == [5, 10, 15, 20] and seen_fast == seen_slow
    assert seen_fast[1][1] == pytest.approx(t1.loss[9], rel=1e-6)


def test_ffi_handler_ignores_unknown_and_collected_receivers():
    from stepfuse.jax import _host as _jax_host

    if not _jax_host.available():
        pytest.skip("stepfuse's FFI target is for XLA:CPU")
    got = []

    class Receiver:
        def take(self, values):
            got.append(values)

    r = Receiver()
    rid = _jax_host.register(r.take)
    send = jax.jit(lambda v: (_jax_host.send(rid, v), _jax_host.send(10**6, v), v)[1])
    jax.block_until_ready(send(jnp.arange(4, dtype=jnp.int32).reshape(2, 2)))
    assert got == [(0, 1, 2, 3)]
    del r  # held weakly: later sends reach nobody and do no harm
    jax.block_until_ready(send(jnp.zeros((2, 2), jnp.int32)))
    assert got == [(0, 1, 2, 3)]


def test_callback_exception_reaches_the_caller():
    def bad(step, loss):
        raise RuntimeError(f"stop at {step}")

    fit = sf.fuse(perceptron_loss, optax.sgd(0.1), steps=10, callback=bad, every=3)
    state = fit.init(perceptron_init())
    with pytest.raises(RuntimeError, match="stop at 3"):
        fit(state, X, Y)
    assert int(state.step) == 0  # the caller's state is untouched (pure)


def test_progress_bar_runs_from_inside_the_loop(capsys):
    fit = sf.fuse(perceptron_loss, optax.sgd(0.1), steps=200, progress=True, every=50)
    _, trace = fit(fit.init(perceptron_init()), X, Y)
    assert trace.steps == 200
    assert "200/200" in capsys.readouterr().out


def test_a_bar_ends_on_the_calls_last_loss_when_nothing_was_notified(capsys):
    # Once the speed is known, a short call reaches the host at no step: the bar's last
    # frame showed its initial NaN; it shows the call's last loss.
    fit = sf.fuse(perceptron_loss, optax.adam(1e-2), steps=100, progress=True)
    state = fit.init(perceptron_init())
    for n in (2, 2, 100, 50):
        capsys.readouterr()
        state, trace = fit(state, X, Y, steps=n)
        shown = capsys.readouterr().out
        assert "loss nan" not in shown, (n, shown)
        assert f"{n}/{n} loss {float(trace.loss[-1]):.4g}" in shown, (n, shown)


@pytest.mark.parametrize("notify, record_every", NOTIFICATION_CASES)
def test_notifications_leave_the_results_unchanged(notify, record_every, capsys):
    plain = sf.fuse(perceptron_loss, optax.adam(0.05), steps=300, record_every=record_every)
    noted = sf.fuse(
        perceptron_loss, optax.adam(0.05), steps=300, record_every=record_every, every=7, **notify
    )
    (s1, t1), (s2, t2) = (f(f.init(perceptron_init()), X, Y) for f in (plain, noted))
    np.testing.assert_array_equal(t1.loss, t2.loss)
    assert (t1.steps, t1.stop) == (t2.steps, t2.stop) and len(t2.loss) == -(-300 // record_every)
    assert_trees_close(s1, s2, rtol=0, atol=0)


def test_a_bar_alone_reaches_the_host_at_multiples_of_every_paced_by_speed(monkeypatch, capsys):
    # A callback is owed every multiple of `every`; a bar alone, drawn ~10 times a second,
    # only needs a host call every ~_DRAW_SECONDS at the previous call's speed.
    for callback in (None, lambda s, l: None):
        fit = sf.fuse(
            perceptron_loss, optax.sgd(0.1), steps=5000, progress=True, every=3, callback=callback
        )
        seen, deliver = [], fit._deliver
        monkeypatch.setattr(fit, "_deliver", lambda s, l: (seen.append(int(s)), deliver(s, l)))
        state, _ = fit(fit.init(perceptron_init()), X, Y)  # speed not known yet: every 3
        assert seen == list(range(3, 5001, 3))
        period = int(fit._period(True))
        seen.clear()
        fit(state, X, Y)
        if callback is None:
            assert period > 3 and period % 3 == 0
        else:
            assert period == 3
        assert seen == [s for s in range(5001, 10001) if s % period == 0]


# -- bad input: each case names the argument, the value and a fix, before anything runs --


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3"])
def test_bad_steps(bad):
    with pytest.raises((TypeError, ValueError), match=r"`steps`.*" + repr(bad).replace(".", r"\.")):
        sf.fuse(perceptron_loss, optax.sgd(0.1), steps=bad)
    fit = sf.fuse(perceptron_loss, optax.sgd(0.1), steps=3)
    with pytest.raises((TypeError, ValueError), match="`steps`"):
        fit(fit.init(perceptron_init()), X, Y, steps=bad)


def test_traced_steps_inside_jit_say_to_make_them_static():
    fit = sf.fuse(perceptron_loss, optax.sgd(0.1), steps=3)
    state = fit.init(perceptron_init())
    with pytest.raises(TypeError, match=r"`steps` must be an int.*make it static"):
        jax.jit(lambda s, n: fit(s, X, Y, steps=n))(state, 2)


def test_call_steps_above_the_built_capacity_says_how_to_fix():
    fit = sf.fuse(perceptron_loss, optax.sgd(0.1), steps=3)
    with pytest.raises(ValueError, match=r"steps=4"):
        fit(fit.init(perceptron_init()), X, Y, steps=4)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"record_every": 0}, "record_every"),
        ({"tol": -1.0}, "tol"),
        ({"compiler_options": {"xla_no_such_option": 1}}, "compiler_options"),
        ({"compiler_options": [("a", 1)]}, "compiler_options"),
        ({"compiler_options": {"a": [1]}}, "compiler_options"),
    ],
)
def test_bad_options(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
        sf.fuse(perceptron_loss, optax.sgd(0.1), steps=3, **kwargs)


@pytest.mark.parametrize(
    "loss_fn, what",
    [
        (lambda p, x, y: x @ p["kernel"], "shape"),
        (lambda p, x, y: jnp.sum(y), "int32"),
        (lambda p, x, y: (perceptron_loss(p, x, y), 1), "floating-point scalar"),
    ],
    ids=["non_scalar", "integer", "tuple_without_has_aux"],
)
def test_bad_loss_is_reported_before_running(loss_fn, what):
    fit = sf.fuse(loss_fn, optax.sgd(0.1), steps=3)
    with pytest.raises(TypeError, match=f"`loss_fn`.*{what}"):
        fit(fit.init(perceptron_init()), X, Y)


class NotOptax:
    def init(self, params):
        return ()


@pytest.mark.parametrize("bad", [NotOptax(), "adam", None])
def test_optimizer_that_is_not_optax(bad):
    with pytest.raises(TypeError, match="`optimizer`.*optax"):
        sf.fuse(perceptron_loss, bad, steps=3)


def test_integer_params_named_with_their_path():
    fit = sf.fuse(perceptron_loss, optax.sgd(0.1), steps=3)
    with pytest.raises(TypeError, match=r"`params`.*int32.*\['bias'\]"):
        fit.init({"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2, jnp.int32)})


def test_state_that_is_not_a_fitstate():
    fit = sf.fuse(perceptron_loss, optax.sgd(0.1), steps=3)
    with pytest.raises(TypeError, match="`state`.*fit.init"):
        fit(perceptron_init(), X, Y)


@pytest.mark.slow  # its optimizers' equivalence is the sweep's above; the script: --runslow
def test_optax_extra_args_benchmark_script_checks_and_times_every_optimizer(
    capsys, benchmark_script
):
    # benchmarks/optax_extra_args.py on its smallest settings: each optimizer's fused run
    # agrees with optax's per-step loop (the script asserts it) and gets a row.
    script = benchmark_script("optax_extra_args")
    script.main(["--steps", "5", "--rounds", "1"])
    out = capsys.readouterr().out
    for name in script.OPTIMIZERS:
        assert name in out
    assert out.count("ratio") == len(script.OPTIMIZERS)


# -- found by probing: tol rounding, transforms, sharding ------------------------------------


def test_tol_is_not_rounded_up_to_the_loss_dtype():
    """Losses 1.0, 0.75, ... (steps of exactly 0.25), tol just below 0.25: no step may stop.
    As a float32, tol would round to 0.25 and the fused loop stopped after 2 steps."""
    fit = sf.fuse(lambda w: jnp.sum(w), optax.sgd(0.25), steps=5, tol=0.25 - 1e-12)
    ref = sf.fuse(lambda w: jnp.sum(w), optax.sgd(0.25), steps=5, tol=0.25 - 1e-12, mode="stepwise")
    (_, trace), (_, expect) = (
        fit(
            fit.init(jnp.ones(1)),
        ),
        ref(ref.init(jnp.ones(1))),
    )
    assert trace.stop == expect.stop == Stop.STEPS and trace.steps == expect.steps == 5
    np.testing.assert_array_equal(trace.loss, expect.loss)


def test_grad_of_vmap_of_fit_needs_no_flag():
    fit = sf.fuse(quadratic, optax.sgd(0.02, momentum=0.5), steps=5)

    def final_loss(w0, target):
        return fit(fit.init(w0), target)[1].loss[-1]

    w0, target = jnp.array([[1.0, -2.0, 0.5], [0.3, 0.1, -1.0]]), jnp.array([0.5, 1.5, -0.5])
    got = jax.grad(lambda w: jnp.sum(jax.vmap(final_loss, (0, None))(w, target)))(w0)
    want = jnp.stack([jax.grad(final_loss)(w, target) for w in w0])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_differentiable_fit_compiles_once_for_every_steps():
    """API.md: any steps=n <= the built steps runs without recompiling, also for the
    reverse-differentiable scan (it compiled once per n)."""
    fit = sf.fuse(quadratic, optax.sgd(0.02), steps=8, differentiable=True)
    w0, target = jnp.array([1.0, -2.0, 0.5]), jnp.array([0.5, 1.5, -0.5])
    ref = sf.fuse(quadratic, optax.sgd(0.02), steps=8, mode="stepwise")
    for n in (1, 3, 8, 2):
        (_, trace), (_, expect) = (
            fit(fit.init(w0), target, steps=n),
            ref(ref.init(w0), target, steps=n),
        )
        assert trace.steps == n
        np.testing.assert_allclose(trace.loss, expect.loss, rtol=RTOL)
    assert fit._fused._cache_size() == 1  # one compiled program (jax.jit's own cache)
    grads = [
        jax.grad(lambda w: fit(fit.init(w), target, steps=n)[1].loss[n - 1])(w0) for n in (2, 5)
    ]
    assert not np.allclose(grads[0], grads[1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jit_closing_over_every_input_reraises_callback_errors_and_records_float32(dtype):
    """A low-precision loss runs under such a jit and its trace is float32, as on the host
    (docs/semantics.md); it was the loss's own dtype there."""
    seen = []

    def cb(step, loss):
        seen.append(step)
        if step == 4:
            raise RuntimeError("callback failed at step 4")

    fit = sf.fuse(quadratic, optax.sgd(0.1), steps=10, callback=cb, every=2)
    s0, target = fit.init(jnp.array([3.0, -2.0, 1.0], dtype)), jnp.array([1.0, 1.0, 1.0], dtype)
    with pytest.raises(Exception, match="callback failed at step 4"):
        jax.block_until_ready(jax.jit(lambda: fit(s0, target))())
    quiet = sf.fuse(quadratic, optax.sgd(0.1), steps=10)
    state, trace = jax.jit(lambda: quiet(quiet.init(jnp.array([3.0, -2.0, 1.0], dtype)), target))()
    assert int(trace.steps) == 10 and trace.loss.dtype == jnp.float32


def test_on_nonfinite_raise_under_jit_warns_that_it_cannot_raise():
    fit = sf.fuse(diverging_loss, optax.sgd(1e30), steps=20, on_nonfinite="raise")
    state = fit.init(jnp.array([1.0, 2.0]))
    with pytest.warns(RuntimeWarning, match="cannot raise inside jax.jit"):
        _, trace = jax.jit(fit)(state, jnp.ones(2), jnp.zeros(2))
    assert int(trace.stop) == Stop.NONFINITE


@pytest.mark.parametrize("transform", ["jit", "vmap", "grad"])
def test_stepwise_mode_inside_a_transform_is_refused_clearly(transform):
    """A Python loop of steps cannot run on tracers: a clear error instead of JAX's
    ConcretizationTypeError from deep inside the loop."""
    fit = sf.fuse(quadratic, optax.sgd(0.1), steps=3, mode="stepwise")
    w0, target = jnp.array([3.0, -2.0, 1.0]), jnp.zeros(3)
    call = {
        "jit": lambda: jax.jit(fit)(fit.init(w0), target),
        "vmap": lambda: jax.vmap(lambda w: fit(fit.init(w), target))(jnp.stack([w0, w0])),
        "grad": lambda: jax.grad(lambda w: fit(fit.init(w), target)[0].params.sum())(w0),
    }[transform]
    with pytest.raises(
        TypeError, match="mode='stepwise' cannot run inside jax.jit / jax.vmap / jax.grad"
    ):
        call()
    state, trace = fit(fit.init(w0), target)  # outside a transform it runs
    assert int(trace.steps) == 3


def run_script(tmp_path, source: str, **env) -> None:
    """Run ``source`` in a fresh Python on the CPU with ``env`` added (JAX's device count and
    x64 are fixed per process); it must print "ok" last."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_sharded_inputs_with_callbacks_and_one_model_per_device(tmp_path):
    """stepfuse's own host target has no sharding; inputs on several devices go through
    jax.debug.callback (XLA refused the program before); and one model per device under
    shard_map (the while_loop refused its carry). Two CPU devices, in a subprocess."""
    run_script(
        tmp_path,
        """
        import numpy as np, jax, jax.numpy as jnp, optax, stepfuse.jax as sf
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()), ("d",))
        x = jax.device_put(jnp.arange(32.0).reshape(8, 4) / 32, NamedSharding(mesh, P("d", None)))
        y = jax.device_put(jnp.arange(8.0) / 8, NamedSharding(mesh, P("d")))
        seen = []
        fit = sf.fuse(lambda w, x, y: jnp.mean((x @ w - y) ** 2), optax.adam(0.1), steps=6,
                      callback=lambda s, l: seen.append(s), every=2)
        plain = sf.fuse(lambda w, x, y: jnp.mean((x @ w - y) ** 2), optax.adam(0.1), steps=6)
        (_, a), (_, b) = fit(fit.init(jnp.zeros(4)), x, y), plain(plain.init(jnp.zeros(4)), x, y)
        assert len(jax.devices()) == 2 and a.steps == 6 and seen == [2, 4, 6], (a, seen)
        np.testing.assert_array_equal(a.loss, b.loss)
        # one model per device under shard_map (the carry starts varying over the mesh axis)
        opt, t = optax.adam(0.1), jnp.array([1.0, 1.0])
        loss = lambda w, t: jnp.sum((w - t) ** 2)
        per = sf.fuse(loss, opt, steps=5)
        run = jax.jit(jax.shard_map(lambda w: per(per.init(w[0]), t)[0].params[None], mesh=mesh,
                                    in_specs=P("d"), out_specs=P("d")))
        W = jnp.arange(4.0).reshape(2, 2)
        want = jnp.stack([per(per.init(w), t)[0].params for w in W])
        np.testing.assert_allclose(run(W), want, rtol=1e-6)
        print("ok")
    """,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )


def test_callbacks_get_float64_losses_whole_under_x64(tmp_path):
    """With jax_enable_x64, a float64 loss reaches the callback as float64 (it went as
    float32: rounded, and inf beyond float32's range), through stepfuse's host target
    and through jax.debug.callback (vmap). In a subprocess (x64 is process-wide)."""
    run_script(
        tmp_path,
        """
        import jax, jax.numpy as jnp, numpy as np, optax, stepfuse.jax as sf
        assert jax.config.jax_enable_x64
        for offset in (1e-10, 1e300):  # rounded away as float32; inf as float32
            seen = []
            fit = sf.fuse(lambda w: jnp.sum(w ** 2) + offset, optax.sgd(0.1), steps=4,
                          callback=lambda s, l: seen.append(l), every=1)
            _, trace = fit(fit.init(jnp.array([1.0], jnp.float64)))
            assert trace.loss.dtype == np.float64 and trace.steps == 4 and np.all(np.isfinite(trace.loss))
            np.testing.assert_array_equal(seen, trace.loss)  # the loss of each notified step
            seen.clear()
            jax.vmap(lambda s: fit(s)[1].loss)(jax.vmap(fit.init)(jnp.ones((1, 1), jnp.float64)))
            np.testing.assert_array_equal(seen, trace.loss)
        print("ok")
    """,
        JAX_ENABLE_X64="1",
    )


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
@pytest.mark.parametrize(
    "guarded",
    [
        pytest.param(lambda: optax.apply_if_finite(optax.adam(1e-2), 5), id="apply_if_finite"),
        pytest.param(lambda: optax.chain(optax.zero_nans(), optax.adam(1e-2)), id="zero_nans"),
        pytest.param(
            lambda: optax.MultiSteps(
                optax.adam(1e-2), 2, should_skip_update_fn=optax.skip_not_finite
            ),
            id="MultiSteps-skip_not_finite",
        ),
    ],
)
def test_an_optimizer_that_guards_its_gradients_goes_on_as_its_plain_loop(guarded, mode):
    """A NaN gradient on one minibatch (the loss masks the bad row, so it stays finite):
    optax.apply_if_finite and MultiSteps with skip_not_finite skip that update, zero_nans
    zeroes the NaNs, and the plain loop goes on; so does the fit, whose check leaves the gradients to the optimizer (the
    loss, parameters and state still checked)."""
    import stepfuse

    x, y = blobs()
    xs, ys = x[:48].reshape(6, 8, 2).copy(), y[:48].reshape(6, 8)
    xs[2, 0, 0] = np.nan

    def loss_fn(p, x, y):
        logits = x @ p["kernel"] + p["bias"]
        each = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        ok = jnp.isfinite(each)
        return jnp.sum(jnp.where(ok, each, 0.0)) / jnp.maximum(ok.sum(), 1)

    params = perceptron_init()
    tx = guarded()
    opt_state, p, ref = tx.init(params), params, []
    for i in range(6):
        value, g = jax.value_and_grad(loss_fn)(p, xs[i], ys[i])
        updates, opt_state = tx.update(g, opt_state, p)
        p = optax.apply_updates(p, updates)
        ref.append(float(value))
    assert not np.all(np.isfinite(jax.grad(loss_fn)(params, xs[2], ys[2])["kernel"]))

    fit = sf.fuse(loss_fn, guarded(), steps=6, mode=mode)
    state, trace = fit(fit.init(params), stepfuse.Batches(xs, ys))
    assert trace.steps == 6 and trace.stop is Stop.STEPS
    np.testing.assert_allclose(trace.loss, ref, rtol=RTOL, atol=ATOL)
    for u, v in zip(
        jax.tree_util.tree_leaves((state.params, state.opt_state)),
        jax.tree_util.tree_leaves((p, opt_state)),
    ):
        np.testing.assert_allclose(u, v, rtol=RTOL, atol=ATOL)
