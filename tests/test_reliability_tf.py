"""TF2 / TF1 reliability: numerical faults, checkpoints across processes, determinism, long runs.

Compared *bitwise* (``np.array_equal``) unless a tolerance is stated with its reason.
The one tolerance used: XLA (the fused loop) vs plain TF kernels (stepwise mode, eager
reference): XLA fuses the softmax-CE reduction and matmul differently, so float32
results differ by a few ulps (measured < 1e-6 relative); the project's contract bound.
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import stepfuse.tf as sf
import stepfuse.tf.v1 as v1
from stepfuse import NonFiniteError, Stop
from stepfuse.problems import blobs, perceptron_init
from stepfuse.tf import checkpoint

tf1 = tf.compat.v1
X, Y = blobs()
RTOL, ATOL = 1e-6, 1e-7


def ce(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def poison(t, cond, value):
    """``t`` unchanged forward; its gradient times ``value`` (NaN/inf/huge) where ``cond``."""

    @tf.custom_gradient
    def f(t):
        def grad(dy):
            return dy * tf.where(cond, tf.constant(value, dy.dtype), tf.constant(1.0, dy.dtype))

        return tf.identity(t), grad

    return f(t)


def arrays(vs):
    return [np.array(v.numpy()) for v in vs]


# -- 1. numerical faults (TF2) -------------------------------------------------------------

K = 7  # the step whose update the fault makes non-finite
FAULTS = (
    "loss_nan",
    "loss_inf",
    "grad_nan_bias",
    "grad_inf_kernel",
    "grad_huge_adam_overflow",
    "data_nan",
)


def faulty_setup(fault):
    """(variables, optimizer, loss_fn, batch, fault step): seed perceptron, Adam, a fault at step K."""
    p = perceptron_init()
    k, b = tf.Variable(p["kernel"]), tf.Variable(p["bias"])
    opt = keras.optimizers.Adam(0.05)
    x = X.copy()
    if fault == "data_nan":
        x[3, 1] = np.nan

    def loss_fn(x, y):
        at_k = tf.equal(opt.iterations, K)  # the global step of the update being proposed
        kk, bb = k, b
        if fault == "grad_nan_bias":
            bb = poison(b, at_k, np.nan)
        elif fault == "grad_inf_kernel":
            kk = poison(k, at_k, np.inf)
        elif fault == "grad_huge_adam_overflow":  # finite gradient, Adam's v = g^2 overflows
            kk = poison(k, at_k, 1e30)
        loss = ce(y, tf.matmul(x, kk) + bb)
        if fault in ("loss_nan", "loss_inf"):
            loss = loss + tf.where(at_k, np.nan if fault == "loss_nan" else np.inf, 0.0)
        return loss

    return [k, b], opt, loss_fn, (x, Y), (0 if fault == "data_nan" else K)


@pytest.mark.parametrize("fault", ["grad_inf_kernel", "grad_huge_adam_overflow"])
def test_tf2_xla_checks_large_tensors_each(fault):
    # Under XLA the checked tensors are grouped by shape, their masks and-ed
    # (`stepfuse.tf._loop._finite_by_shape`): a fault only in the 32 x 32 kernel's
    # gradient, or only in its Adam second moment, is caught all the same.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 32)).astype("float32")
    y = rng.integers(0, 32, 64).astype("int32")
    k0 = (rng.normal(size=(32, 32)) * 0.1).astype("float32")

    def setup():
        k, b = tf.Variable(k0), tf.Variable(np.zeros(32, "float32"))
        opt = keras.optimizers.Adam(0.05)

        def loss_fn(x, y):
            value = np.inf if fault == "grad_inf_kernel" else 1e30
            kk = poison(k, tf.equal(opt.iterations, K), value)
            return ce(y, tf.matmul(x, kk) + b)

        return [k, b], opt, loss_fn

    va, oa, la = setup()
    trace = sf.fuse(la, oa, va, steps=20, jit_compile=True)(x, y)
    assert trace.stop == Stop.NONFINITE and trace.steps == K and int(oa.iterations) == K
    vb, ob, lb = setup()
    ref = sf.fuse(lb, ob, vb, steps=20, mode="stepwise", jit_compile=True)(x, y)
    assert (ref.stop, ref.steps) == (trace.stop, trace.steps)
    for a, r in zip(arrays(va + list(oa.variables)), arrays(vb + list(ob.variables))):
        np.testing.assert_allclose(a, r, rtol=RTOL, atol=ATOL)
        assert np.all(np.isfinite(a))


def test_tf2_xla_finite_check_by_shape_finds_any_bad_value():
    # `_finite_by_shape` groups tensors of one shape (and-ed masks), flattens the small
    # groups into one reduction and reduces each large one alone: a NaN or inf in any one
    # tensor (shared or lone shape, small or large, float32 or float64) is found.
    from stepfuse.tf._loop import _all_finite, xla_traced

    shapes = [(), (40, 32), (40, 32), (40, 32), (7,), (7,), (3,), (600,), (5,)]
    kinds = ["float32"] * 7 + ["float64", "int32"]

    @tf.function(jit_compile=True, autograph=False)
    def check(*tensors):
        with xla_traced(True):
            return _all_finite(list(tensors))

    base = [np.ones(s, k) for s, k in zip(shapes, kinds)]
    assert bool(check(*base))
    for j, kind in enumerate(kinds[:-1]):
        for bad in (np.nan, np.inf, -np.inf):
            values = [b.copy() for b in base]
            values[j] = np.full(shapes[j], 1.0, kind)
            values[j].reshape(-1)[-1] = bad
            assert not bool(check(*values)), (shapes[j], kind, bad)


# Every fault under XLA; on TF's kernels CI runs the NaN loss and Adam's overflow, the
# others with --runslow (the same check, other kernels).
@pytest.mark.parametrize(
    "fault, jit",
    [pytest.param(f, True, id=f"{f}-xla") for f in FAULTS]
    + [
        pytest.param(
            f,
            False,
            id=f"{f}-tf-kernels",
            marks=() if f in ("loss_nan", "grad_huge_adam_overflow") else pytest.mark.slow,
        )
        for f in FAULTS
    ],
)
def test_tf2_fault_stops_before_the_bad_update_state_matches_stepwise_oracle(fault, jit):
    # Both loops: each checks finiteness its own way (`stepfuse.tf._loop._finite_probe`).
    va, oa, la, batch, step = faulty_setup(fault)
    fit = sf.fuse(la, oa, va, steps=20, jit_compile=jit)
    trace = fit(*batch)
    assert trace.stop == Stop.NONFINITE and trace.steps == step == fit.step
    assert len(trace.loss) == step + 1 and np.all(np.isfinite(trace.loss[:-1]))
    assert int(oa.iterations) == step
    # Stepwise oracle: the same semantics as a Python loop of guarded single steps.
    vb, ob, lb, batch_b, _ = faulty_setup(fault)
    ref = sf.fuse(lb, ob, vb, steps=20, mode="stepwise")(*batch_b)
    assert (ref.stop, ref.steps) == (trace.stop, trace.steps)
    np.testing.assert_allclose(trace.loss[:-1], ref.loss[:-1], rtol=RTOL, atol=ATOL)
    for a, r in zip(arrays(va + list(oa.variables)), arrays(vb + list(ob.variables))):
        np.testing.assert_allclose(a, r, rtol=RTOL, atol=ATOL)
        assert np.all(np.isfinite(a))
    # Eager oracle: Keras' own apply_gradients stepped exactly `step` times without the fault.
    vc, oc, _, _, _ = faulty_setup("none")
    for _ in range(step):
        with tf.GradientTape() as tape:
            loss = ce(Y, tf.matmul(tf.constant(X), vc[0]) + vc[1])
        oc.apply_gradients(zip(tape.gradient(loss, vc), vc))
    for a, r in zip(arrays(va + list(oa.variables)), arrays(vc + list(oc.variables))):
        np.testing.assert_allclose(a, r, rtol=RTOL, atol=ATOL)
    # The fault is still there: the next call refuses the same update and changes nothing.
    before = arrays(va + list(oa.variables))
    again = fit(*batch)
    assert again.steps == 0 and again.stop == Stop.NONFINITE and fit.step == step
    for a, r in zip(arrays(va + list(oa.variables)), before):
        np.testing.assert_array_equal(a, r)


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
@pytest.mark.parametrize("fault", ["grad_nan_bias", "loss_inf"])
def test_tf2_on_nonfinite_raise_reports_the_step(fault, mode):
    va, oa, la, batch, step = faulty_setup(fault)
    fit = sf.fuse(la, oa, va, steps=20, on_nonfinite="raise", mode=mode)
    fit(*batch, steps=3)  # 3 good steps first: the error's step is global
    with pytest.raises(NonFiniteError, match=f"step {K}") as err:
        fit(*batch)
    assert err.value.step == K and err.value.trace.steps == K - 3 and fit.step == K
    assert int(oa.iterations) == K and all(
        np.all(np.isfinite(a)) for a in arrays(va + list(oa.variables))
    )


# -- 1b. numerical faults (TF1) ------------------------------------------------------------


def tf1_faulty(fault, kind="fused", thr=None, **kw):
    """TF1 seed perceptron with Momentum; the fault fires once the clean loss drops below ``thr``."""
    p = perceptron_init()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")

        def loss_fn():
            k = tf1.get_variable("kernel", initializer=p["kernel"])
            b = tf1.get_variable("bias", initializer=p["bias"])
            clean = ce(y, tf.matmul(x, k) + b)
            bad = tf.less(tf.stop_gradient(clean), thr if thr is not None else -1.0)
            if fault == "grad_nan_bias":
                return ce(y, tf.matmul(x, k) + poison(b, bad, np.nan))
            if fault == "loss_nan":
                return clean + tf.where(bad, np.nan, 0.0)
            return clean

        fused = v1.fuse(loss_fn, tf1.train.MomentumOptimizer(0.1, 0.9), steps=20, mode=kind, **kw)
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=g)
    sess.run(init)
    return sess, fused, {x: X, y: Y}


def _tf1_threshold():
    sess, fused, feed = tf1_faulty("none", "stepwise")
    losses = fused.run(sess, feed, steps=8).loss
    assert np.all(np.diff(losses) < 0)  # decreasing: the fault fires first at step 5
    return float((losses[4] + losses[5]) / 2), 5


@pytest.mark.parametrize("fault", ["loss_nan", "grad_nan_bias", "data_nan"])
def test_tf1_fault_stops_before_the_bad_update_state_matches_stepwise_oracle(fault):
    thr, step = _tf1_threshold()
    if fault == "data_nan":
        thr, step = None, 0
    sess, fused, feed = tf1_faulty(fault, "fused", thr)
    sr, ref, feed_r = tf1_faulty(fault, "stepwise", thr)
    if fault == "data_nan":
        bad_x = X.copy()
        bad_x[3, 1] = np.nan
        feed = {k: (bad_x if v is X else v) for k, v in feed.items()}
        feed_r = {k: (bad_x if v is X else v) for k, v in feed_r.items()}
    before = sess.run(fused.state)
    trace, expect = fused.run(sess, feed), ref.run(sr, feed_r)
    assert trace.stop == expect.stop == Stop.NONFINITE and trace.steps == expect.steps == step
    np.testing.assert_allclose(trace.loss[:-1], expect.loss[:-1], rtol=RTOL, atol=ATOL)
    for a, r in zip(sess.run(fused.state), sr.run(ref.state)):  # variables + momentum slots
        np.testing.assert_allclose(a, r, rtol=RTOL, atol=ATOL)
        assert np.all(np.isfinite(a))
    if step == 0:
        for a, r in zip(sess.run(fused.state), before):
            np.testing.assert_array_equal(a, r)


def test_tf1_on_nonfinite_raise():
    thr, step = _tf1_threshold()
    sess, fused, feed = tf1_faulty("grad_nan_bias", "fused", thr, on_nonfinite="raise")
    fused.run(sess, feed, steps=2)
    with pytest.raises(NonFiniteError) as err:
        fused.run(sess, feed)
    assert err.value.step == step and err.value.trace.steps == step - 2 and fused.step == step
    assert all(np.all(np.isfinite(a)) for a in sess.run(fused.state))


# -- 2. checkpoints ------------------------------------------------------------------------

PROBLEM_SRC = textwrap.dedent(
    """
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras, numpy as np, tensorflow as tf
    import stepfuse.tf as sf
    from stepfuse.tf import checkpoint
    from stepfuse.problems import blobs, mlp_init

    X, Y = blobs()

    def make_fit(steps):
        variables = []
        for layer in mlp_init((2, 16, 2)):
            variables += [tf.Variable(layer["kernel"]), tf.Variable(layer["bias"])]

        def loss_fn(x, y):
            h = tf.tanh(tf.matmul(x, variables[0]) + variables[1])
            logits = tf.matmul(h, variables[2]) + variables[3]
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

        # XLA given: left to jit_compile="auto", two fits (or processes) may keep different
        # loops by timing, which round differently, and these tests compare bits.
        return sf.fuse(
            loss_fn, keras.optimizers.Adam(0.01), variables, steps=steps, jit_compile=True
        )
    """
)
_ns: dict = {}
exec(PROBLEM_SRC, _ns)
make_fit = _ns["make_fit"]
N = 25


def fit_state(fit):
    return arrays(list(fit.variables) + list(fit.optimizer.variables))


def test_checkpoint_restored_in_a_new_process_continues_bitwise(tmp_path):
    ref = make_fit(2 * N)
    ref_trace = ref(X, Y)
    assert ref_trace.steps == 2 * N and ref_trace.stop == Stop.STEPS
    fit = make_fit(2 * N)
    t1 = fit(X, Y, steps=N)
    prefix = checkpoint.save(tmp_path / "half", fit)
    out = tmp_path / "final"
    script = PROBLEM_SRC + textwrap.dedent(
        f"""
        fit = make_fit({2 * N})
        checkpoint.restore({prefix!r}, fit)
        assert fit.step == {N} and int(fit.optimizer.iterations) == {N}, fit.step
        trace = fit(X, Y, steps={N})
        checkpoint.save({str(out)!r}, fit)
        np.savez({str(tmp_path / "losses.npz")!r}, loss=trace.loss, steps=trace.steps, stop=int(trace.stop))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = make_fit(2 * N)
    checkpoint.restore(str(out), final)
    with np.load(tmp_path / "losses.npz", allow_pickle=False) as f:
        t2_loss, t2_steps, t2_stop = f["loss"], int(f["steps"]), int(f["stop"])
    assert (t2_steps, t2_stop) == (N, Stop.STEPS) and final.step == 2 * N == ref.step
    for a, b in zip(fit_state(final), fit_state(ref)):  # variables, Adam m/v, iterations, lr
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert np.array_equal(np.concatenate([t1.loss, t2_loss]), ref_trace.loss)


