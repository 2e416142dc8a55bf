"""stepfuse.tf and what a loss's forward pass writes besides the trained variables.

BatchNorm statistics, a custom layer's non-trainable weights and a metric updated inside
``loss_fn`` are found from the traced loss, however the variables were passed to `fuse`
(the model, or ``model.trainable_variables``): the ``jit_compile="auto"`` trial undoes
them, a refused step puts them back, and a dropout layer's seed state stays advanced after a
refused step, as in the plain loop that ran the forward pass and skipped the update. Also:
variables a partly built model creates in ``loss_fn`` are an error, a failing
``tf.debugging`` check stops the loop before its step changes anything, with ``fit.step``
counting the steps applied before it (and keeps the loop off XLA, which drops the check),
strings keep it off XLA, and a loss of unknown static shape (a ``tf.numpy_function``) runs.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_close

import stepfuse.tf as sf
from stepfuse import Stop

STEPS = 4
RNG = np.random.default_rng(0)
X = tf.constant(RNG.normal(size=(16, 4)).astype(np.float32))
Y = tf.constant(RNG.integers(0, 3, size=16).astype(np.int32))
_ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batchnorm_mlp(dropout=False):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((4,)), keras.layers.Dense(8, use_bias=False)]
    layers.append(keras.layers.BatchNormalization())
    if dropout:
        layers.append(keras.layers.Dropout(0.5, seed=3))
    return keras.Sequential([*layers, keras.layers.Dense(3)])


def plain(loss_fn, optimizer, variables, batches):
    losses = []
    for batch in batches:
        with tf.GradientTape() as tape:
            loss = loss_fn(*batch)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        losses.append(float(loss))
    return np.asarray(losses, np.float32)


def numpy(variables):
    return [v.numpy() for v in variables]


@pytest.mark.parametrize("passed", ["model", "trainable_variables"])
def test_the_auto_trial_leaves_batchnorm_statistics_as_the_plain_loop(passed):
    """The trial of ``jit_compile="auto"`` runs the loop several times and undoes it: the
    moving statistics too, though ``fuse`` was given only the trainable variables (they
    were off by 151% before)."""
    model, ref = batchnorm_mlp(), batchnorm_mlp()
    fit = sf.fuse(
        lambda x, y: _ce(y, model(x, training=True)),
        keras.optimizers.Adam(0.01),
        model if passed == "model" else model.trainable_variables,
        steps=STEPS,
    )
    trace = fit(X, Y)
    assert fit.plan["reason"].startswith("jit_compile='auto'"), fit.plan
    opt = keras.optimizers.Adam(0.01)
    want = plain(
        lambda x, y: _ce(y, ref(x, training=True)), opt, ref.trainable_variables, [(X, Y)] * STEPS
    )
    assert_close(trace.loss, want, 1e-5, 1e-6, what="losses")
    assert_close(numpy(model.variables), numpy(ref.variables), 1e-5, 1e-6, what="variables")


def test_a_metric_updated_in_loss_fn_counts_each_step_once():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    mean = keras.metrics.Mean()

    def loss_fn(x, y):
        loss = _ce(y, model(x))
        mean.update_state(loss)
        return loss

    fit = sf.fuse(loss_fn, keras.optimizers.SGD(0.1), model, steps=STEPS)
    fit(X, Y)
    fit(X, Y, steps=2)
    assert float(mean.count) == STEPS + 2  # the trial's steps are undone


@pytest.mark.parametrize("passed", ["model", "trainable_variables"])
def test_a_refused_step_puts_statistics_back_and_leaves_dropout_draws_drawn(passed):
    """A refused (NONFINITE) step: BatchNorm's statistics back at the last finite point
    whichever way the variables were passed; the dropout seed advanced, as in a plain loop
    that ran the forward pass and skipped the update; the next call equals that loop."""

    model, ref = batchnorm_mlp(dropout=True), batchnorm_mlp(dropout=True)
    fit = sf.fuse(
        lambda x, y, s: _ce(y, model(x, training=True)) * s,
        keras.optimizers.SGD(0.1),
        model if passed == "model" else model.trainable_variables,
        steps=2,
        jit_compile=False,
    )
    fit(X, Y, 1.0)
    refused = fit(X, Y, float("nan"))
    assert refused.stop == Stop.NONFINITE and refused.steps == 0 and fit.step == 2
    after = fit(X, Y, 1.0)

    ref_loss = lambda x, y, s: _ce(y, ref(x, training=True)) * s  # noqa: E731
    opt = keras.optimizers.SGD(0.1)
    plain(ref_loss, opt, ref.trainable_variables, [(X, Y, 1.0)] * 2)
    statistics = numpy(ref.non_trainable_variables[:2])
    ref_loss(X, Y, float("nan"))  # the forward pass runs: the seed advances ...
    for v, old in zip(ref.non_trainable_variables[:2], statistics):
        v.assign(old)  # ... the statistics are those of the last finite step
    want = plain(ref_loss, opt, ref.trainable_variables, [(X, Y, 1.0)] * 2)
    assert_close(after.loss, want, 1e-5, 1e-6, what="losses after the refused call")
    seed = [v for v in model.non_trainable_variables if "seed" in v.path]
    assert len(seed) == 1
    assert_close(numpy(model.variables), numpy(ref.variables), 1e-5, 1e-6, what="variables")


def test_variables_a_partly_built_model_creates_in_loss_fn_are_an_error():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.body = keras.layers.Dense(8)
            self.head = keras.layers.Dense(3)

        def call(self, x):
            return self.head(self.body(x))

    net = Net()
    net.body.build((None, 4))  # the head is built at the first call
    variables = list(net.trainable_variables)
    before = numpy(variables)
    fit = sf.fuse(lambda x, y: _ce(y, net(x)), keras.optimizers.SGD(0.1), variables, steps=2)
    with pytest.raises(ValueError, match=r"created the trainable variables .*Build the model"):
        fit(X, Y)
    assert fit.step == 0
    assert_close(numpy(variables), before, 0, 0, what="untouched")


@pytest.mark.parametrize("jit_compile", ["auto", False])
def test_a_failing_check_stops_the_loop_before_its_step_changes_anything(jit_compile):
    """``tf.debugging.assert_less`` fails at the third step: two updates applied, the
    optimizer's iterations two (not three), as in the plain loop; under "auto" the loop
    runs without XLA, which would drop the check."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(0.01)
    count = tf.Variable(0, trainable=False)

    def loss_fn(x, y):
        count.assign_add(1)
        tf.debugging.assert_less(count, 3, message="third step")
        return _ce(y, model(x))

    fit = sf.fuse(loss_fn, opt, model, steps=STEPS, jit_compile=jit_compile)
    with pytest.raises(tf.errors.InvalidArgumentError, match="third step") as err:
        fit(X, Y)
    assert fit.jit_compile is False
    if jit_compile == "auto":
        assert "Assert" in fit.plan["reason"], fit.plan
    assert int(opt.iterations) == fit.step == 2  # the state and the count agree
    assert "applied 2 step(s) before the one that failed" in "".join(err.value.__notes__)
    count.assign(-10)  # the next call goes on from there
    assert fit(X, Y).steps == STEPS and fit.step == int(opt.iterations) == 2 + STEPS


