"""stepfuse.tf (TF2 / Keras): equivalence with GradientTape training, no retrace, stops, errors."""

import math
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NOTIFICATION_CASES, assert_tol_stops_where_the_recorded_losses_say
from tf_helpers import LN2, OPTIMIZERS, Perceptron, make_problem, reference_steps, seed_data, values

import stepfuse.tf as sf
from stepfuse import NonFiniteError, Stop

# float32 on CPU: XLA fuses/reassociates reductions, so single losses differ by ~1 ulp from
# eager TF (e.g. ln 2 = 0.6931474 vs 0.6931472); rtol=1e-6 is the project's contract.
RTOL, ATOL = 1e-6, 1e-7
CALLS = (3, 1, 5)  # several calls with different steps, one program


@pytest.fixture(scope="module")
def data():
    x, y = seed_data()
    return tf.constant(x), tf.constant(y)


@pytest.mark.parametrize("jit", [True, False], ids=["xla", "noxla"])
@pytest.mark.parametrize("problem", ["perceptron", "mlp"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_fused_equals_gradient_tape_loop(opt, problem, jit, data):
    x, y = data
    _, ref_vars, ref_loss = make_problem(problem)
    ref_opt = OPTIMIZERS[opt]()
    ref_losses = reference_steps(ref_loss, ref_opt, ref_vars, x, y, sum(CALLS))

    _, variables, loss_fn = make_problem(problem)
    optimizer = OPTIMIZERS[opt]()
    fit = sf.fuse(loss_fn, optimizer, variables, steps=max(CALLS), jit_compile=jit)
    losses = []
    for n in CALLS:
        trace = fit(x, y, steps=n)
        assert trace.steps == n and trace.stop == Stop.STEPS and trace.loss.shape == (n,)
        losses.append(trace.loss)
    np.testing.assert_allclose(np.concatenate(losses), ref_losses, rtol=RTOL, atol=ATOL)
    for a, b in zip(values(variables), values(ref_vars)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    for a, b in zip(values(optimizer.variables), values(ref_opt.variables)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    assert int(optimizer.iterations) == sum(CALLS) == fit.step
    assert fit.traces == 1
    if problem == "perceptron":
        assert abs(losses[0][0] - LN2) < 1e-6


# float64 (the same comparison in the loss's dtype) runs with --runslow.
@pytest.mark.parametrize(
    "dtype",
    [tf.float32, pytest.param(tf.float64, marks=pytest.mark.slow)],
    ids=["float32", "float64"],
)
def test_tol_at_the_last_bit_stops_where_the_recorded_losses_say(dtype, data):
    x, y = tf.cast(data[0], dtype), data[1]

    def run(tol):
        one = Perceptron(dtype=dtype)
        fit = sf.fuse(
            lambda x, y: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, one(x))),
            keras.optimizers.Adam(0.05),
            one,
            steps=60,
            tol=tol,
        )
        return fit(x, y)

    # one difference (three tols, a fit traced for each): JAX's test runs two
    assert_tol_stops_where_the_recorded_losses_say(run, run(None).loss, at=(20,))


@pytest.mark.parametrize("jit", [True, False], ids=["xla", "noxla"])
def test_float64_losses_stay_float64_and_tol_compares_them(jit, data):
    """Consecutive losses 5e-8 apart, tol=1e-8: a float32 copy of the losses would round
    them equal and stop with TOL after a few steps; the GradientTape loop runs all 20."""
    x, y = tf.cast(data[0], tf.float64), data[1]

    def build():
        k = tf.Variable(tf.ones((2, 2), tf.float64))
        b = tf.Variable(tf.zeros((2,), tf.float64))
        return [k, b], lambda x, y: tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.matmul(x, k) + b)
        )

    ref_vars, ref_loss = build()
    ref = reference_steps(ref_loss, keras.optimizers.SGD(1e-6), ref_vars, x, y, 20)
    assert np.all(np.abs(np.diff(ref)) > 1e-8)
    variables, loss_fn = build()
    trace = sf.fuse(
        loss_fn, keras.optimizers.SGD(1e-6), variables, steps=20, tol=1e-8, jit_compile=jit
    )(x, y)
    assert trace.stop == Stop.STEPS and trace.steps == 20 and trace.loss.dtype == np.float64
    np.testing.assert_allclose(trace.loss, ref, rtol=1e-12)
    one = Perceptron()  # a float32 loss keeps a float32 trace
    fit = sf.fuse(
        lambda x, y: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, one(x))),
        keras.optimizers.SGD(0.01),
        one,
        steps=3,
        jit_compile=jit,
    )
    assert fit(*data).loss.dtype == np.float32