def test_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path):
    fit = make_fit(3)
    fit(X, Y)
    prefix = checkpoint.save(tmp_path / "mlp", fit)
    p = perceptron_init()
    k, b = tf.Variable(p["kernel"]), tf.Variable(p["bias"])
    other = sf.fuse(
        lambda x, y: ce(y, tf.matmul(x, k) + b), keras.optimizers.Adam(0.01), [k, b], steps=3
    )
    before = fit_state(other)
    with pytest.raises(ValueError, match="`path`.*Nothing was restored"):
        checkpoint.restore(prefix, other)
    for a, r in zip(fit_state(other), before):
        np.testing.assert_array_equal(a, r)
    assert other.step == 0
    with pytest.raises(FileNotFoundError, match="`path`"):
        checkpoint.restore(tmp_path / "missing", fit)
    # tf.train.Checkpoint files are tensors + an object graph of names: no code to run.
    names = [n for n, _ in tf.train.list_variables(prefix)]
    assert "step/.ATTRIBUTES/VARIABLE_VALUE" in names and any("optimizer" in n for n in names)


def test_tf1_saver_round_trip_bitwise(tmp_path):
    sess, fused, feed = tf1_faulty("none", "fused", jit_compile=True)
    ref_s, ref, ref_feed = tf1_faulty("none", "fused", jit_compile=True)
    ref_losses = np.concatenate(
        [ref.run(ref_s, ref_feed, steps=6).loss, ref.run(ref_s, ref_feed, steps=6).loss]
    )
    first = fused.run(sess, feed, steps=6).loss
    with sess.graph.as_default():  # Saver.save/restore must run in the loop's graph
        path = checkpoint.saver(fused).save(sess, str(tmp_path / "v1"))
    sess2, fused2, feed2 = tf1_faulty("none", "fused", jit_compile=True)
    with sess2.graph.as_default():
        checkpoint.saver(fused2).restore(sess2, path)
    second = fused2.run(sess2, feed2, steps=6).loss
    assert np.array_equal(np.concatenate([first, second]), ref_losses)
    for a, b in zip(sess2.run(fused2.state), ref_s.run(ref.state)):
        assert np.array_equal(a, b)


