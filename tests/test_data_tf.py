"""Data streams on the TensorFlow backends (`stepfuse.tf._data`, `stepfuse.tf._v1_data`):
`Batches`, `Epochs` (across epoch boundaries) and a ``tf.data`` iterator: fused == stepwise
== the plain Keras loop (GradientTape + ``apply_gradients`` per step) over the same
minibatches; resume; a refused step mid-call; tol / record_every / callback with streams;
a fixed argument beside a stream; bad input refused with nothing changed; an iterator
running out; the TF1 stacked feed against its plain loop; the guide's examples as written.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import stepfuse as sf
import stepfuse.tf as sft
import stepfuse.tf.v1 as sf1
from stepfuse import Stop

tf1 = tf.compat.v1
GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "data_tf.md"
RTOL = 1e-6

RNG = np.random.default_rng(0)
X = RNG.normal(size=(44, 3)).astype("float32")  # 44 rows, batch 8: 5 steps per epoch
Y = RNG.normal(size=(44,)).astype("float32")
XS = RNG.normal(size=(12, 8, 3)).astype("float32")
YS = RNG.normal(size=(12, 8)).astype("float32")


def _model() -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, "tanh"), keras.layers.Dense(1)]
    )


def _loss_of(model: Any) -> Any:
    def loss_fn(xb: Any, yb: Any) -> Any:
        return tf.reduce_mean((model(xb)[:, 0] - yb) ** 2)

    return loss_fn


def make(**options: Any) -> tuple[Any, Any]:
    model = _model()
    options.setdefault("steps", 12)
    fit = sft.fuse(_loss_of(model), keras.optimizers.Adam(1e-2), model, **options)
    return fit, model


_OPTS: dict[int, Any] = {}  # each plain model's optimizer, to continue a plain loop


def plain(batches: list[tuple[Any, ...]], model: Any = None) -> tuple[np.ndarray, Any]:
    """The plain Keras loop over ``batches`` (continuing ``model``'s): (losses, model)."""
    model = model or _model()
    opt = _OPTS.setdefault(id(model), keras.optimizers.Adam(1e-2))
    loss_fn, losses = _loss_of(model), []
    for b in batches:
        with tf.GradientTape() as tape:
            loss = loss_fn(*b)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return np.asarray(losses, np.float32), model


def close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=1e-7)


def same_weights(m1: Any, m2: Any) -> None:
    for a, b in zip(m1.get_weights(), m2.get_weights()):
        close(a, b)


def epoch_batches(data: sf.Epochs, start: int, n: int) -> list[tuple[Any, ...]]:
    """Global steps ``start .. start + n - 1``'s minibatches, from ``data.order(epoch)``."""
    out = []
    for t in range(start, start + n):
        epoch, at = divmod(t, data.steps_per_epoch)
        rows = data.order(epoch)[at * data.batch_size : (at + 1) * data.batch_size]
        out.append((data.arrays[0][rows], data.arrays[1][rows]))
    return out


def test_guide_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), {})


