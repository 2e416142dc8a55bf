"""Run by tests/test_devices_tf.py in a fresh process: two logical CPU devices must be
configured before TensorFlow initialises. Prints one JSON object: for each check, the
numbers the test asserts on (largest differences, stop codes, modes, error texts)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import stepfuse as sfc  # noqa: E402
import stepfuse.tf as sf  # noqa: E402

STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 3)).astype("float32")
Y = RNG.integers(0, 3, 16).astype("int32")
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model_and_optimizer(distributed: bool, optimizer_outside: bool = False):
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
        )
        return model

    if not distributed:
        return build(), keras.optimizers.Adam(0.05)
    with STRATEGY.scope():
        model = build()
        if not optimizer_outside:
            return model, keras.optimizers.Adam(0.05)
    return model, keras.optimizers.Adam(0.05)


def loss_of(model):
    # A Keras Loss object: in replica context it divides by the replicas (TF's convention)
    return lambda x, y: CE(y, model(x, training=True))


def state(model, optimizer):
    return [np.array(v.numpy()) for v in model.trainable_variables] + [
        np.array(v.numpy()) for v in optimizer.variables
    ]


def gap(a, b):
    return float(
        max(
            np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64)))
            for u, v in zip(a, b)
        )
    )


def run_pair(calls, **options):
    """The same calls on a 2-replica fit and on a one-device fit: their traces and states
    (``calls`` may be a function making them, for arguments a fit consumes: iterators)."""
    out = {}
    for distributed in (True, False):
        model, optimizer = model_and_optimizer(distributed)
        fit = sf.fuse(loss_of(model), optimizer, model, **options)
        traces = [fit(*args, **kw) for args, kw in (calls() if callable(calls) else calls)]
        out[distributed] = (fit, traces, state(model, optimizer), model)
    return out


def compare(out):
    (fd, td, sd, _), (_f1, t1, s1, _) = out[True], out[False]
    return {
        "mode": fd.mode,
        "plan_xla": fd.plan["xla"],
        "plan_reason": fd.plan["reason"],
        "loss_gap": gap([t.loss for t in td], [t.loss for t in t1]),
        "state_gap": gap(sd, s1),
        "steps": [t.steps for t in td],
        "steps_one_device": [t.steps for t in t1],
        "stops": [int(t.stop) for t in td],
        "stops_one_device": [int(t.stop) for t in t1],
        "fit_step": fd.step,
        "loss_scale": float(np.max(np.abs(np.concatenate([t.loss for t in t1])))),
    }


def main() -> None:
    results = {}
    x, y = tf.constant(X), tf.constant(Y)
    results["fixed"] = compare(run_pair([((x, y), {}), ((x, y), {"steps": 3})], steps=5))

    epochs = sfc.Epochs(X, Y, batch_size=4, shuffle=True, seed=1)
    results["epochs"] = compare(run_pair([((epochs,), {}), ((epochs,), {"steps": 6})], steps=5))

    xs = RNG.normal(size=(4, 6, 3)).astype("float32")
    ys = RNG.integers(0, 3, (4, 6)).astype("int32")
    results["batches"] = compare(run_pair([((sfc.Batches(xs, ys),), {"steps": 4})], steps=4))

    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(4, drop_remainder=True).repeat()
    results["iterator"] = compare(
        run_pair(lambda: [((iter(dataset),), {}), ((iter(dataset),), {"steps": 2})], steps=5)
    )

    notes = {True: [], False: []}

    def recorder(distributed):
        return lambda step, loss: notes[distributed].append((step, loss))

    out = {}
    for distributed in (True, False):
        model, optimizer = model_and_optimizer(distributed)

        def evaluation(xv, yv, model=model):
            return {"loss": CE(yv, model(xv, training=False))}

        fit = sf.fuse(
            loss_of(model),
            optimizer,
            model,
            steps=6,
            record_every=2,
            callback=recorder(distributed),
            every=2,
            eval_fn=evaluation,
            eval_every=3,
        )
        trace = fit(x, y, eval_batch=(x[:8], y[:8]))
        out[distributed] = (fit, [trace], state(model, optimizer), model)
    row = compare(out)
    (_, [td], _, _), (_, [t1], _, _) = out[True], out[False]
    row["eval_steps"] = [int(s) for s in td.eval.step]
    row["eval_steps_one_device"] = [int(s) for s in t1.eval.step]
    row["eval_gap"] = gap([td.eval["loss"]], [t1.eval["loss"]])
    row["notes"] = [s for s, _ in notes[True]]
    row["notes_one_device"] = [s for s, _ in notes[False]]
    row["note_gap"] = gap([[v for _, v in notes[True]]], [[v for _, v in notes[False]]])
    results["options"] = row

    results["stepwise"] = compare(
        {
            True: run_pair([((x, y), {})], steps=4)[True],
            False: run_pair([((x, y), {})], steps=4, mode="stepwise")[True],
        }
    )

    # NaN/inf in one replica's rows only (rows 8..15 go to replica 1): refused on all
    bad = X.copy()
    bad[12, 0] = np.inf
    model, optimizer = model_and_optimizer(True)
    fit = sf.fuse(loss_of(model), optimizer, model, steps=4)
    fit(x, y, steps=2)
    before = state(model, optimizer)
    trace = fit(tf.constant(bad), y)
    copies = [
        gap([v.value.values[0].numpy()], [v.value.values[1].numpy()])
        for v in model.trainable_variables
    ]
    results["nonfinite"] = {
        "stop": int(trace.stop),
        "steps": trace.steps,
        "unchanged": gap(before, state(model, optimizer)),
        "replica_copies_gap": max(copies),
        "fit_step": fit.step,
    }

    # bad input: 7 rows do not split over 2 replicas; nothing runs
    model, optimizer = model_and_optimizer(True)
    fit = sf.fuse(loss_of(model), optimizer, model, steps=3)
    before = state(model, optimizer)
    try:
        fit(x[:7], y[:7])
        results["uneven"] = {"error": None}
    except ValueError as e:
        results["uneven"] = {
            "error": str(e),
            "unchanged": gap(before, state(model, optimizer)),
            "fit_step": fit.step,
        }
    # a tf.data batch of unknown rows (no drop_remainder): refused, naming the fix
    model, optimizer = model_and_optimizer(True)
    fit = sf.fuse(loss_of(model), optimizer, model, steps=3)
    loose = tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat()
    try:
        fit(iter(loose))
        results["unknown_rows"] = {"error": None}
    except ValueError as e:
        results["unknown_rows"] = {
            "error": str(e),
            "unchanged": gap(before, state(model, optimizer)),
            "fit_step": fit.step,
        }
    model, optimizer = model_and_optimizer(True, optimizer_outside=True)
    try:
        sf.fuse(loss_of(model), optimizer, model, steps=3)
        results["optimizer_outside"] = {"error": None}
    except ValueError as e:
        results["optimizer_outside"] = {"error": str(e)}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
