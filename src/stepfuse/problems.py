"""The seed's problem and a few small ones, as framework-free NumPy arrays.

Every backend, the demo, the benchmarks and the tests build their models from these,
so all of them train exactly the same thing.
"""

from __future__ import annotations

import numpy as np

__all__ = ["blobs", "perceptron_init", "mlp_init", "SEED_LR"]

SEED_LR = 0.01
"""The seed's learning rate (plain gradient descent)."""


def blobs(
    n: int = 50, *, features: int = 2, classes: int = 2, seed: int = 0, spread: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points in ``classes`` Gaussian blobs, as in the seed (50 two-dimensional blobs).

    Returns ``(x, y)``: ``x`` float32 of shape ``(n, features)``, ``y`` int32 labels.
    Deterministic for a given ``seed``.
    """
    rng = np.random.default_rng(seed)
    centers = rng.uniform(-5.0, 5.0, size=(classes, features))
    y = np.arange(n) % classes
    rng.shuffle(y)
    x = centers[y] + spread * rng.standard_normal((n, features))
    return x.astype(np.float32), y.astype(np.int32)


def perceptron_init(features: int = 2, classes: int = 2) -> dict[str, np.ndarray]:
    """The seed's 2->2 dense layer: kernel of ones, bias of zeros (first loss is ln 2)."""
    return {
        "kernel": np.ones((features, classes), np.float32),
        "bias": np.zeros((classes,), np.float32),
    }


def mlp_init(sizes: tuple[int, ...] = (2, 16, 16, 2), seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A small MLP's parameters: a list of ``{"kernel", "bias"}`` layers (Glorot-uniform kernels)."""
    rng = np.random.default_rng(seed)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        layers.append(
            {
                "kernel": rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32),
                "bias": np.zeros((fan_out,), np.float32),
            }
        )
    return layers