def test_a_loss_of_unknown_static_shape_runs():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    seen = []

    def host(loss):
        seen.append(float(loss))
        return np.float32(0.0)

    def loss_fn(x, y):
        loss = _ce(y, model(x))
        return loss + tf.numpy_function(host, [loss], tf.float32)  # shape unknown

    fit = sf.fuse(loss_fn, keras.optimizers.SGD(0.1), model, steps=3, jit_compile=False)
    trace = fit(X, Y)
    assert trace.steps == 3 and np.allclose(trace.loss, seen[-3:])


def test_strings_keep_the_loop_off_xla():
    w = tf.Variable([[0.5], [0.5]])

    def loss_fn(text, y):
        x = tf.reshape(tf.strings.to_number(text), [-1, 2])
        return tf.reduce_mean((x @ w - y) ** 2)

    text = tf.constant(["1", "2", "3", "4"])
    y = tf.constant([[1.0], [2.0]])
    fit = sf.fuse(loss_fn, keras.optimizers.SGD(0.01), [w], steps=3)
    trace = fit(text, y)
    assert fit.jit_compile is False and "tf.string" in fit.plan["reason"], fit.plan
    assert trace.steps == 3 and trace.loss[-1] < trace.loss[0]


def test_a_python_int_where_loss_fn_wants_a_float_names_the_fix():
    w = tf.Variable([[0.5], [0.5], [0.5], [0.5]])
    fit = sf.fuse(
        lambda x, beta: tf.reduce_mean((x @ w) ** 2) * (1.0 + beta * tf.ones([])),
        keras.optimizers.SGD(0.01),
        [w],
        steps=2,
    )
    with pytest.raises((TypeError, ValueError), match=r"int32 tensor: pass 0\.0"):
        fit(X, 0)
    assert fit.step == 0 and np.all(w.numpy() == 0.5)
    assert fit(X, 0.0).steps == 2