# shuffle=False with --runslow (as in test_data_tf1): the same loop over an identity order.
@pytest.mark.parametrize("shuffle", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_epochs_across_boundaries_fused_equals_stepwise_and_plain(shuffle: bool) -> None:
    data = sf.Epochs(X, Y, batch_size=8, shuffle=shuffle, seed=7)
    fused, fm = make()
    step, sm = make(mode="stepwise")
    losses = [fused(data).loss, fused(data, steps=5).loss]  # 17 steps: into epoch 3
    assert fused.compiles == 1 and fused.step == 17
    slosses = [step(data).loss, step(data, steps=5).loss]
    ref, rm = plain(epoch_batches(data, 0, 17))
    close(np.concatenate(losses), ref)
    close(np.concatenate(slosses), ref)
    same_weights(fm, rm)
    same_weights(sm, rm)
    # the host's minibatch of a step is the one the device used
    close(data.batch(13)[0], epoch_batches(data, 13, 1)[0][0])


@pytest.mark.parametrize("jit", [True, False], ids=["xla", "tf-kernels"])
def test_epochs_past_the_host_order_table_are_sorted_on_the_device(jit: bool) -> None:
    # A call hands its program the orders of the epochs it enters, computed on the host,
    # in a table sized for the fit's `steps` (here 2 epochs); a longer call sorts the
    # epochs past it on the device (`stepfuse.tf._data.OrderTables`): the same minibatches.
    data = sf.Epochs(X, Y, batch_size=8, seed=11)
    fused, fm = make(steps=3, jit_compile=jit)
    losses = [fused(data).loss, fused(data, steps=23).loss, fused(data, steps=2).loss]
    assert fused.compiles == 1 and fused.step == 28
    ref, rm = plain(epoch_batches(data, 0, 28))
    close(np.concatenate(losses), ref)
    same_weights(fm, rm)


def test_going_back_to_an_epochs_of_another_seed_reuses_its_program() -> None:
    # Each structure (an Epochs' seed is part of it) is traced once: calls alternating
    # between two traced the whole fit again at every call (~1 s each), and equal the
    # plain loop over each call's minibatches at the fit's global steps.
    a = sf.Epochs(X, Y, batch_size=8, seed=0)
    b = sf.Epochs(X, Y, batch_size=8, seed=1)
    fused, fm = make(steps=4)
    losses, batches = [], []
    for k, data in enumerate((a, b, a, b, a)):
        batches += epoch_batches(data, fused.step, 4)
        losses.append(fused(data).loss)
        assert fused.compiles == min(k + 1, 2), (k, fused.compiles)
    ref, rm = plain(batches)
    close(np.concatenate(losses), ref)
    same_weights(fm, rm)


def test_switching_between_dict_and_tuple_batches_runs_each_ones_program() -> None:
    # A dict batch's structure was unhashable to the kept programs: every switch raised,
    # after which the retry ran the other structure's program (the dict branch's loss).
    model = _model()

    def loss_fn(*a: Any) -> Any:
        if isinstance(a[0], dict):
            return 2.0 * tf.reduce_mean((model(a[0]["x"])[:, 0] - a[0]["y"]) ** 2)
        return tf.reduce_mean((model(a[0])[:, 0] - a[1]) ** 2)

    fit = sft.fuse(loss_fn, keras.optimizers.SGD(0.0), model, steps=1, jit_compile=False)
    x, y = X[:8], Y[:8]
    for k, batch in enumerate([({"x": x, "y": y},), (x, y), ({"x": x, "y": y},), (x, y)]):
        close(fit(*batch).loss, [float(loss_fn(*batch))])
        assert fit.compiles == min(k + 1, 2)


def test_a_new_structure_xla_cannot_compile_falls_back_after_another_ran_with_xla() -> None:
    # Which programs ran once (so an XLA failure is no longer expected) is kept per
    # structure: the second structure's XLA failure fell through as an error.
    model = _model()

    def loss_fn(xb: Any, yb: Any, *w: Any) -> Any:
        loss = tf.reduce_mean((model(xb)[:, 0] - yb) ** 2)
        if w:  # through NumPy: no XLA kernel
            loss = loss * tf.reduce_mean(tf.numpy_function(lambda a: a, [w[0]], tf.float32))
        return loss

    fit = sft.fuse(loss_fn, keras.optimizers.SGD(0.01), model, steps=2, jit_compile=True)
    fit(X, Y)
    with pytest.warns(RuntimeWarning, match="could not be XLA-compiled"):
        trace = fit(X, Y, np.ones(44, np.float32))
    assert trace.steps == 2 and not fit.jit_compile and fit.step == 4


def test_epochs_resume_k_then_rest_equals_one_call() -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=3)
    one, m1 = make(steps=13)
    two, m2 = make(steps=13)
    a = one(data).loss
    b = np.concatenate([two(data, steps=4).loss, two(data, steps=9).loss])
    close(a, b)
    same_weights(m1, m2)
    assert two.compiles == 1


