"""The data-stream rows of ``stepfuse bench``: a fit over `stepfuse.Epochs` against the
minibatch loops a user of each framework would write to train on the same dataset.

Two problems on the same resident synthetic dataset of `ROWS` rows (`dataset`), Adam
1e-3, a tanh MLP and softmax cross-entropy:

* ``data-small``: MLP 32-64-10, minibatches of 32 (256 steps an epoch);
* ``data-mnist``: MLP 784-256-10, minibatches of 128 (64 steps an epoch).

Contenders, per backend (each trains on every step's own minibatch, reshuffled every epoch):

* JAX: ``stepfuse`` (``fit(state, sf.Epochs(x, y, batch_size=B), steps=N)``); ``lax.scan
  (on-device shuffle)``, the hand-written loop: an on-device permutation per epoch
  (``jax.random.permutation``) and a ``lax.scan`` over its minibatches, inside one jit (the
  call's steps a whole number of epochs, as such a loop is written); ``jit per step``: a
  jitted step per minibatch, the minibatches on the device beforehand.
* TF2: ``stepfuse``; ``keras fit (spe=100, jit)``: ``model.fit(x, y, batch_size=B,
  shuffle=True)`` with ``steps_per_execution=100, jit_compile=True``; ``tf.function
  step``: one XLA step per minibatch gathered on the device; ``tf.while_loop (on-device
  shuffle)``, the hand-written loop: an on-device permutation per epoch and a
  ``tf.while_loop`` over its minibatches (``tf.gather`` of the rows), inside one XLA
  ``tf.function`` (whole epochs, the last loss returned).
* torch: ``stepfuse``; ``eager DataLoader``: the eager loop over a shuffling
  ``DataLoader(TensorDataset(x, y), batch_size=B, shuffle=True, drop_last=True)``; ``eager
  (resident rows)``: the eager loop taking each minibatch by indexing the resident tensors
  with a ``torch.randperm`` drawn each epoch (no DataLoader); ``torch.compile step``: the
  same loop with the model and ``opt.step`` each compiled by ``torch.compile``, as torch's
  tutorial on compiling the optimizer writes it.

The side-by-side scripts ``benchmarks/data_*.py`` time the same contenders at the issue's
2,048 steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from .._core import ceil_div

DATA_SIZES = ("data-small", "data-mnist")
ROWS = 8192
PROBLEMS = {"data-small": ((32, 64, 10), 32), "data-mnist": ((784, 256, 10), 128)}
"""size -> ((inputs, hidden, classes), batch size)."""
LR = 1e-3

CONTENDERS = {
    "jax": ("stepfuse", "lax.scan (on-device shuffle)", "jit per step"),
    "tf": (
        "stepfuse",
        "tf.while_loop (on-device shuffle)",
        "keras fit (spe=100, jit)",
        "tf.function step",
    ),
    "torch": ("stepfuse", "eager DataLoader", "eager (resident rows)", "torch.compile step"),
}

Builders = dict[str, Callable[[], Callable[[int], object]]]


def dataset(size: str) -> tuple[np.ndarray, np.ndarray, int, tuple[int, int, int]]:
    """``(x, y, batch_size, (inputs, hidden, classes))`` of a data size: float32 inputs
    and int32 labels, the same for every backend."""
    if size not in PROBLEMS:
        raise ValueError(f"unknown data size {size!r}; choose from {DATA_SIZES}")
    (d, h, k), bs = PROBLEMS[size]
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, d)).astype(np.float32)
    y = rng.integers(0, k, size=ROWS).astype(np.int32)
    return x, y, bs, (d, h, k)


def contenders(backend: str, size: str, n: int) -> tuple[Builders, dict[str, int]]:
    """The builders of ``backend``'s contenders for ``size`` and the steps each is timed on."""
    build = {"jax": _jax, "tf": _tf, "torch": _torch}[backend]
    return build(size, n)


def _whole_epochs(n: int, spe: int) -> int:
    """``n`` rounded up to whole epochs (a hand-written epoch loop runs whole epochs)."""
    return ceil_div(n, spe) * spe


# -- JAX -------------------------------------------------------------------------------------