@pytest.mark.parametrize("mode, jit", [("fused", True), ("fused", False), ("stepwise", False)])
def test_refused_step_leaves_batchnorm_statistics_as_before_it(mode, jit, data):
    """A NaN in the batch makes the forward pass write NaN moving statistics before the
    update is refused: they are put back with the parameters (the model was passed whole)."""
    x, y = data
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(2),
        ]
    )
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    fit = sf.fuse(
        lambda a, b: ce(b, model(a, training=True)),
        keras.optimizers.Adam(0.01),
        model,
        steps=3,
        mode=mode,
        jit_compile=jit,
    )
    assert fit(x, y).steps == 3
    before = values(model.variables)
    bad = x.numpy().copy()
    bad[0, 0] = np.nan
    trace = fit(bad, y)
    assert trace.stop == Stop.NONFINITE and trace.steps == 0
    for a, b in zip(values(model.variables), before):
        np.testing.assert_array_equal(a, b)
    assert fit(x, y).stop == Stop.STEPS and np.isfinite(float(ce(y, model(x, training=False))))


def test_seed_table_three_step_rows_equal_every_third_one_step_row(data):
    x, y = data
    one = Perceptron()
    fit1 = sf.fuse(
        lambda x, y: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, one(x))),
        keras.optimizers.SGD(0.01),
        one,
        steps=1,
    )
    rows1 = [fit1(x, y).loss[0] for _ in range(30)]
    three = Perceptron()
    fit3 = sf.fuse(
        lambda x, y: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, three(x))),
        keras.optimizers.SGD(0.01),
        three,
        steps=3,
    )
    rows3 = [fit3(x, y).loss[0] for _ in range(10)]
    np.testing.assert_allclose(rows3, rows1[::3], rtol=RTOL, atol=1e-6)
    assert abs(rows1[0] - LN2) < 1e-6 and rows3[1] < rows3[0]


def test_no_retrace_across_steps_and_new_batch_values(data):
    x, y = data
    model, variables, loss_fn = make_problem("perceptron")
    runs = []

    def counted(x, y):
        runs.append(1)
        return loss_fn(x, y)

    fit = sf.fuse(counted, keras.optimizers.Adam(0.01), variables, steps=4)
    fit(x, y)
    first = len(runs)
    rng = np.random.default_rng(1)
    for n in (1, 7, 50, 4):
        fit(tf.constant(rng.standard_normal(x.shape).astype(np.float32)), y, steps=n)
    fit(x.numpy(), y.numpy(), steps=2)
    assert fit.traces == 1 and len(runs) == first
    assert fit.step == 4 + 1 + 7 + 50 + 4 + 2