def test_batches_over_calls_fused_equals_stepwise_and_plain() -> None:
    fused, fm = make(steps=6)
    step, sm = make(steps=6, mode="stepwise")
    first, second = sf.Batches(XS[:6], YS[:6]), sf.Batches(XS[6:], YS[6:])
    losses = np.concatenate([fused(first).loss, fused(second, steps=4).loss])
    slosses = np.concatenate([step(first).loss, step(second, steps=4).loss])
    ref, rm = plain([(XS[i], YS[i]) for i in [*range(6), 6, 7, 8, 9]])
    close(losses, ref)
    close(slosses, ref)
    same_weights(fm, rm)
    same_weights(sm, rm)
    assert fused.compiles == 1


def test_a_fixed_argument_beside_batches() -> None:
    fused, fm = make(steps=5)
    losses = fused(sf.Batches(XS), YS[0], steps=5).loss
    ref, rm = plain([(XS[i], YS[0]) for i in range(5)])
    close(losses, ref)
    same_weights(fm, rm)


def test_iterator_fused_equals_stepwise_and_plain_and_runs_without_xla() -> None:
    ds = tf.data.Dataset.from_tensor_slices((X[:40], Y[:40])).batch(8)
    fused, fm = make(steps=4, jit_compile=True)
    with pytest.warns(RuntimeWarning, match="tf.data iterator"):
        losses = fused(iter(ds.repeat())).loss
    assert not fused.jit_compile
    auto, am = make(steps=4)  # jit_compile="auto": no warning, fit.plan says why
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto_losses = auto(iter(ds.repeat())).loss
    assert not auto.jit_compile and "iterator" in auto.plan["reason"]
    np.testing.assert_array_equal(auto_losses, losses)
    step, sm = make(steps=4, mode="stepwise", jit_compile=False)
    slosses = step(iter(ds.repeat())).loss
    ref, rm = plain([(X[i : i + 8], Y[i : i + 8]) for i in range(0, 32, 8)])
    close(losses, ref)
    close(slosses, ref)
    same_weights(fm, rm)
    same_weights(sm, rm)


