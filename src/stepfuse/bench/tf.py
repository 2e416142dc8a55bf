"""TensorFlow 2 / Keras contenders: stepfuse's fused call against the loops a TF2 user would write.

Every contender trains the same problem (`stepfuse.bench.problems.problem`: tanh MLP,
softmax cross-entropy, SGD lr 0.01, full batch) with the Keras 3 optimizer's own update.
The ``cnn`` model size (`model_contenders`) is a Keras CNN with BatchNormalization, timed
against Keras's plain eager loop and a ``tf.function`` of one step.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from .. import tf as sf  # noqa: E402
from .problems import CNN_CHANNELS, CNN_IMAGE, MAX_STEPS, MODEL_CLASSES, model_data, problem  # noqa: E402

CONTENDERS = (
    "stepfuse",
    "stepfuse (no XLA)",
    "tf.function per step",
    "tf.function per step (XLA)",
    "tf.while_loop in tf.function",
    "Keras fit (steps_per_execution)",
)

NOTES = {
    "stepfuse": "stepfuse.tf, one tf.function call, XLA inner loop, trace of every loss",
    "stepfuse (no XLA)": "stepfuse.tf with jit_compile=False",
    "tf.function per step": "one tf.function(GradientTape + apply_gradients) call per step",
    "tf.function per step (XLA)": "the same step as tf.function(jit_compile=True)",
    "tf.while_loop in tf.function": "hand-written tf.while_loop, jit_compile=True, no trace/guards",
    "Keras fit (steps_per_execution)": "model.fit, steps_per_execution=min(N, 1000), jit_compile=True",
    "eager per step": "Keras's plain loop: GradientTape + apply_gradients, eagerly (model sizes)",
}


def mlp_logits(variables, x):
    """The benchmark MLP on ``variables = [k0, b0, k1, b1, ...]``: tanh between layers."""
    h = x
    pairs = list(zip(variables[0::2], variables[1::2]))
    for k, b in pairs[:-1]:
        h = tf.tanh(tf.matmul(h, k) + b)
    k, b = pairs[-1]
    return tf.matmul(h, k) + b


def ce(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def make_variables(layers):
    out = []
    for layer in layers:
        out += [tf.Variable(layer["kernel"]), tf.Variable(layer["bias"])]
    return out


def keras_model(layers):
    """A Keras Sequential with the same weights and activations as `mlp_logits`."""
    stack = [keras.Input((layers[0]["kernel"].shape[0],))]
    for i, layer in enumerate(layers):
        act = "tanh" if i < len(layers) - 1 else None
        stack.append(keras.layers.Dense(layer["kernel"].shape[1], activation=act))
    model = keras.Sequential(stack)
    model.set_weights([w for layer in layers for w in (layer["kernel"], layer["bias"])])
    return model


MODEL_SIZES = ("cnn",)
MODEL_CONTENDERS = ("stepfuse", "stepfuse (no XLA)", "eager per step", "tf.function per step")
"""The contenders of the model sizes (`stepfuse.bench.problems.MODEL_SIZES`)."""

MAX_TIMED = {"cnn": {"stepfuse (no XLA)": 100, "eager per step": 30, "tf.function per step": 100}}
"""Model size -> contender -> at most this many steps per timed call (see `measure`)."""


def keras_cnn():
    """The ``cnn`` size (`stepfuse.bench.problems`) as a Keras model (channels last)."""
    keras.utils.set_random_seed(0)
    stack: list[Any] = [keras.Input((CNN_IMAGE[1], CNN_IMAGE[2], CNN_IMAGE[0]))]
    for channels in CNN_CHANNELS:
        stack += [
            keras.layers.Conv2D(channels, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2),
        ]
    stack += [keras.layers.Flatten(), keras.layers.Dense(MODEL_CLASSES)]
    return keras.Sequential(stack)


_CACHE: dict = {}
"""(size, jit_compile, lr) -> the model size's fit: built once, its program runs every N
(the ``build s`` of a later N is its warm-up call only)."""


def model_contenders(size: str, n: int, lr: float = 0.01) -> Any:
    """Builders for a model size: stepfuse (with and without XLA) against Keras's plain
    eager loop and a ``tf.function`` of one step; the model runs in training mode (its
    BatchNormalization statistics update at every step)."""
    xn, yn = model_data(size)
    x, y = tf.constant(xn.transpose(0, 2, 3, 1)), tf.constant(yn)  # NCHW -> NHWC
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def stepfuse(jit):
        def build():
            def make():
                model = keras_cnn()
                return sf.fuse(
                    lambda x, y: sce(y, model(x, training=True)),
                    keras.optimizers.SGD(lr),
                    model,
                    steps=MAX_STEPS[size],
                    jit_compile=jit,
                )

            fit = _CACHE.get((size, jit, lr))
            if fit is None:
                fit = _CACHE[(size, jit, lr)] = make()

            def run(m):
                return fit(x, y, steps=m)  # returns a host Trace: blocks

            run.fit = fit  # type: ignore[attr-defined]  # its mode goes next to its time
            return run

        return build

    def one_step(compiled):
        def build():
            model = keras_cnn()
            opt = keras.optimizers.SGD(lr)
            variables = model.trainable_variables

            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = sce(y, model(x, training=True))
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
                return loss

            if compiled:
                step = tf.function(step)

            def run(m):
                for _ in range(m):
                    loss = step(x, y)
                return float(loss)

            return run

        return build

    builders = {
        "stepfuse": stepfuse(True),
        "stepfuse (no XLA)": stepfuse(False),
        "eager per step": one_step(False),
        "tf.function per step": one_step(True),
    }
    return builders, {name: min(n, cap) for name, cap in MAX_TIMED[size].items()}


def contenders(size: str, n: int, lr: float = 0.01) -> Any:
    """Builders (see `stepfuse.bench._timing.measure`) for every TF2 contender on ``size``."""
    if size in MODEL_SIZES:
        return model_contenders(size, n, lr)
    layers, xn, yn = problem(size)
    x, y = tf.constant(xn), tf.constant(yn)

    def stepfuse(jit=True):
        def build():
            variables = make_variables(layers)
            fit = sf.fuse(
                lambda x, y: ce(y, mlp_logits(variables, x)),
                keras.optimizers.SGD(lr),
                variables,
                steps=n,
                jit_compile=jit,
            )

            def run(m):
                return fit(x, y, steps=m)  # returns a host Trace: blocks

            run.fit = fit  # type: ignore[attr-defined]  # its mode goes next to its time
            return run

        return build

    def tf_function_per_step(jit=False):
        def build():
            variables = make_variables(layers)
            opt = keras.optimizers.SGD(lr)

            @tf.function(jit_compile=jit)
            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = ce(y, mlp_logits(variables, x))
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
                return loss

            def run(m):
                for _ in range(m):
                    loss = step(x, y)
                return loss.numpy()

            return run

        return build

    def while_loop_xla():
        variables = make_variables(layers)
        opt = keras.optimizers.SGD(lr)
        opt.build(variables)

        def loop(m, x, y):
            def body(i, _):
                with tf.GradientTape() as tape:
                    loss = ce(y, mlp_logits(variables, x))
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
                return i + 1, loss

            return tf.while_loop(lambda i, _: i < m, body, (tf.constant(0), tf.constant(0.0)))[1]

        fn = tf.function(loop, jit_compile=True, autograph=False)
        return lambda m: fn(tf.constant(m, tf.int32), x, y).numpy()

    def keras_fit():
        model = keras_model(layers)
        spe = min(n, 1000)
        model.compile(
            optimizer=keras.optimizers.SGD(lr),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=spe,
            jit_compile=True,
        )
        data = tf.data.Dataset.from_tensors((xn, yn)).repeat()

        def run(m):
            model.fit(data, epochs=1, steps_per_epoch=m, verbose=0, shuffle=False)

        return run

    builders = {
        "stepfuse": stepfuse(True),
        "stepfuse (no XLA)": stepfuse(False),
        "tf.function per step": tf_function_per_step(False),
        "tf.function per step (XLA)": tf_function_per_step(True),
        "tf.while_loop in tf.function": while_loop_xla,
        "Keras fit (steps_per_execution)": keras_fit,
    }
    slow = min(n, 1000)
    return builders, {
        "stepfuse (no XLA)": slow,
        "tf.function per step": slow,
        "tf.function per step (XLA)": slow,
    }
