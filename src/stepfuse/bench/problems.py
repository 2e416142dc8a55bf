"""The benchmark sizes, as NumPy data and parameters every backend builds from.

* ``seed``: the seed's perceptron on 50 points (overhead-bound);
* ``mlp``: an MLP 2-64-64-2 on 1,024 points;
* ``deep``: an MLP 2-16-16-16-2 on 64 points (overhead-bound, with 8 parameter arrays);
* ``wide``: a compute-bound MLP 2-1024-1024-2 on 4,096 points.
"""

from __future__ import annotations

import numpy as np

from ..problems import blobs, mlp_init, perceptron_init

SIZES = ("seed", "mlp", "wide", "deep")

# Steps above which a size is too slow on a small CPU to be worth timing in full.
MAX_STEPS = {"seed": 10_000, "mlp": 10_000, "wide": 10, "deep": 10_000}


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
