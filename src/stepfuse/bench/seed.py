"""The seed perceptron as a stepfuse fit on each backend, for the benchmark scripts.

``seed_fit(backend, steps, **options)`` builds the fit at the seed's start (kernel of
ones, bias of zeros, SGD lr 0.01, 50 blobs) and returns ``run(steps=None) -> Trace``
that makes one fit call and blocks until it is done.
"""

from __future__ import annotations

from typing import Any

from ..problems import SEED_LR, blobs, perceptron_init

__all__ = ["seed_fit", "BACKENDS"]

BACKENDS = ("jax", "tf", "torch")


def _jax(steps, options):
    import optax

    from .. import jax as sf

    x, y = blobs()

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(
            x @ p["kernel"] + p["bias"], y
        ).mean()

    fit = sf.fuse(loss_fn, optax.sgd(SEED_LR), steps=steps, **options)
    state = fit.init(perceptron_init())
    return lambda steps=None: fit(state, x, y, steps=steps)[1]


def _tf(steps, options):
    import keras
    import tensorflow as tf

    from .. import tf as sf

    x, y = (tf.constant(a) for a in blobs())
    p = perceptron_init()
    kernel, bias = tf.Variable(p["kernel"]), tf.Variable(p["bias"])

    def loss_fn(x, y):
        logits = tf.matmul(x, kernel) + bias
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        )

    fit = sf.fuse(loss_fn, keras.optimizers.SGD(SEED_LR), [kernel, bias], steps=steps, **options)
    return lambda steps=None: fit(x, y, steps=steps)


def _torch(steps, options):
    import torch

    from .. import torch as sf

    xn, yn = blobs()
    x, y = torch.from_numpy(xn), torch.from_numpy(yn).long()
    p = perceptron_init()
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(p["kernel"].T.copy()))
        model.bias.copy_(torch.from_numpy(p["bias"]))
    fit = sf.fuse(
        lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
        torch.optim.SGD(model.parameters(), lr=SEED_LR),
        steps=steps,
        model=model,
        **options,
    )
    return lambda steps=None: fit(x, y, steps=steps)


def seed_fit(backend: str, steps: int, **options: Any) -> Any:
    """``run(steps=None) -> Trace`` for a fresh seed fit on ``backend`` (see module doc)."""
    return {"jax": _jax, "tf": _tf, "torch": _torch}[backend](steps, options)