def test_an_iterator_running_out_with_an_embeddings_sparse_gradient() -> None:
    """The refused step's gradients mirror the real ones' kinds: an embedding's is an
    ``IndexedSlices`` (`_data.only_given`)."""
    tokens = RNG.integers(0, 50, (20, 4)).astype("int32")
    labels = RNG.integers(0, 3, 20).astype("int64")
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def model() -> Any:
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(3),
            ]
        )

    ds = tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(8)  # 8, 8, 4 rows
    m, opt = model(), keras.optimizers.Adam(1e-2)
    fit = sft.fuse(lambda x, y: ce(y, m(x)), opt, m, steps=5)
    with pytest.raises(sft.OutOfDataError, match="ran out at step 3"):
        fit(iter(ds))
    assert fit.step == int(opt.iterations.numpy()) == 3
    ref, ref_opt = model(), keras.optimizers.Adam(1e-2)
    for xb, yb in ds:
        with tf.GradientTape() as tape:
            loss = ce(yb, ref(xb))
        grads = tape.gradient(loss, ref.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
    same_weights(m, ref)


def test_an_iterator_in_stepwise_mode_with_auto_gives_no_xla_warning() -> None:
    """The warning is for a jit_compile=True the fit cannot keep; "auto" in stepwise mode
    (XLA for the reference's step until then) asked for nothing."""
    ds = tf.data.Dataset.from_tensor_slices((X[:40], Y[:40])).batch(8)
    fit, _ = make(steps=2, mode="stepwise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(iter(ds))
    assert not fit.jit_compile and "iterator" in fit.plan["reason"]


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_iterator_running_out_mid_call_keeps_the_steps_before(mode: str) -> None:
    ds = tf.data.Dataset.from_tensor_slices((X[:24], Y[:24])).batch(8)  # 3 elements
    fit, m = make(steps=5, mode=mode, jit_compile=False)
    with pytest.raises(sft.OutOfDataError, match="ran out at step 3") as e:
        fit(iter(ds))
    assert isinstance(e.value, tf.errors.OutOfRangeError)
    assert e.value.step == 3 and fit.step == 3
    assert e.value.trace.steps == 3 and e.value.trace.stop == Stop.STEPS
    ref, rm = plain([(X[i : i + 8], Y[i : i + 8]) for i in range(0, 24, 8)])
    close(e.value.trace.loss, ref)
    same_weights(m, rm)
    fit(iter(ds), steps=2)  # a fresh iterator runs on
    assert fit.step == 5


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_an_iterator_running_out_never_calls_loss_fn_on_a_made_up_element(mode: str) -> None:
    """A batch dimension the dataset leaves unknown (a smaller last batch) made the step
    after the last element run loss_fn on 0 rows, which a loss reading row 0 fails: the
    call raised that error with the updates before it applied, the optimizer's iterations
    one ahead and ``fit.step`` behind."""

    def loss_of(model: Any) -> Any:
        return lambda xb, yb: tf.reduce_mean((model(xb - xb[0])[:, 0] - yb) ** 2)

    ds = tf.data.Dataset.from_tensor_slices((X[:20], Y[:20])).batch(8)  # 8, 8, 4 rows
    model = _model()
    opt = keras.optimizers.Adam(1e-2)
    fit = sft.fuse(loss_of(model), opt, model, steps=5, mode=mode, jit_compile=False)
    with pytest.raises(sft.OutOfDataError, match="ran out at step 3") as e:
        fit(iter(ds))
    assert e.value.trace.steps == fit.step == int(opt.iterations.numpy()) == 3
    ref_model, ref_opt = _model(), keras.optimizers.Adam(1e-2)
    ref_loss, losses = loss_of(ref_model), []
    for xb, yb in ds:
        with tf.GradientTape() as tape:
            loss = ref_loss(xb, yb)
        grads = tape.gradient(loss, ref_model.trainable_variables)
        ref_opt.apply_gradients(zip(grads, ref_model.trainable_variables))
        losses.append(float(loss))
    close(e.value.trace.loss, losses)
    same_weights(model, ref_model)


def test_nonfinite_minibatch_mid_call_then_the_next_call_starts_there() -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=1)
    row = int(data.order(0)[-1])  # left out of epoch 0 (44 rows, 40 used): first in epoch 1
    t_bad = next(t for t in range(5, 10) if row in data.indices(t))
    bad_x = X.copy()
    bad_x[row] = np.nan
    bad = sf.Epochs(bad_x, Y, batch_size=8, seed=1)
    fit, m = make(steps=10)
    trace = fit(bad)
    assert trace.stop == Stop.NONFINITE and trace.steps == t_bad and fit.step == t_bad
    ref, rm = plain(epoch_batches(data, 0, t_bad))
    same_weights(m, rm)  # the refused update left nothing behind
    close(trace.loss[:t_bad], ref)
    rest = fit(data, steps=3).loss  # continues at the refused step's minibatch
    ref2, rm = plain(epoch_batches(data, t_bad, 3), rm)
    close(rest, ref2)
    same_weights(m, rm)
    assert fit.compiles == 1


def test_nonfinite_batches_then_the_next_call() -> None:
    xs = XS.copy()
    xs[2, 0, 0] = np.inf
    fit, m = make(steps=5, on_nonfinite="raise")
    with pytest.raises(sf.NonFiniteError):
        fit(sf.Batches(xs, YS))
    assert fit.step == 2
    ref, rm = plain([(XS[i], YS[i]) for i in range(2)])
    same_weights(m, rm)


def test_tol_record_every_and_callback_with_streams() -> None:
    data = sf.Epochs(X, Y, batch_size=8, seed=2)
    seen: dict[str, list] = {"fused": [], "stepwise": []}
    traces = {}
    for mode in seen:
        fit, _ = make(
            steps=20,
            mode=mode,
            tol=1e-9,
            record_every=3,
            every=4,
            callback=lambda s, loss, mode=mode: seen[mode].append((s, loss)),
        )
        traces[mode] = fit(data)
    f, s = traces["fused"], traces["stepwise"]
    assert f.steps == s.steps and f.stop == s.stop
    close(f.loss, s.loss)
    assert (
        [k for k, _ in seen["fused"]]
        == [k for k, _ in seen["stepwise"]]
        == [4 * j for j in range(1, f.steps // 4 + 1)]
    )
    close([v for _, v in seen["fused"]], [v for _, v in seen["stepwise"]])
    ref, _ = plain(epoch_batches(data, 0, f.steps))
    close(f.loss, ref[::3])


def test_bad_input_raises_before_anything_runs() -> None:
    fit, m = make(steps=6)
    before = [w.copy() for w in m.get_weights()]
    with pytest.raises(ValueError, match="`Batches` holds 4 minibatches but the call runs 6"):
        fit(sf.Batches(XS[:4], YS[:4]))
    with pytest.raises(TypeError, match=r"`batch\[1\]`"):
        fit(sf.Batches(XS), {"y": YS[0]})
    with pytest.raises(ValueError, match="batch_size"):
        fit(sf.Epochs(X, Y, batch_size=100))
    assert fit.step == 0 and fit.compiles == 0
    for a, b in zip(before, m.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_tf1_stacked_feed_equals_its_plain_loop(mode: str) -> None:
    def build(data: Any) -> tuple[Any, ...]:
        xp = tf1.placeholder(tf.float32, (None, 8, 3))
        yp = tf1.placeholder(tf.float32, (None, 8))
        w = tf1.get_variable("w", initializer=tf.ones((3,)))

        def loss_fn(x: Any, y: Any) -> Any:
            return tf.reduce_mean((tf.linalg.matvec(x, w) - y) ** 2)

        return xp, yp, w, loss_fn

    with tf.Graph().as_default():
        xp, yp, w, loss_fn = build(None)
        fused = sf1.fuse(loss_fn, tf1.train.AdamOptimizer(0.01), steps=6, data=(xp, yp), mode=mode)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            losses = np.concatenate(
                [
                    fused.run(sess, {xp: XS[:6], yp: YS[:6]}).loss,
                    fused.run(sess, {xp: XS[6:], yp: YS[6:]}, steps=3).loss,
                ]
            )
            with pytest.raises(ValueError, match="holds 2 stacked minibatches"):
                fused.run(sess, {xp: XS[:2], yp: YS[:2]}, steps=3)
            got = sess.run(w)
            assert fused.step == 9
    with tf.Graph().as_default():
        x1 = tf1.placeholder(tf.float32, (8, 3))
        y1 = tf1.placeholder(tf.float32, (8,))
        w = tf1.get_variable("w", initializer=tf.ones((3,)))
        loss = tf.reduce_mean((tf.linalg.matvec(x1, w) - y1) ** 2)
        train = tf1.train.AdamOptimizer(0.01).minimize(loss)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            ref = [sess.run([loss, train], {x1: XS[i], y1: YS[i]})[0] for i in [*range(6), 6, 7, 8]]
            want = sess.run(w)
    close(losses, ref)
    close(got, want)


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_an_iterators_element_reaches_loss_fn_as_a_plain_loop_passes_it(mode: str) -> None:
    """A dict element reached loss_fn as positional arguments in sorted-key order: keys
    ``inputs, targets, weights`` became ``loss_fn(inputs, targets=weights, weights=targets)``
    and the fit trained on swapped tensors without a word. Now a dict is one argument, a
    tuple's parts are the arguments with their nesting kept, as ``for e in dataset``."""
    w = RNG.uniform(0.5, 1.0, size=(40,)).astype("float32")
    records = {"inputs": X[:40], "targets": Y[:40], "weights": w}
    dicts = tf.data.Dataset.from_tensor_slices(records).batch(8)
    nested = tf.data.Dataset.from_tensor_slices(((X[:40], w), Y[:40])).batch(8)

    def by_dict(model: Any) -> Any:
        return lambda e: tf.reduce_mean(
            e["weights"] * (model(e["inputs"])[:, 0] - e["targets"]) ** 2
        )

    def by_tuple(model: Any) -> Any:
        return lambda xw, yb: tf.reduce_mean(xw[1] * (model(xw[0])[:, 0] - yb) ** 2)

    for ds, loss_of, unpack in [(dicts, by_dict, lambda e: (e,)), (nested, by_tuple, tuple)]:
        model = _model()
        fit = sft.fuse(loss_of(model), keras.optimizers.Adam(1e-2), model, steps=5, mode=mode)
        losses = fit(iter(ds)).loss
        ref_model, ref_opt, ref = _model(), keras.optimizers.Adam(1e-2), []
        for e in ds:
            with tf.GradientTape() as tape:
                loss = loss_of(ref_model)(*unpack(e))
            grads = tape.gradient(loss, ref_model.trainable_variables)
            ref_opt.apply_gradients(zip(grads, ref_model.trainable_variables))
            ref.append(float(loss))
        close(losses, ref)
        same_weights(model, ref_model)
    fit, _ = make(steps=2, mode=mode)  # loss_fn(x, y) given a dict: the error says how
    with pytest.raises(TypeError, match="reaches loss_fn as one argument"):
        fit(iter(dicts))


def test_an_element_of_unknown_rank_runs_and_a_model_that_cannot_take_it_is_told_why() -> None:
    """``tf.py_function`` leaves the rank unknown: building the stand-in of a missing
    element raised "as_list() is not defined on an unknown TensorShape" from inside."""
    ds = (
        tf.data.Dataset.from_tensor_slices((X[:40], Y[:40]))
        .map(lambda a, b: tf.py_function(lambda *t: t, [a, b], [tf.float32, tf.float32]))
        .batch(8)
    )
    w = tf.Variable(tf.ones([3]))
    fit = sft.fuse(
        lambda xb, yb: tf.reduce_mean((tf.reduce_sum(xb * w, -1) - yb) ** 2),
        keras.optimizers.SGD(0.1),
        [w],
        steps=5,
    )
    losses = fit(iter(ds)).loss
    w_ref, opt, ref = tf.Variable(tf.ones([3])), keras.optimizers.SGD(0.1), []
    for xb, yb in ds:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.reduce_sum(xb * w_ref, -1) - yb) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [w_ref]), [w_ref]))
        ref.append(float(loss))
    close(losses, ref)
    close(w.numpy(), w_ref.numpy())
    keras_fit, _ = make(steps=2)
    with pytest.raises(ValueError, match=r"(?s)unknown rank\].*tf\.ensure_shape"):
        keras_fit(iter(ds))


def test_epochs_at_step_0_after_the_optimizer_has_stepped_warns_to_set_fit_step() -> None:
    """A fit rebuilt after ``tf.train.Checkpoint(model, optimizer)`` started its Epochs
    again at epoch 0 without a word (the checkpoint holds no fit step)."""
    data = sf.Epochs(X, Y, batch_size=8, seed=3)
    model = _model()
    opt = keras.optimizers.Adam(1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fresh optimizer: nothing to say
        sft.fuse(_loss_of(model), opt, model, steps=3)(data)
    again = sft.fuse(_loss_of(model), opt, model, steps=3)
    with pytest.warns(RuntimeWarning, match=r"already taken 3 steps.*fit.step = 3") as seen:
        again(data)
    assert seen[0].filename == __file__
    resumed = sft.fuse(_loss_of(model), opt, model, steps=3)
    resumed.step = 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed(data)