def _jax(size: str, n: int) -> tuple[Builders, dict[str, int]]:
    import jax
    import jax.numpy as jnp
    import optax

    from .. import Epochs
    from .. import jax as sfj
    from ..problems import mlp_init
    from .jax import mlp_loss

    x, y, bs, (d, h, k) = dataset(size)
    spe = ROWS // bs
    init = mlp_init((d, h, k), seed=5)
    tx = optax.adam(LR)

    def stepfuse():
        fit = sfj.fuse(mlp_loss, tx, steps=n)
        state = [fit.init(init)]
        data = Epochs(x, y, batch_size=bs, seed=0)

        def run(m):
            state[0], trace = fit(state[0], data, steps=m)
            return trace.loss  # read on the host: the call has finished

        run.fit = fit  # type: ignore[attr-defined]  # its mode goes into the table
        return run

    def scan():
        xd, yd = jnp.asarray(x), jnp.asarray(y)

        @functools.partial(jax.jit, static_argnums=3)
        def epochs(p, s, key, count):
            def one_epoch(carry, e):
                p, s = carry
                perm = jax.random.permutation(jax.random.fold_in(key, e), ROWS)
                batches = perm[: spe * bs].reshape(spe, bs)

                def step(carry, rows):
                    p, s = carry
                    value, g = jax.value_and_grad(mlp_loss)(p, xd[rows], yd[rows])
                    u, s = tx.update(g, s, p)
                    return (optax.apply_updates(p, u), s), value

                (p, s), losses = jax.lax.scan(step, (p, s), batches)
                return (p, s), losses

            return jax.lax.scan(one_epoch, (p, s), jnp.arange(count))

        params = jax.tree_util.tree_map(jnp.asarray, init)
        carry = [(params, tx.init(params))]
        key = jax.random.key(0)

        def run(m):
            (p, s), losses = epochs(*carry[0], key, m // spe)
            carry[0] = (p, s)
            return losses.block_until_ready()

        return run

    def per_step():
        data = Epochs(x, y, batch_size=bs, seed=0)
        feeds = [tuple(jnp.asarray(a) for a in data.batch(t)) for t in range(min(n, 512))]

        @jax.jit
        def step(p, s, xb, yb):
            value, g = jax.value_and_grad(mlp_loss)(p, xb, yb)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, value

        params = jax.tree_util.tree_map(jnp.asarray, init)
        carry = [(params, tx.init(params))]

        def run(m):
            p, s = carry[0]
            for t in range(m):
                p, s, value = step(p, s, *feeds[t % len(feeds)])
            carry[0] = (p, s)
            return value.block_until_ready()

        return run

    steps_for = {"lax.scan (on-device shuffle)": _whole_epochs(n, spe), "jit per step": min(n, 512)}
    return {
        "stepfuse": stepfuse,
        "lax.scan (on-device shuffle)": scan,
        "jit per step": per_step,
    }, steps_for


# -- TF2 / Keras -----------------------------------------------------------------------------


def _tf(size: str, n: int) -> tuple[Builders, dict[str, int]]:
    import keras
    import tensorflow as tf

    from .. import Epochs
    from .. import tf as sft

    x, y, bs, (d, h, k) = dataset(size)
    spe = ROWS // bs

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((d,)), keras.layers.Dense(h, "tanh"), keras.layers.Dense(k)]
        )

    def ce(m, xb, yb):
        logits = m(xb)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits)
        )

    def stepfuse():
        m = model()
        fit = sft.fuse(lambda a, b: ce(m, a, b), keras.optimizers.Adam(LR), m, steps=n)
        data = Epochs(x, y, batch_size=bs, seed=0)

        def run(steps):
            return fit(data, steps=steps).loss

        run.fit = fit  # type: ignore[attr-defined]
        return run

    def keras_fit():
        m = model()
        m.compile(
            optimizer=keras.optimizers.Adam(LR),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=100,
            jit_compile=True,
        )

        def run(steps):
            m.fit(x, y, batch_size=bs, epochs=steps // spe, shuffle=True, verbose=0)

        return run

    def per_step():
        m = model()
        opt = keras.optimizers.Adam(LR)
        xd, yd = tf.constant(x), tf.constant(y)
        data = Epochs(x, y, batch_size=bs, seed=0)
        rows = [tf.constant(data.indices(t)) for t in range(min(n, 512))]

        @tf.function(jit_compile=True)
        def step(r):
            with tf.GradientTape() as tape:
                loss = ce(m, tf.gather(xd, r), tf.gather(yd, r))
            grads = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(grads, m.trainable_variables))
            return loss

        def run(steps):
            for t in range(steps):
                loss = step(rows[t % len(rows)])
            return float(loss)

        return run

    def while_loop():
        m = model()
        opt = keras.optimizers.Adam(LR)
        opt.build(m.trainable_variables)
        xd, yd = tf.constant(x), tf.constant(y)

        @tf.function(jit_compile=True, autograph=False)
        def epochs(count, seed):
            def one_epoch(e, _):
                keys = tf.random.stateless_uniform([ROWS], tf.stack([seed, e]))
                perm = tf.argsort(keys)

                def step(i, _):
                    rows = tf.gather(perm, i * bs + tf.range(bs))
                    with tf.GradientTape() as tape:
                        loss = ce(m, tf.gather(xd, rows), tf.gather(yd, rows))
                    grads = tape.gradient(loss, m.trainable_variables)
                    opt.apply_gradients(zip(grads, m.trainable_variables))
                    return i + 1, loss

                _, loss = tf.while_loop(lambda i, _: i < spe, step, (0, 0.0))
                return e + 1, loss

            return tf.while_loop(lambda e, _: e < count, one_epoch, (0, 0.0))[1]

        epoch0 = [0]

        def run(steps):
            count = steps // spe
            loss = epochs(tf.constant(count), tf.constant(epoch0[0]))
            epoch0[0] += 1
            return float(loss)

        return run

    steps_for = {
        "keras fit (spe=100, jit)": _whole_epochs(n, spe),
        "tf.function step": min(n, 512),
        "tf.while_loop (on-device shuffle)": _whole_epochs(n, spe),
    }
    return {
        "stepfuse": stepfuse,
        "tf.while_loop (on-device shuffle)": while_loop,
        "keras fit (spe=100, jit)": keras_fit,
        "tf.function step": per_step,
    }, steps_for


