"""stepfuse.tf on real Keras models: a CNN with BatchNormalization and Dropout, an LSTM and a
MultiHeadAttention block with dropout, each trained fused over split calls against Keras's
own plain loop (GradientTape + ``optimizer.apply_gradients``, one step at a time, eagerly)
from the same seed: the losses, the trainable and non-trainable weights (BatchNorm moving
statistics, dropout seed states) and the optimizer variables agree.

Random ops (Dropout) draw other numbers under XLA than in TensorFlow's kernels from the same
seed, so a loss that draws them runs its loop without XLA, with a warning that says why; the
LSTM has none and stays XLA-compiled.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import ATOL, RTOL, assert_close, assert_fused

import stepfuse.tf as sf
from stepfuse import Stop

CALLS = (3, 3)  # the fused fit: two calls of 3 steps; the plain loop: 6 single steps
BATCH = 6
CLASSES = 3


def cnn():
    # No bias before BatchNormalization: it removes any constant, so that bias's gradient is
    # rounding noise, which Adam scales up to full steps (two correct runs differ there).
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2),
            keras.layers.Dropout(0.3),
            keras.layers.Flatten(),
            keras.layers.Dense(CLASSES),
        ]
    )


def lstm():
    return keras.Sequential(
        [keras.Input((5, 3)), keras.layers.LSTM(6), keras.layers.Dense(CLASSES)]
    )


def attention():
    # No biases in the attention: the softmax over keys ignores the key bias (its gradient
    # is rounding noise, as above).
    inputs = keras.Input((5, 4))
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, dropout=0.2, use_bias=False)(
        inputs, inputs
    )
    hidden = keras.layers.Dropout(0.2)(keras.layers.LayerNormalization()(inputs + attended))
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(pooled))


# name -> (model factory, input shape, optimizer factory, draws random numbers)
MODELS = {
    "cnn": (cnn, (8, 8, 1), lambda: keras.optimizers.Adam(0.01), True),
    "lstm": (lstm, (5, 3), lambda: keras.optimizers.SGD(0.05, momentum=0.9), False),
    # SGD: at the start the softmax is near uniform and the key kernel's gradient tiny, which
    # Adam scales up to full steps, so rounding differences grow to ~1e-6 there.
    "attention": (attention, (5, 4), lambda: keras.optimizers.SGD(0.05, momentum=0.9), True),
}

_ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(name):
    """``(model, optimizer, loss_fn, x, y)``, the same for every call with this name."""
    factory, shape, optimizer, _ = MODELS[name]
    keras.utils.set_random_seed(0)  # weights and the dropout layers' seed states
    model = factory()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(BATCH, *shape)).astype(np.float32))
    y = tf.constant(rng.integers(0, CLASSES, size=BATCH).astype(np.int32))

    def loss_fn(x, y):
        return _ce(y, model(x, training=True))

    return model, optimizer(), loss_fn, x, y


def state(model, optimizer):
    return {
        "trainable": [v.numpy() for v in model.trainable_variables],
        "non_trainable": [v.numpy() for v in model.non_trainable_variables],
        "optimizer": [v.numpy() for v in optimizer.variables],
    }


def plain_loop(name):
    """Keras's own training, one step at a time: the losses and the state after it."""
    model, optimizer, loss_fn, x, y = build(name)
    losses = []
    for _ in range(sum(CALLS)):
        with tf.GradientTape() as tape:
            loss = loss_fn(x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return np.asarray(losses, np.float32), state(model, optimizer)


def fused_run(name, mode="fused"):
    model, optimizer, loss_fn, x, y = build(name)
    fit = sf.fuse(loss_fn, optimizer, model, steps=max(CALLS), mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traces = [fit(x, y, steps=n) for n in CALLS]
    caught = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    return fit, traces, state(model, optimizer), caught


@pytest.fixture(scope="module", params=list(MODELS))
def trained(request):
    name = request.param
    return name, plain_loop(name), fused_run(name)


def test_fused_fit_equals_the_plain_keras_loop(trained):
    name, (ref_losses, ref_state), (fit, traces, got_state, _) = trained
    assert_fused(fit)
    for trace, n in zip(traces, CALLS):
        assert trace.steps == n and trace.stop == Stop.STEPS
    losses = np.concatenate([t.loss for t in traces])
    assert_close(losses, ref_losses, RTOL, ATOL, what=f"{name} losses")
    assert_close(got_state, ref_state, RTOL, ATOL, what=name)
    assert fit.step == sum(CALLS) and fit.compiles == 1


def test_the_models_train_and_their_other_state_moves(trained):
    """What the comparison covers is there: the losses fall, BatchNorm's statistics and the
    dropout layers' seed states moved from their initial values."""
    name, (ref_losses, ref_state), _ = trained
    assert ref_losses[-1] < ref_losses[0]
    model, optimizer, *_ = build(name)
    initial = state(model, optimizer)["non_trainable"]
    # cnn: BatchNorm's mean and variance, Dropout's seed; lstm: its (unused) dropout seed;
    # attention: two dropout seeds
    expected = {"cnn": 3, "lstm": 1, "attention": 2}[name]
    assert len(initial) == len(ref_state["non_trainable"]) == expected
    if MODELS[name][3]:
        for before, after in zip(initial, ref_state["non_trainable"]):
            assert not np.array_equal(before, after)


def test_random_ops_run_without_xla_and_say_why(trained):
    name, _, (fit, _, _, caught) = trained
    random = MODELS[name][3]
    # Without random ops jit_compile="auto" picks by timing the two ways on this machine
    # (either may win on a loaded one): the choice is timed, not forced off.
    assert fit.jit_compile is fit.plan["xla"]
    if not random:
        assert fit.plan["reason"].startswith("jit_compile='auto'"), fit.plan
    if random:
        assert fit.jit_compile is False
        assert len(caught) == 1, [str(w.message) for w in caught]
        message = str(caught[0].message)
        assert "draws random numbers" in message and "StatelessRandom" in message
        assert "without XLA" in message and "jit_compile=False" in message
    else:
        assert not caught, [str(w.message) for w in caught]


def test_stepwise_mode_equals_the_plain_keras_loop_with_dropout():
    ref_losses, ref_state = plain_loop("cnn")
    fit, traces, got_state, caught = fused_run("cnn", mode="stepwise")
    assert fit.mode == "stepwise" and not fit.jit_compile and len(caught) == 1
    assert_close(np.concatenate([t.loss for t in traces]), ref_losses, RTOL, ATOL, what="losses")
    assert_close(got_state, ref_state, RTOL, ATOL, what="cnn stepwise")


def test_jit_compile_false_draws_the_same_without_a_warning():
    model, optimizer, loss_fn, x, y = build("cnn")
    fit = sf.fuse(loss_fn, optimizer, model, steps=3, jit_compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        first = fit(x, y).loss
    ref_losses, _ = plain_loop("cnn")
    assert_close(first, ref_losses[:3], RTOL, ATOL, what="losses")


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_a_head_the_loss_never_reads_is_left_alone_as_in_the_plain_loop(mode):
    """A two-headed model whose loss reads one head: as Keras's apply_gradients, the fit
    updates what the loss reaches, leaves the other head (and its moments) alone, and
    equals the plain loop; Keras's own warning names the head."""

    def build_two_heads():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(5, activation="tanh")(inputs)
        heads = [keras.layers.Dense(CLASSES)(hidden), keras.layers.Dense(2, name="unused")(hidden)]
        model = keras.Model(inputs, heads)
        return model, keras.optimizers.Adam(0.01), (lambda x, y: _ce(y, model(x)[0]))

    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(BATCH, 4)).astype(np.float32))
    y = tf.constant(rng.integers(0, CLASSES, size=BATCH).astype(np.int32))
    model, optimizer, loss_fn = build_two_heads()
    unused = [v.numpy() for v in model.get_layer("unused").trainable_variables]
    ref = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Keras's, at each eager step)
        for _ in range(sum(CALLS)):
            with tf.GradientTape() as tape:
                loss = loss_fn(x, y)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            ref.append(float(loss))
    ref_state = state(model, optimizer)

    model, optimizer, loss_fn = build_two_heads()
    fit = sf.fuse(loss_fn, optimizer, model, steps=max(CALLS), mode=mode)
    with pytest.warns(UserWarning, match=r"Gradients do not exist for variables.*unused"):
        traces = [fit(x, y, steps=n) for n in CALLS]
    assert fit.mode == mode, fit.plan
    losses = np.concatenate([t.loss for t in traces])
    assert_close(losses, np.asarray(ref, np.float32), RTOL, ATOL, what="losses")
    assert_close(state(model, optimizer), ref_state, RTOL, ATOL, what="two heads")
    for before, v in zip(unused, model.get_layer("unused").trainable_variables):
        np.testing.assert_array_equal(v.numpy(), before)


def test_a_loss_that_reaches_no_variable_is_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    x = tf.ones((3, 4))
    fit = sf.fuse(lambda x: tf.reduce_sum(x), keras.optimizers.SGD(0.1), model, steps=2)
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match=r"`loss_fn`.*No gradient reaches any of"):
        fit(x)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(v.numpy(), b)