def test_the_auto_trial_undoes_what_eval_fn_writes():
    """A metric eval_fn updates: the trial's evaluations are undone (it counted 4, 5 for
    the first two evaluations)."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    mean = keras.metrics.Mean()

    def eval_fn(x, y):
        mean.update_state(_ce(y, model(x)))
        return mean.count

    fit = sf.fuse(
        lambda x, y: _ce(y, model(x)),
        keras.optimizers.Adam(0.01),
        model,
        steps=10,
        eval_fn=eval_fn,
        eval_every=5,
    )
    first = fit(X, Y, eval_batch=(X, Y))
    second = fit(X, Y, eval_batch=(X, Y))
    assert fit.plan["reason"].startswith("jit_compile='auto'"), fit.plan
    assert list(first.eval["value"]) == [1.0, 2.0] and list(second.eval["value"]) == [3.0, 4.0]


def test_gradient_accumulation_runs_as_the_plain_loop():
    """Keras's gradient_accumulation_steps: its `iterations` is a quotient, no variable."""
    model, ref = batchnorm_mlp(), batchnorm_mlp()
    opt = keras.optimizers.Adam(0.01, gradient_accumulation_steps=3)
    fit = sf.fuse(lambda x, y: _ce(y, model(x, training=True)), opt, model, steps=STEPS)
    trace = fit(X, Y)
    ref_opt = keras.optimizers.Adam(0.01, gradient_accumulation_steps=3)
    loss = lambda x, y: _ce(y, ref(x, training=True))  # noqa: E731
    want = plain(loss, ref_opt, ref.trainable_variables, [(X, Y)] * STEPS)
    assert_close(trace.loss, want, 1e-5, 1e-6, what="losses")
    assert_close(numpy(model.variables), numpy(ref.variables), 1e-5, 1e-6, what="variables")
    assert int(opt.iterations) == int(ref_opt.iterations) == STEPS // 3


def test_a_checkpoint_of_a_model_passed_whole_holds_its_statistics_and_seeds(tmp_path):
    """Resumed from a checkpoint == uninterrupted, BatchNorm's statistics and the dropout
    seed included (they were not saved: the seed alone moved the losses by 40%)."""
    from stepfuse.tf import checkpoint

    def fit_of(model):
        loss = lambda x, y: _ce(y, model(x, training=True))  # noqa: E731
        return sf.fuse(loss, keras.optimizers.Adam(0.01), model, steps=STEPS, jit_compile=False)

    straight = batchnorm_mlp(dropout=True)
    fit = fit_of(straight)
    fit(X, Y)
    want = fit(X, Y)
    first = batchnorm_mlp(dropout=True)
    saved = fit_of(first)
    saved(X, Y)
    path = checkpoint.save(tmp_path / "fit", saved)
    resumed_model = batchnorm_mlp(dropout=True)
    resumed = fit_of(resumed_model)
    checkpoint.restore(path, resumed)
    got = resumed(X, Y)
    assert_close(got.loss, want.loss, 0, 0, what="losses after the restore")
    assert_close(numpy(resumed_model.variables), numpy(straight.variables), 0, 0, what="model")


def test_a_call_from_the_fits_own_callback_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    refused = []

    def callback(step, loss):
        try:
            fit(X, Y, steps=1)
        except RuntimeError as e:
            refused.append(str(e))

    fit = sf.fuse(
        lambda x, y: _ce(y, model(x)),
        keras.optimizers.SGD(0.1),
        model,
        steps=2,
        callback=callback,
        every=1,
        jit_compile=False,
    )
    assert fit(X, Y).steps == 2 and fit.step == 2
    assert len(refused) == 2 and "stepfuse.tf: this fit is already running" in refused[0]


def test_a_loss_that_applies_its_own_update_is_told_it_makes_two_a_step():
    """``loss_fn`` calling a custom ``train_step`` (which applies the optimizer itself):
    each fused step applied two updates, silently (3 steps, ``iterations`` 6). The fit
    still does what a plain loop with this ``loss_fn`` does, and now warns, naming the
    written variables and the loss-only alternative; a loss that writes only BatchNorm
    statistics is not warned about."""

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x, training=False):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    model = Net()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_ce)
    model(X[:1])
    fit = sf.fuse(lambda x, y: model.train_step((x, y))["loss"], model.optimizer, model, steps=3)
    with pytest.warns(RuntimeWarning, match=r"(?s)writes variables the fit trains.*two updates"):
        fit(X, Y)
    assert int(model.optimizer.iterations) == 6 and fit.step == 3
    bn = batchnorm_mlp()
    bn_fit = sf.fuse(
        lambda x, y: _ce(y, bn(x, training=True)), keras.optimizers.SGD(0.1), bn, steps=2
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        bn_fit(X, Y)