# -- PyTorch ---------------------------------------------------------------------------------


def _torch(size: str, n: int) -> tuple[Builders, dict[str, int]]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from .. import Epochs
    from .. import torch as sft

    xn, yn, bs, (d, h, k) = dataset(size)
    x, y = torch.from_numpy(xn), torch.from_numpy(yn).long()

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, k))

    def stepfuse():
        m = model()
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        fit = sft.fuse(lambda a, b: F.cross_entropy(m(a), b), opt, steps=n, model=m)
        data = Epochs(x, y, batch_size=bs, seed=0)

        def run(steps):
            return fit(data, steps=steps).loss

        run.fit = fit  # type: ignore[attr-defined]
        return run

    def eager():
        m = model()
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=bs, shuffle=True, drop_last=True
        )

        def run(steps):
            done = 0
            while done < steps:
                for xb, yb in loader:
                    opt.zero_grad()
                    loss = F.cross_entropy(m(xb), yb)
                    loss.backward()
                    opt.step()
                    done += 1
                    if done == steps:
                        break
            return float(loss.detach())

        return run

    def resident(compiled: bool) -> Callable[[], Callable[[int], object]]:
        def build():
            m = model()
            opt = torch.optim.Adam(m.parameters(), lr=LR)
            g = torch.Generator().manual_seed(0)
            forward = torch.compile(m) if compiled else m
            update = torch.compile(opt.step) if compiled else opt.step
            spe = len(x) // bs

            def run(steps):
                loss = None
                for t in range(steps):
                    if t % spe == 0:
                        perm = torch.randperm(len(x), generator=g)
                    rows = perm[(t % spe) * bs : (t % spe + 1) * bs]
                    opt.zero_grad()
                    loss = F.cross_entropy(forward(x[rows]), y[rows])
                    loss.backward()
                    update()
                return float(loss.detach())  # type: ignore[union-attr]

            return run

        return build

    few = min(n, 512)
    builders = {
        "stepfuse": stepfuse,
        "eager DataLoader": eager,
        "eager (resident rows)": resident(False),
        "torch.compile step": resident(True),
    }
    return builders, {k: few for k in builders if k != "stepfuse"}