def test_each_batch_signature_traces_once_and_runs_its_own_program(data):
    # Calls go to the concrete function traced for the batch's dtypes and shapes: a new
    # shape traces once more and runs its own program; the old shape still runs its own.
    x, y = data
    _, va, la = make_problem("perceptron")
    _, vb, lb = make_problem("perceptron")
    fit = sf.fuse(la, keras.optimizers.SGD(0.1), va, steps=5)
    ref = sf.fuse(lb, keras.optimizers.SGD(0.1), vb, steps=5, mode="stepwise")
    for xs, ys, traces in ((x, y, 1), (x[:20], y[:20], 2), (x, y, 2), (x[:20], y[:20], 2)):
        got, want = fit(xs, ys), ref(xs, ys)
        np.testing.assert_allclose(got.loss, want.loss, rtol=RTOL, atol=ATOL)
        assert fit.traces == traces
    with tf.GradientTape():  # a tape the caller left open does not change the call
        np.testing.assert_allclose(fit(x, y).loss, ref(x, y).loss, rtol=RTOL, atol=ATOL)
    for a, b in zip(values(va), values(vb)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_stepwise_mode_is_the_same_loop(data):
    x, y = data
    _, va, la = make_problem("mlp")
    _, vb, lb = make_problem("mlp")
    fa = sf.fuse(la, keras.optimizers.Adam(0.05), va, steps=5, record_every=2)
    fb = sf.fuse(lb, keras.optimizers.Adam(0.05), vb, steps=5, record_every=2, mode="stepwise")
    for n in (5, 3):
        ta, tb = fa(x, y, steps=n), fb(x, y, steps=n)
        assert ta.steps == tb.steps == n and len(ta.loss) == len(tb.loss) == math.ceil(n / 2)
        np.testing.assert_allclose(ta.loss, tb.loss, rtol=RTOL, atol=ATOL)
    for a, b in zip(values(va), values(vb)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("jit", [True, False], ids=["xla", "noxla"])
def test_dropout_draws_the_same_masks_in_both_modes(jit, data):
    """The stepwise step is XLA-compiled when the fused loop is, so random ops draw alike
    (XLA's random numbers differ from TF's: the masks differed between the modes)."""
    x, y = data
    out = {}
    for mode in ("fused", "stepwise"):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((2,))
        hidden = keras.layers.Dropout(0.3, seed=1)(keras.layers.Dense(8, activation="relu")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
        loss_fn = lambda x, y, model=model: tf.reduce_mean(  # noqa: E731
            tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x, training=True))
        )
        fit = sf.fuse(
            loss_fn, keras.optimizers.SGD(0.05), model, steps=4, jit_compile=jit, mode=mode
        )
        out[mode] = np.concatenate([fit(x, y).loss, fit(x, y, steps=2).loss])
    np.testing.assert_allclose(out["fused"], out["stepwise"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_an_op_xla_cannot_compile_falls_back_with_a_warning_at_the_call(mode, data):
    x, y = data
    _, ref_vars, ref_loss = make_problem("perceptron")
    ref = reference_steps(ref_loss, keras.optimizers.SGD(0.1), ref_vars, x, y, 4)
    _, variables, loss_fn = make_problem("perceptron")

    def with_host_op(x, y):  # a Python function on the host: XLA refuses it
        count = tf.reshape(
            tf.numpy_function(lambda v: np.int64(v.size), [y], tf.int64, stateful=False), []
        )
        return loss_fn(x, y) + 0.0 * tf.cast(count, tf.float32)

    fit = sf.fuse(
        with_host_op, keras.optimizers.SGD(0.1), variables, steps=3, mode=mode, jit_compile=True
    )
    with pytest.warns(RuntimeWarning, match="could not be XLA-compiled") as caught:
        losses = list(fit(x, y).loss)
    assert caught[0].filename == __file__ and not fit.jit_compile
    assert fit.plan["xla"] is False and "XLA could not compile" in fit.plan["reason"]
    losses += list(fit(x, y, steps=1).loss)
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_auto_runs_without_xla_where_it_cannot_compile_and_says_why(mode, data):
    """jit_compile="auto" (the default) takes the loop XLA cannot compile to TensorFlow's
    kernels without a warning; fit.plan names the cause."""
    x, y = data
    _, ref_vars, ref_loss = make_problem("perceptron")
    ref = reference_steps(ref_loss, keras.optimizers.SGD(0.1), ref_vars, x, y, 3)
    _, variables, loss_fn = make_problem("perceptron")

    def with_host_op(x, y):
        count = tf.numpy_function(lambda v: np.float32(0.0), [y], tf.float32, stateful=False)
        return loss_fn(x, y) + tf.reshape(count, [])

    fit = sf.fuse(with_host_op, keras.optimizers.SGD(0.1), variables, steps=3, mode=mode)
    assert fit.plan["xla"] is (None if mode == "fused" else True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = fit(x, y)
    assert not fit.jit_compile and fit.plan["xla"] is False
    assert "compile" in fit.plan["reason"]
    np.testing.assert_allclose(trace.loss, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_nested_batches_reach_loss_fn_as_given(mode, data):
    """A dict or a tuple of tensors of different dtypes as one batch argument, as Keras
    users pass them (they were converted to one tensor: refused or stacked)."""
    x, y = data
    _, ref_vars, ref_loss = make_problem("perceptron")
    ref = reference_steps(ref_loss, keras.optimizers.SGD(0.1), ref_vars, x, y, 5)
    _, variables, loss_fn = make_problem("perceptron")
    fit = sf.fuse(
        lambda b: loss_fn(b["x"], b["y"]), keras.optimizers.SGD(0.1), variables, steps=3, mode=mode
    )
    losses = np.concatenate([fit({"x": x, "y": y}).loss, fit({"x": x, "y": y}, steps=2).loss])
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
    for a, b in zip(values(variables), values(ref_vars)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    if mode == "fused":
        assert fit.traces == 1
    pairs = sf.fuse(
        lambda xy: loss_fn(*xy), keras.optimizers.SGD(0.1), variables, steps=2, mode=mode
    )
    assert pairs((x, y)).steps == 2  # float32 and int32 tensors in one tuple
    with pytest.raises(TypeError, match="`batch` must hold dense tensors; got a SparseTensor"):
        fit({"x": tf.sparse.from_dense(x), "y": y})


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_a_learning_rate_replaced_between_calls_is_used(mode, data):
    """``optimizer.learning_rate = schedule`` replaces the variable the traced programs
    read: they are traced again (the old rate was used silently)."""
    x, y = data
    new_rate = lambda: keras.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5)  # noqa: E731
    _, ref_vars, ref_loss = make_problem("perceptron")
    ref_opt = keras.optimizers.SGD(0.1)
    ref = list(reference_steps(ref_loss, ref_opt, ref_vars, x, y, 2))
    ref_opt.learning_rate = new_rate()
    ref += list(reference_steps(ref_loss, ref_opt, ref_vars, x, y, 3))
    _, variables, loss_fn = make_problem("perceptron")
    opt = keras.optimizers.SGD(0.1)
    fit = sf.fuse(loss_fn, opt, variables, steps=3, mode=mode)
    losses = list(fit(x, y, steps=2).loss)
    opt.learning_rate = new_rate()
    losses += list(fit(x, y).loss)
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
    for a, b in zip(values(variables), values(ref_vars)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_python_number_hyper_parameters_changed_between_calls_are_used(data):
    """Adam's ``beta_1`` and SGD's ``momentum`` are Python numbers Keras reads when its update
    is traced: changed between calls, the fit traces again and equals the eager loop (the
    old values were used silently, as a tf.function loop uses them); changed in a callback,
    a warning says they hold from the next call. A NumPy number, and an optimizer that a
    ``MultiOptimizer`` wraps, are followed too."""
    x, y = data
    cases = (
        (keras.optimizers.Adam, "beta_1", 0.5),
        (_momentum, "momentum", 0),
        (
            lambda rate: keras.optimizers.Adam(rate, beta_1=np.float64(0.9)),
            "beta_1",
            np.float64(0.5),
        ),
        (_wrapped, "inner_optimizers[0].beta_1", 0.5),
    )
    for make, name, value in cases:
        _, ref_vars, ref_loss = make_problem("perceptron")
        ref_opt = make(0.1)
        ref = list(reference_steps(ref_loss, ref_opt, ref_vars, x, y, 2))
        _set(ref_opt, name, value)
        ref += list(reference_steps(ref_loss, ref_opt, ref_vars, x, y, 3))
        _, variables, loss_fn = make_problem("perceptron")
        opt = make(0.1)
        fit = sf.fuse(loss_fn, opt, variables, steps=3, jit_compile=False)
        losses = list(fit(x, y, steps=2).loss)
        _set(opt, name, value)
        with pytest.warns(RuntimeWarning, match=rf"hyper-parameters \({re.escape(name)}: .* again"):
            losses += list(fit(x, y).loss)
        np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
        for a, b in zip(values(variables), values(ref_vars)):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    opt = keras.optimizers.Adam(0.1)
    _, variables, loss_fn = make_problem("perceptron")
    every = sf.fuse(
        loss_fn,
        opt,
        variables,
        steps=3,
        jit_compile=False,
        every=1,
        callback=lambda step, loss: setattr(opt, "beta_1", 0.2),
    )
    with pytest.warns(RuntimeWarning, match=r"\(beta_1: 0.9 -> 0.2\) changed in the callback"):
        every(x, y)


def _momentum(rate):
    return keras.optimizers.SGD(rate, momentum=0.9)


def _wrapped(rate):
    inner = keras.optimizers.Adam(rate)
    return keras.optimizers.MultiOptimizer(lambda variable: inner)


def _set(optimizer, name, value):
    """``optimizer.<name> = value``, ``name`` as the warning says it (``inner_optimizers[0].x``)."""
    if name.startswith("inner_optimizers[0]."):
        optimizer, name = optimizer._inner_optimizers[0], name.split(".", 1)[1]
    setattr(optimizer, name, value)


@pytest.mark.parametrize("make", [keras.optimizers.Nadam, keras.optimizers.Adafactor])
def test_the_optimizer_is_built_under_its_name_as_apply_gradients_builds_it(make):
    """Nadam and Adafactor make variables of their own in ``build``: their paths carry the
    optimizer's name, as when ``apply_gradients`` builds it (state keyed by path)."""
    _, variables, loss_fn = make_problem("perceptron")
    opt = make(0.01)
    sf.fuse(loss_fn, opt, variables, steps=2)
    assert opt.built
    assert all(v.path.startswith(opt.name + "/") for v in opt.variables), [
        v.path for v in opt.variables
    ]


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_tol_stops_early_like_the_stepwise_oracle(mode, data):
    x, y = data
    _, va, la = make_problem("perceptron")
    _, vb, lb = make_problem("perceptron")
    fit = sf.fuse(la, keras.optimizers.SGD(0.5), va, steps=500, tol=1e-4, mode=mode)
    ref = sf.fuse(lb, keras.optimizers.SGD(0.5), vb, steps=500, tol=1e-4, mode="stepwise")
    trace, expect = fit(x, y), ref(x, y)
    assert trace.stop == expect.stop == Stop.TOL
    assert 1 < trace.steps == expect.steps < 500
    assert abs(trace.loss[-1] - trace.loss[-2]) <= 1e-4 and len(trace.loss) == trace.steps
    np.testing.assert_allclose(trace.loss, expect.loss, rtol=RTOL, atol=ATOL)


def _quadratic(start, dtype=np.float32):
    w = tf.Variable(np.asarray(start, dtype))
    return w, (lambda: tf.reduce_sum(w * w))


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_nonfinite_loss_stops_without_applying(mode):
    # SGD lr=10 on sum(w^2): w <- -19 w, the loss overflows float32 after a few dozen steps.
    w, loss = _quadratic([1.0, -2.0])
    opt = keras.optimizers.SGD(10.0, momentum=0.5)
    fit = sf.fuse(loss, opt, [w], steps=100, mode=mode)
    trace = fit()
    assert trace.stop == Stop.NONFINITE and 0 < trace.steps < 100
    assert not np.isfinite(trace.loss[-1]) and len(trace.loss) == trace.steps + 1
    # The oracle: the same optimizer stepped eagerly exactly trace.steps times.
    w_ref, loss_ref = _quadratic([1.0, -2.0])
    opt_ref = keras.optimizers.SGD(10.0, momentum=0.5)
    reference_steps(lambda *_: loss_ref(), opt_ref, [w_ref], None, None, trace.steps)
    np.testing.assert_array_equal(w.numpy(), w_ref.numpy())
    for a, b in zip(values(opt.variables), values(opt_ref.variables)):
        np.testing.assert_array_equal(a, b)
    assert int(opt.iterations) == trace.steps == fit.step
    assert np.all(np.isfinite(w.numpy()))
    again = fit(steps=5)  # starts finite, refuses the same update again
    assert again.steps == 0 and again.stop == Stop.NONFINITE and fit.step == trace.steps


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_nonfinite_proposed_update_is_refused_and_raise_mode(mode):
    # Finite loss and gradient, but lr=1e30 makes the new parameters inf: nothing changes.
    w, loss = _quadratic([1e9, 1e9])
    opt = keras.optimizers.SGD(1e30, momentum=0.9)
    fit = sf.fuse(loss, opt, [w], steps=10, mode=mode, on_nonfinite="raise")
    slots = values(opt.variables)
    with pytest.raises(NonFiniteError) as err:
        fit()
    assert err.value.step == 0 and err.value.trace.steps == 0
    np.testing.assert_array_equal(w.numpy(), [1e9, 1e9])
    for a, b in zip(values(opt.variables), slots):
        np.testing.assert_array_equal(a, b)
    assert int(opt.iterations) == 0


@pytest.mark.parametrize(
    "jit", [None, True, False, "fit"], ids=["eager", "xla", "graph", "xla-by-shape"]
)
def test_finiteness_check_is_exact_for_large_values_mixed_dtypes_and_sparse_gradients(jit):
    # "fit": compiled as the fit's XLA loop compiles its steps (`xla_traced`: the check by
    # shape, `_finite_by_shape`); the others: the check of TensorFlow's kernels.
    from stepfuse.tf._loop import _all_finite, xla_traced

    big = tf.constant([3e38, 3e38, -3e38], tf.float32)  # finite, though their sum overflows
    half = tf.constant([6e4, 1.0], tf.float16)
    wide = tf.constant([[1e308, 1e308]], tf.float64)
    sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([0]), tf.constant([3, 2]))
    count = tf.constant([2**31 - 1], tf.int32)  # not floating: ignored
    cases = [
        ([big, half, wide, sparse, count, None], True),
        ([big, tf.constant([1.0, np.inf])], False),
        ([wide, tf.constant([np.nan], tf.float16)], False),
        (
            [tf.IndexedSlices(tf.constant([[-np.inf]]), tf.constant([1]), tf.constant([2, 1]))],
            False,
        ),
        ([tf.constant(np.nan, tf.float64)], False),
        ([count], True),
    ]
    for tensors, expected in cases:

        def check(tensors=tensors):
            with xla_traced(jit == "fit"):
                return _all_finite(tensors)

        got = check() if jit is None else tf.function(check, jit_compile=bool(jit))()
        assert bool(got) is expected, (tensors, jit)


def test_callback_fires_inside_the_loop_at_global_steps(data):
    x, y = data
    _, variables, loss_fn = make_problem("perceptron")
    seen = []
    fit = sf.fuse(
        loss_fn,
        keras.optimizers.SGD(0.01),
        variables,
        steps=7,
        every=3,
        callback=lambda step, loss: seen.append((step, loss)),
    )
    t1 = fit(x, y)
    t2 = fit(x, y, steps=5)
    losses = np.concatenate([t1.loss, t2.loss])
    assert [s for s, _ in seen] == [3, 6, 9, 12]
    np.testing.assert_allclose([l for _, l in seen], losses[[2, 5, 8, 11]], rtol=1e-7)


def test_raising_callback_reaches_the_caller(data):
    x, y = data
    _, variables, loss_fn = make_problem("perceptron")

    class Boom(Exception):
        pass

    def callback(step, loss):
        if step == 4:
            raise Boom(f"stop at {step}")

    fit = sf.fuse(
        loss_fn, keras.optimizers.SGD(0.01), variables, steps=10, every=2, callback=callback
    )
    with pytest.raises(Boom, match="stop at 4"):
        fit(x, y)
    assert fit.step == 4


def test_progress_bar_runs():
    w, loss = _quadratic([1.0, 2.0])
    fit = sf.fuse(loss, keras.optimizers.SGD(0.01), [w], steps=20, progress=True)
    assert fit().steps == 20


def test_progress_alone_is_published_from_the_loop_for_a_thread_to_read(data, capsys):
    # A bar without a callback: each chunk writes (step, loss) into a variable that a
    # host thread reads; the loop never calls Python. With a callback: tf.numpy_function.
    x, y = data
    _, variables, loss_fn = make_problem("perceptron")
    fit = sf.fuse(loss_fn, keras.optimizers.SGD(0.01), variables, steps=30, progress=True, every=7)
    t1 = fit(x, y)
    step, loss = fit._published.numpy()
    assert step == 30 and loss == pytest.approx(t1.loss[-1], rel=1e-7)
    fit(x, y, steps=10)
    assert fit._published.numpy()[0] == 40
    assert "10/10" in capsys.readouterr().out
    seen = []
    both = sf.fuse(
        loss_fn,
        keras.optimizers.SGD(0.01),
        variables,
        steps=30,
        progress=True,
        every=7,
        callback=lambda s, l: seen.append(s),
    )
    both(x, y)
    assert both._published is None and seen == [7, 14, 21, 28]


@pytest.mark.parametrize("with_callback", [False, True], ids=["bar", "callback"])
def test_a_bar_alone_ends_chunks_at_multiples_of_every_paced_by_time(with_callback):
    # The outer loop around a stand-in for the XLA loop (which costs ~the same per launch
    # whatever its length): a bar alone needs a publication now and then, so after the
    # first chunk (ending at `every`) the chunks grow to last ~_PUBLISH_SECONDS each;
    # a callback is owed every multiple of `every`. Every chunk but the last ends at one.
    from stepfuse._core import check_options
    from stepfuse.tf._loop import _PUBLISH_SECONDS, _outer_loop

    n, every = 100_000, 10
    opts = check_options(
        n,
        None,
        1,
        (lambda s, l: None) if with_callback else None,
        every,
        not with_callback,
        "stop",
        "fused",
    )
    chunks = []

    def inner(m, i0, prev):
        seen = tf.numpy_function(
            lambda i, m: chunks.append((int(i), int(m))) or np.int32(0), [i0, m], tf.int32
        )
        with tf.control_dependencies([seen]):
            m = tf.identity(m)
        return tf.zeros([every]), tf.minimum(m, every), m, m, tf.constant(0), prev

    published = tf.Variable([math.nan, math.nan], dtype=tf.float64)
    run = tf.function(
        lambda: _outer_loop(
            inner,
            tf.constant(n),
            tf.constant(0, tf.int64),
            opts,
            n,
            notify=(lambda s, l: np.int32(1)) if with_callback else None,
            publish=None if with_callback else published,
        )
    )
    _, applied, stop, _ = run()
    assert int(applied) == n and int(stop) == 0
    ends = [i + m for i, m in chunks]
    assert ends[-1] == n and all(e % every == 0 for e in ends)
    assert ends[0] == every  # the first publication comes early
    if with_callback:
        assert len(chunks) == n // every
    else:
        assert len(chunks) <= 5, chunks
        assert published.numpy()[0] == n
        # Given the previous call's speed, the first chunk lasts ~_PUBLISH_SECONDS too:
        # 40,000 steps/s -> 10,000 steps (a multiple of `every`), not 10.
        chunks.clear()
        speed = 40_000 / (_PUBLISH_SECONDS / 0.25)
        tf.function(
            lambda: _outer_loop(
                inner,
                tf.constant(n),
                tf.constant(0, tf.int64),
                opts,
                n,
                publish=published,
                speed=tf.constant(speed, tf.float64),
            )
        )()
        assert chunks[0] == (0, 10_000), chunks
        assert sum(m for _, m in chunks) == n


@pytest.mark.parametrize("notify, record_every", NOTIFICATION_CASES)
def test_notifications_leave_the_results_unchanged(notify, record_every, data, capsys):
    # A bar alone runs chunks sized by time, a callback chunks ending at each multiple of
    # `every`: the trace and the variables must not see the difference.
    x, y = data
    results = []
    for options in ({}, dict(every=7, **notify)):
        _, variables, loss_fn = make_problem("perceptron")
        fit = sf.fuse(
            loss_fn,
            keras.optimizers.Adam(0.05),
            variables,
            steps=300,
            record_every=record_every,
            **options,
        )
        results.append((fit(x, y), fit(x, y, steps=50), values(variables)))
    (a1, a2, va), (b1, b2, vb) = results
    for ta, tb, n in ((a1, b1, 300), (a2, b2, 50)):
        np.testing.assert_array_equal(ta.loss, tb.loss)
        assert (ta.steps, ta.stop) == (tb.steps, tb.stop) and len(tb.loss) == -(-n // record_every)
    for a, b in zip(va, vb):
        np.testing.assert_array_equal(a, b)


def test_a_call_longer_than_one_compiled_chunk_chains_chunks_with_the_same_results(
    data, monkeypatch
):
    x, y = data
    results = []
    for min_chunk in (8, sf._fit._MIN_STEPS_PER_LAUNCH):  # 50 steps: 7 chained chunks, then one
        monkeypatch.setattr(sf._fit, "_MIN_STEPS_PER_LAUNCH", min_chunk)
        _, variables, loss_fn = make_problem("perceptron")
        # One path for both: jit_compile="auto" (the default) times XLA against TF's kernels
        # per fit, and on a loaded machine the two fits chose differently (CI: losses 1 ulp
        # apart, from the first).
        opt = keras.optimizers.Adam(0.05)
        fit = sf.fuse(loss_fn, opt, variables, steps=3, record_every=3, jit_compile=True)
        assert fit._steps_per_launch == max(3, min_chunk)
        results.append((fit(x, y, steps=50), values(variables)))
    (ta, va), (tb, vb) = results
    np.testing.assert_array_equal(ta.loss, tb.loss)
    assert ta.steps == tb.steps == 50 and len(ta.loss) == 17
    for a, b in zip(va, vb):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("record_every", [1, 3])
def test_xla_trace_is_gathered_in_small_chunks_with_the_losses_of_the_plain_loop(
    record_every, data, monkeypatch
):
    # Under XLA the losses gather _LOSSES_PER_COPY at a time before each copy into the trace;
    # without XLA they go straight into a TensorArray. 230 steps cross many of those small
    # chunks, and chained compiled chunks of 37 steps start them at odd step indices.
    x, y = data
    results = {}
    for jit, min_chunk in (
        (True, sf._fit._MIN_STEPS_PER_LAUNCH),
        (True, 37),
        (False, sf._fit._MIN_STEPS_PER_LAUNCH),
    ):
        monkeypatch.setattr(sf._fit, "_MIN_STEPS_PER_LAUNCH", min_chunk)
        _, variables, loss_fn = make_problem("perceptron")
        fit = sf.fuse(
            loss_fn,
            keras.optimizers.Adam(0.01),
            variables,
            steps=5,
            record_every=record_every,
            jit_compile=jit,
        )
        results[jit, min_chunk] = fit(x, y, steps=230), values(variables)
    (one, v_one), (chained, v_chained), (plain, v_plain) = results.values()
    assert one.steps == chained.steps == plain.steps == 230
    assert (
        len(one.loss) == len(plain.loss) == -(-230 // record_every) > 2 * sf._loop._LOSSES_PER_COPY
    )
    np.testing.assert_array_equal(one.loss, chained.loss)
    np.testing.assert_allclose(one.loss, plain.loss, rtol=RTOL, atol=ATOL)
    assert np.all(np.isfinite(one.loss))
    for a, b, c in zip(v_one, v_chained, v_plain):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=RTOL, atol=ATOL)


def test_calls_within_the_chunk_run_one_program_and_longer_ones_a_second_traced_once(
    data, monkeypatch
):
    x, y = data
    monkeypatch.setattr(sf._fit, "_MIN_STEPS_PER_LAUNCH", 8)
    _, variables, loss_fn = make_problem("perceptron")
    fit = sf.fuse(loss_fn, keras.optimizers.SGD(0.1), variables, steps=3)
    _, ref_vars, ref_loss = make_problem("perceptron")
    ref = reference_steps(ref_loss, keras.optimizers.SGD(0.1), ref_vars, x, y, 3 + 20 + 2 + 30)
    losses = []
    for n, traces in ((3, 1), (20, 2), (2, 2), (30, 2)):  # chunk = 8: 20 and 30 chain chunks
        losses += list(fit(x, y, steps=n).loss)
        assert fit.traces == traces, n
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
    for a, b in zip(values(variables), values(ref_vars)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_uncompilable_op_falls_back_without_xla_with_a_warning(data):
    x, y = data
    model, variables, loss_fn = make_problem("perceptron")
    scale = lambda a: (a * 1.0).astype(np.float32)  # noqa: E731

    def loss_np(x, y):
        return loss_fn(tf.reshape(tf.numpy_function(scale, [x], tf.float32), x.shape), y)

    fit = sf.fuse(loss_np, keras.optimizers.SGD(0.01), variables, steps=3, jit_compile=True)
    with pytest.warns(RuntimeWarning, match="XLA"):
        trace = fit(x, y)
    assert not fit.jit_compile and trace.steps == 3 and abs(trace.loss[0] - LN2) < 1e-6
    assert fit(x, y).steps == 3


def test_keras_model_and_tf_module_as_variables(data):
    x, y = data
    model, _, loss_fn = make_problem("mlp")
    fit = sf.fuse(loss_fn, keras.optimizers.SGD(0.01), model, steps=2)
    assert len(fit.variables) == 4 and fit(x, y).steps == 2
    mod, _, loss_fn = make_problem("perceptron")
    fit = sf.fuse(loss_fn, keras.optimizers.SGD(0.01), mod, steps=2)
    assert len(fit.variables) == 2 and fit(x, y).steps == 2


# -- bad input: every error names the argument; nothing changes ---------------------------


class _NotKeras:
    def update(self, grads, state):  # looks like an optax transformation
        return grads, state


@pytest.mark.parametrize(
    "bad", [_NotKeras(), tf.compat.v1.train.GradientDescentOptimizer(0.1), "adam"]
)
def test_optimizer_not_keras_is_rejected(bad):
    w, loss = _quadratic([1.0])
    with pytest.raises(TypeError, match="`optimizer`.*keras.optimizers.SGD"):
        sf.fuse(loss, bad, [w], steps=3)


@pytest.mark.parametrize(
    "case", ["empty", "not_trainable", "integer", "not_a_variable", "unbuilt_model"]
)
def test_bad_variables_are_rejected(case):
    bad = {
        "empty": [],
        "not_trainable": [tf.Variable([1.0], trainable=False)],
        "integer": [tf.Variable([1, 2])],
        "not_a_variable": [tf.constant([1.0])],
        "unbuilt_model": keras.Sequential([keras.layers.Dense(2)]),
    }[case]
    with pytest.raises((TypeError, ValueError), match="`variables`") as err:
        sf.fuse(lambda: tf.constant(1.0), keras.optimizers.SGD(0.1), bad, steps=3)
    assert "got" in str(err.value) and "Pass" in str(err.value) or "Build" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"steps": 0}, "steps"),
        ({"steps": 3, "tol": -1.0}, "tol"),
        ({"steps": 3, "record_every": 0}, "record_every"),
        ({"steps": 3, "every": 2}, "every"),
        ({"steps": 3, "jit_compile": "yes"}, "jit_compile"),
    ],
)
def test_bad_options_are_rejected(kwargs, name):
    w, loss = _quadratic([1.0])
    with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
        sf.fuse(loss, keras.optimizers.SGD(0.1), [w], **kwargs)


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
@pytest.mark.parametrize("case", ["vector", "integer", "no_gradient"])
def test_bad_loss_fn_is_rejected_before_any_update(case, mode):
    w = tf.Variable([1.0, 2.0])
    v = tf.Variable([3.0])
    loss = {
        "vector": lambda: w * w,
        "integer": lambda: tf.cast(tf.reduce_sum(w), tf.int32),
        # reads no variable (one the loss does not read is left alone, as Keras does)
        "no_gradient": lambda: tf.reduce_sum(tf.stop_gradient(w) ** 2),
    }[case]
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    fit = sf.fuse(loss, opt, [w, v], steps=3, mode=mode)
    with pytest.raises((TypeError, ValueError), match="`loss_fn`"):
        fit()
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(v.numpy(), [3.0])
    assert int(opt.iterations) == 0 and fit.step == 0


def test_call_steps_rejected():
    w, loss = _quadratic([1.0])
    fit = sf.fuse(loss, keras.optimizers.SGD(0.1), [w], steps=3)
    with pytest.raises(ValueError, match="`steps`"):
        fit(steps=0)
    np.testing.assert_array_equal(w.numpy(), [1.0])


@pytest.mark.parametrize(
    ("one", "many", "expected"), [(170e-6, 160e-6, None), (170e-6, 195e-6, 5.0)]
)
def test_auto_trial_reports_a_step_below_the_noise_as_unresolved(one, many, expected):
    """A trial whose call of m steps is no slower than its call of 1 step resolves no
    time a step: plan says so (``us_per_step`` None), never "0.0 us"."""
    from stepfuse.tf._plan import timed

    calls = []

    def run(xla, m):  # a scripted clock: XLA calls of 1 step, then of 6
        calls.append((xla, m))
        return one if m == 1 else many

    plan = timed(run, steps=6, limit=6)
    assert plan["xla"] is True and calls[-1] == (True, 6) and all(x for x, _ in calls)
    assert plan["us_per_step"] == {"xla": expected}
    if expected is None:
        assert "below the calls' noise" in plan["reason"] and "0.0 us" not in plan["reason"]
    else:
        assert "ran a step in 5.0 us (calls of 1 and 6 steps)" in plan["reason"]


def test_tfs_stateful_random_ops_are_named_with_what_they_draw():
    # tf.random.normal draws other numbers in a tf.function than eagerly (TensorFlow's
    # behaviour): the fit equals the plain loop inside a tf.function, and now says so.
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")

    def build():
        w = tf.Variable(tf.ones((4, 1)))

        def loss_fn(a):
            return tf.reduce_mean((a @ w + 0.3 * tf.random.normal((16, 1))) ** 2)

        return w, loss_fn, keras.optimizers.SGD(0.05)

    tf.random.set_seed(5)
    w, loss_fn, opt = build()

    @tf.function
    def step(a):
        with tf.GradientTape() as tape:
            loss = loss_fn(a)
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss

    want = [float(step(x)) for _ in range(3)]
    after = float(tf.random.uniform([]))  # the global random state that loop leaves
    tf.random.set_seed(5)
    w2, loss_fn2, opt2 = build()
    fit = sf.fuse(loss_fn2, opt2, [w2], steps=3, jit_compile=False)
    with pytest.warns(
        RuntimeWarning,
        match=r"stateful random ops \(RandomStandardNormal; .*"
        r"tf\.random\.Generator",
    ):
        trace = fit(x)
    assert float(tf.random.uniform([])) == after
    np.testing.assert_allclose(trace.loss, want, rtol=1e-6)
    np.testing.assert_allclose(w2.numpy(), w.numpy(), rtol=1e-6)
