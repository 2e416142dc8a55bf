"""What the finite check of each step costs a TF2 fit under XLA, side by side in one process.

Under XLA:CPU stepfuse groups the tensors it checks by shape and ands their ``is_finite``
masks, one reduction a group (`stepfuse.tf._loop._finite_by_shape`). This script builds the
same fit with that rule, with the earlier rule (``reduce_all(is_finite(t))`` for each tensor
of at least 512 values, the smaller ones concatenated and summed as ``x * 0``) and with
every tensor concatenated (the rule on TensorFlow's kernels), on a fixed batch and on
`stepfuse.Epochs`, and prints us/step (best of ``--repeat`` interleaved calls) and the
ratio to the default.

Problems (as `benchmarks/data_tf.py`): ``small`` (MLP 32-64-10 tanh, batch 32) and
``mnist`` (MLP 784-256-10 tanh, batch 128) on 8192 synthetic rows, Adam 1e-3.

    python benchmarks/finite_check_tf.py [--problems small mnist] [--repeat 7]
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
from stepfuse.tf import _loop  # noqa: E402

PROBLEMS = {"small": (32, 64, 10, 32, 2048), "mnist": (784, 256, 10, 128, 256)}


def _per_tensor(flat: list) -> Any:
    """The earlier rule: each tensor of 512 values or more on its own, the rest summed."""
    large = [t for t in flat if t.shape.num_elements() >= 512]
    small = [tf.reshape(tf.cast(t, tf.float32), [-1]) for t in flat if t.shape.num_elements() < 512]
    oks = [tf.reduce_all(tf.math.is_finite(t)) for t in large]
    if small:
        oks.append(tf.math.is_finite(tf.reduce_sum(tf.concat(small, 0) * 0)))
    return tf.reduce_all(tf.stack(oks))


def _concatenated(flat: list) -> Any:
    """Every value in one concatenation, summed as ``x * 0``."""
    values = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in flat], 0)
    return tf.math.is_finite(tf.reduce_sum(values * 0))


RULES = {
    "by shape (default)": _loop._finite_by_shape,
    "per tensor (earlier)": _per_tensor,
    "all concatenated": _concatenated,
}


def _fit(dims: tuple, rule: Any, args: tuple, steps: int) -> Any:
    d_in, hidden, classes = dims[:3]
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((d_in,)), keras.layers.Dense(hidden, "tanh"), keras.layers.Dense(classes)]
    )

    def loss(a: Any, b: Any) -> Any:
        logits = model(a)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(b, logits))

    fit = sft.fuse(loss, keras.optimizers.Adam(1e-3), model, steps=steps, jit_compile=True)
    default, _loop._finite_by_shape = _loop._finite_by_shape, rule  # read while traced
    try:
        fit(*args)
    finally:
        _loop._finite_by_shape = default
    return fit


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    for name in args.problems:
        *dims, steps = PROBLEMS[name]
        x = rng.normal(size=(8192, dims[0])).astype("float32")
        y = rng.integers(0, dims[2], size=8192).astype("int32")
        feeds = {
            "fixed batch": (tf.constant(x[: dims[3]]), tf.constant(y[: dims[3]])),
            "Epochs": (sf.Epochs(x, y, batch_size=dims[3], seed=0),),
        }
        fits = {
            (feed, rule): (_fit(tuple(dims), n, batch, steps), batch)
            for feed, batch in feeds.items()
            for rule, n in RULES.items()
        }
        best = dict.fromkeys(fits, float("inf"))
        for _ in range(args.repeat):
            for key, (fit, batch) in fits.items():
                t0 = time.perf_counter()
                fit(*batch)
                best[key] = min(best[key], time.perf_counter() - t0)
        print(f"{name} ({steps} steps a call, best of {args.repeat}):")
        for (feed, rule), t in best.items():
            us = t / steps * 1e6
            base = best[(feed, "by shape (default)")] / steps * 1e6
            out.setdefault(name, {})[f"{feed}, {rule}"] = us
            print(f"  {feed:12s} {rule:22s} {us:9.1f} us/step   x{us / base:5.2f}")
    return out


if __name__ == "__main__":
    main()
