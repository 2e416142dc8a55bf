"""The benchmark sizes, as NumPy data and parameters every backend builds from.

* ``seed``: the seed's perceptron on 50 points (overhead-bound);
* ``mlp``: an MLP 2-64-64-2 on 1,024 points;
* ``deep``: an MLP 2-16-16-16-2 on 64 points (overhead-bound, with 8 parameter arrays);
* ``wide``: a compute-bound MLP 2-1024-1024-2 on 4,096 points.

Real models (`MODEL_SIZES`; each backend builds its framework's own layers, initialised by
its own seeded initialisers, on the same data from `model_data`):

* ``cnn``: a 3x3 convolution (8 channels, no bias), batch normalisation, ReLU and 2x2 max
  pooling, then a dense layer to 4 classes, on 32 single-channel 8x8 images, in training
  mode (the batch statistics update every step);
* ``lstm``: an LSTM (4 inputs, 8 units) over 5 time steps, its last output through a
  dense layer to 4 classes, on 32 sequences.

They are small because a fused torch program's compile grows with the model (the LSTM's
with its time steps), and one ``stepfuse bench`` of these rows should stay within minutes.
"""

from __future__ import annotations

import numpy as np

from ..problems import blobs, mlp_init, perceptron_init

SIZES = ("seed", "mlp", "wide", "deep")
MODEL_SIZES = ("cnn", "lstm")

# Steps above which a size is too slow on a small CPU to be worth timing in full.
MAX_STEPS = {
    "seed": 10_000,
    "mlp": 10_000,
    "wide": 10,
    "deep": 10_000,
    "cnn": 1000,
    "lstm": 1000,
    "data-small": 10_000,  # the data streams' rows (`stepfuse.bench.data`)
    "data-mnist": 2048,
}

MODEL_CLASSES = 4
MODEL_BATCH = 32
CNN_IMAGE = (1, 8, 8)  # channels, height, width
CNN_CHANNELS = (8,)  # one conv + BatchNorm + ReLU + max-pool block per entry
LSTM_SEQUENCE = (5, 4)  # time steps, features
LSTM_UNITS = 8


def problem(size: str) -> tuple[list[dict[str, np.ndarray]], np.ndarray, np.ndarray]:
    """``(layers, x, y)``: a list of ``{"kernel", "bias"}`` layers (tanh between them) and data."""
    if size == "seed":
        x, y = blobs(50)
        return [perceptron_init()], x, y
    if size == "mlp":
        x, y = blobs(1024, seed=1)
        return mlp_init((2, 64, 64, 2), seed=1), x, y
    if size == "wide":
        x, y = blobs(4096, seed=2)
        return mlp_init((2, 1024, 1024, 2), seed=2), x, y
    if size == "deep":
        x, y = blobs(64, seed=3)
        return mlp_init((2, 16, 16, 16, 2), seed=3), x, y
    raise ValueError(f"unknown size {size!r}; choose from {SIZES}")


def model_data(size: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of a model size: float32 inputs (``cnn``: channels first, ``NCHW``;
    ``lstm``: ``(batch, time, features)``) and int32 labels of `MODEL_CLASSES` classes."""
    shapes = {"cnn": CNN_IMAGE, "lstm": LSTM_SEQUENCE}
    if size not in shapes:
        raise ValueError(f"unknown model size {size!r}; choose from {MODEL_SIZES}")
    rng = np.random.default_rng(4)
    x = rng.normal(size=(MODEL_BATCH, *shapes[size])).astype(np.float32)
    y = rng.integers(0, MODEL_CLASSES, size=MODEL_BATCH).astype(np.int32)
    return x, y
