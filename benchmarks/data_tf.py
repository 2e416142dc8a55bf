"""Training on a resident dataset on TF2: stepfuse with `stepfuse.Epochs` against Keras
``model.fit(..., steps_per_execution=100, jit_compile=True)``, a ``tf.function`` step per
minibatch and a hand-written XLA ``tf.while_loop`` (with and without a finite check), side
by side in one process, interleaved, best of ``--repeat`` (us/step; x = the rival's time /
stepfuse's).

Problems: ``small`` (MLP 32-64-10 tanh, batch 32) and ``mnist`` (MLP 784-256-10 tanh,
batch 128) on 8192 synthetic rows; Adam 1e-3; 2048 steps (shuffled epochs).

    python benchmarks/data_tf.py [--steps 2048] [--rows 8192] [--problems small mnist] [--repeat 3]
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


# Each contender is built and run once (compiling it), then returns ``(run, steps)``: a
# call that runs ``steps`` more steps, timed by `main` interleaved with the others.


def bench_stepfuse(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> tuple:
    d_in, hidden, classes, bs = dims
    model = _model(d_in, hidden, classes)
    data = sf.Epochs(x, y, batch_size=bs, shuffle=True, seed=0)
    fit = sft.fuse(lambda a, b: _ce(model, a, b), keras.optimizers.Adam(1e-3), model, steps=steps)
    fit(data, steps=8)  # compile
    fit(data, steps=steps)

    def run() -> None:
        trace = fit(data, steps=steps)
        assert trace.steps == steps and fit.compiles == 1

    print(f"  (stepfuse's loop: xla={fit.plan['xla']}: {fit.plan['reason']})")
    return run, steps


def bench_keras_fit(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> tuple:
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
    xs, ys = x[: spe * bs], y[: spe * bs]
    model.fit(xs, ys, batch_size=bs, epochs=1, shuffle=True, verbose=0)

    def run() -> None:
        model.fit(xs, ys, batch_size=bs, epochs=epochs, shuffle=True, verbose=0)

    return run, epochs * spe


def bench_tf_function_step(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> tuple:
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

    def run() -> None:
        for r in idx:
            loss = step(r)
        float(loss)

    return run, steps


def bench_while_loop(
    x: np.ndarray, y: np.ndarray, dims: tuple, steps: int, check: bool = False, fixed: bool = False
) -> tuple:
    """A hand-written ``tf.while_loop`` under XLA: every step's loss into a
    ``TensorArray``, rows from an on-device permutation drawn at each epoch
    (``argsort`` of stateless uniforms); ``check``: an update applied only where the loss
    and gradients are finite (a ``tf.cond``), as a careful user would guard it; ``fixed``: the first minibatch at every step, no
    permutation (the floor of any TF2 loop of this step: no data drawn, nothing checked)."""
    d_in, hidden, classes, bs = dims
    model = _model(d_in, hidden, classes)
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
    variables = model.trainable_variables
    xd, yd = tf.constant(x), tf.constant(y)
    rows = len(x)
    spe = rows // bs

    def shuffled(epoch: Any) -> Any:
        keys = tf.random.stateless_uniform([rows], seed=tf.stack([epoch, 0]))
        return tf.argsort(keys, stable=True)

    @tf.function(jit_compile=True, autograph=False)
    def loop(t0: Any) -> Any:
        def body(t: Any, order: Any, losses: Any) -> tuple:
            epoch, at = t // spe, t % spe
            order = tf.cond(tf.equal(at, 0), lambda: shuffled(epoch), lambda: order)
            picked = tf.range(bs) if fixed else tf.gather(order, at * bs + tf.range(bs))
            with tf.GradientTape() as tape:
                loss = _ce(model, tf.gather(xd, picked), tf.gather(yd, picked))
            grads = tape.gradient(loss, variables)
            if check:
                finite = tf.reduce_all(
                    tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in [loss, *grads]])
                )

                def apply() -> Any:
                    opt.apply_gradients(zip(grads, variables))
                    return tf.constant(True)

                tf.cond(finite, apply, lambda: tf.constant(False))
            else:
                opt.apply_gradients(zip(grads, variables))
            return t + 1, order, losses.write(t - t0, loss)

        losses = tf.TensorArray(tf.float32, size=steps)
        _, _, losses = tf.while_loop(
            lambda t, o, ls: t < t0 + steps, body, (t0, shuffled(t0 // spe), losses)
        )
        return losses.stack()

    done = [0]

    def run() -> None:
        loop(tf.constant(done[0])).numpy()
        done[0] += steps

    run()
    return run, steps


CONTENDERS = {
    "stepfuse Epochs": bench_stepfuse,
    "keras fit (spe=100, jit)": bench_keras_fit,
    "tf.function step": bench_tf_function_step,
    "tf.while_loop by hand": bench_while_loop,
    "tf.while_loop + finite check": lambda *a: bench_while_loop(*a, check=True),
    "tf.while_loop, fixed batch": lambda *a: bench_while_loop(*a, fixed=True),
}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (best kept)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    for name in args.problems:
        dims = PROBLEMS[name]
        x = rng.normal(size=(args.rows, dims[0])).astype("float32")
        y = rng.integers(0, dims[2], size=args.rows).astype("int32")
        runs = {k: make(x, y, dims, args.steps) for k, make in CONTENDERS.items()}
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeat):  # interleaved rounds
            for k, (run, n) in runs.items():
                t0 = time.perf_counter()
                run()
                best[k] = min(best[k], (time.perf_counter() - t0) / n * 1e6)
        out[name] = best
        base = best["stepfuse Epochs"]
        print(
            f"{name} (batch {dims[3]}, {args.rows} rows, {args.steps} steps, best of {args.repeat}):"
        )
        for k, v in best.items():
            print(f"  {k:30s} {v:9.1f} us/step   x{v / base:6.2f}")
    return out


if __name__ == "__main__":
    main()
