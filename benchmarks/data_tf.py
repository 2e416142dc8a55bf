"""Training on a resident dataset on TF2: stepfuse with `stepfuse.Epochs` against Keras
``model.fit(..., steps_per_execution=100, jit_compile=True)`` and a ``tf.function`` step
per minibatch, side by side in one process (us/step; x = the rival's time / stepfuse's).

Problems: ``small`` (MLP 32-64-10 tanh, batch 32) and ``mnist`` (MLP 784-256-10 tanh,
batch 128) on 8192 synthetic rows; Adam 1e-3; 2048 steps (shuffled epochs).

    python benchmarks/data_tf.py [--steps 2048] [--rows 8192] [--problems small mnist]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import stepfuse as sf  # noqa: E402
import stepfuse.tf as sft  # noqa: E402

PROBLEMS = {"small": (32, 64, 10, 32), "mnist": (784, 256, 10, 128)}


def _model(d_in: int, hidden: int, classes: int) -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((d_in,)), keras.layers.Dense(hidden, "tanh"), keras.layers.Dense(classes)]
    )


def _ce(model: Any, x: Any, y: Any) -> Any:
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x)))


def bench_stepfuse(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> float:
    d_in, hidden, classes, bs = dims
    model = _model(d_in, hidden, classes)
    data = sf.Epochs(x, y, batch_size=bs, shuffle=True, seed=0)
    fit = sft.fuse(lambda a, b: _ce(model, a, b), keras.optimizers.Adam(1e-3), model, steps=steps)
    fit(data, steps=8)  # compile
    t0 = time.perf_counter()
    trace = fit(data, steps=steps)
    dt = time.perf_counter() - t0
    assert trace.steps == steps and fit.compiles == 1
    print(f"  (stepfuse's loop: xla={fit.plan['xla']}: {fit.plan['reason']})")
    return dt / steps * 1e6


def bench_keras_fit(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> float:
    d_in, hidden, classes, bs = dims
    model = _model(d_in, hidden, classes)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=100,
        jit_compile=True,
    )
    spe = len(x) // bs
    epochs = max(1, steps // spe)
    model.fit(x[: spe * bs], y[: spe * bs], batch_size=bs, epochs=1, shuffle=True, verbose=0)
    t0 = time.perf_counter()
    model.fit(x[: spe * bs], y[: spe * bs], batch_size=bs, epochs=epochs, shuffle=True, verbose=0)
    return (time.perf_counter() - t0) / (epochs * spe) * 1e6


def bench_tf_function_step(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> float:
    d_in, hidden, classes, bs = dims
    model = _model(d_in, hidden, classes)
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
    data = sf.Epochs(x, y, batch_size=bs, shuffle=True, seed=0)
    xd, yd = tf.constant(x), tf.constant(y)
    idx = [tf.constant(data.indices(t)) for t in range(steps)]

    @tf.function(jit_compile=True)
    def step(rows: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = _ce(model, tf.gather(xd, rows), tf.gather(yd, rows))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step(idx[0])
    t0 = time.perf_counter()
    for r in idx:
        loss = step(r)
    float(loss)
    return (time.perf_counter() - t0) / steps * 1e6


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    for name in args.problems:
        dims = PROBLEMS[name]
        x = rng.normal(size=(args.rows, dims[0])).astype("float32")
        y = rng.integers(0, dims[2], size=args.rows).astype("int32")
        row = {
            "stepfuse Epochs": bench_stepfuse(x, y, dims, args.steps),
            "keras fit (spe=100, jit)": bench_keras_fit(x, y, dims, args.steps),
            "tf.function step": bench_tf_function_step(x, y, dims, args.steps),
        }
        out[name] = row
        base = row["stepfuse Epochs"]
        print(f"{name} (batch {dims[3]}, {args.rows} rows, {args.steps} steps):")
        for k, v in row.items():
            print(f"  {k:26s} {v:9.1f} us/step   x{v / base:6.2f}")
    return out


if __name__ == "__main__":
    main()