# -- 3. determinism ------------------------------------------------------------------------

SPLITS = ((12,), (4, 4, 4), (1,) * 12)


def _run_splits(split, jit=True, mode="fused", build_steps=12):
    fit = (
        make_fit(build_steps) if (jit and mode == "fused") else _make_fit_kw(build_steps, jit, mode)
    )
    losses = np.concatenate([fit(X, Y, steps=n).loss for n in split])
    return losses, fit_state(fit)


def _make_fit_kw(steps, jit, mode):
    fit = make_fit(steps)
    return sf.fuse(
        fit.loss_fn,
        keras.optimizers.Adam(0.01),
        fit.variables,
        steps=steps,
        jit_compile=jit,
        mode=mode,
    )


@pytest.mark.parametrize("jit", [True, False], ids=["xla", "noxla"])
def test_tf2_same_inputs_same_bits_and_splits_are_bitwise(jit):
    runs = [_run_splits(split, jit) for split in SPLITS + (SPLITS[0],)]
    base_losses, base_state = runs[0]
    for losses, state in runs[1:]:  # 1x12 twice, 3x4, 12x1: all bitwise equal
        assert np.array_equal(losses, base_losses)
        assert all(np.array_equal(a, b) for a, b in zip(state, base_state))
    # A fit built with steps=1 (same chunk size, same program) called 12 times: bitwise too.
    losses, state = _run_splits((1,) * 12, jit, build_steps=1)
    assert np.array_equal(losses, base_losses) and all(
        np.array_equal(a, b) for a, b in zip(state, base_state)
    )


def test_tf2_fused_vs_stepwise_within_1e6_xla_rounding():
    fused_losses, fused_state = _run_splits((4, 4, 4))
    step_losses, step_state = _run_splits((4, 4, 4), mode="stepwise")
    noxla_losses, noxla_state = _run_splits((4, 4, 4), jit=False)
    noxla_step_losses, noxla_step_state = _run_splits((4, 4, 4), jit=False, mode="stepwise")
    np.testing.assert_allclose(fused_losses, step_losses, rtol=RTOL, atol=ATOL)
    for a, b in zip(fused_state, step_state):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    # Without XLA the fused loop runs the same TF kernels as the stepwise step: bitwise.
    assert np.array_equal(noxla_losses, noxla_step_losses)
    assert all(np.array_equal(a, b) for a, b in zip(noxla_state, noxla_step_state))


def test_tf1_same_inputs_same_bits_and_splits_are_bitwise():
    results = []
    for split in SPLITS + (SPLITS[0],):
        # One loop given: left to jit_compile="auto", each graph's first run times XLA
        # against TF's kernels and may keep either, which round differently.
        sess, fused, feed = tf1_faulty("none", "fused", jit_compile=True)
        losses = np.concatenate([fused.run(sess, feed, steps=n).loss for n in split])
        results.append((losses, sess.run(fused.state)))
    for losses, state in results[1:]:
        assert np.array_equal(losses, results[0][0])
        assert all(np.array_equal(a, b) for a, b in zip(state, results[0][1]))


# -- 4. long runs --------------------------------------------------------------------------


def test_long_run_20000_steps_thinned_trace():
    p = perceptron_init()
    k, b = tf.Variable(p["kernel"]), tf.Variable(p["bias"])
    opt = keras.optimizers.SGD(0.01)
    fit = sf.fuse(
        lambda x, y: ce(y, tf.matmul(x, k) + b), opt, [k, b], steps=20_000, record_every=1000
    )
    trace = fit(X, Y)
    assert trace.steps == 20_000 and trace.stop == Stop.STEPS and len(trace.loss) == 20
    assert list(trace.index[:3]) == [0, 1000, 2000] and np.all(np.isfinite(trace.loss))
    assert np.all(np.diff(trace.loss) < 0) and int(opt.iterations) == fit.step == 20_000
    assert fit.traces == 1
