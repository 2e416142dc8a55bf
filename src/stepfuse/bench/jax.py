"""JAX contenders: stepfuse's fused call against the loops a JAX user would write."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from .. import jax as sf
from .problems import problem

CONTENDERS = (
    "stepfuse",
    "fori_loop",
    "fori_loop (loss each step)",
    "fori_loop (recording losses)",
    "scan (with losses)",
    "jit per step",
)


def mlp_loss(layers, x, y):
    h = x
    for layer in layers[:-1]:
        h = jnp.tanh(h @ layer["kernel"] + layer["bias"])
    logits = h @ layers[-1]["kernel"] + layers[-1]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def optax_steps(optimizer, batch, loss_fn=mlp_loss):
    """The hand-written contenders' steps: ``grad_step(p, s) -> (p, s)`` (the gradient
    only) and ``loss_step(p, s) -> (p, s, loss)`` (value_and_grad: the loss as well)."""

    def grad_step(p, s):
        g = jax.grad(loss_fn)(p, *batch)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s

    def loss_step(p, s):
        value, g = jax.value_and_grad(loss_fn)(p, *batch)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    return grad_step, loss_step


def _jit(fn, compiler_options=None):
    return jax.jit(fn, **({"compiler_options": compiler_options} if compiler_options else {}))


def fori_loops(
    grad_step: Any, loss_step: Any, compiler_options: Any = None, capacity: int = 10_000
) -> Any:
    """The hand-written ``lax.fori_loop`` contenders, jitted as ``run(params, opt_state, m)``:
    of `optax_steps`' gradient step; of its loss step keeping the last loss (nothing
    recorded), the floor for any loop that reports per-step losses; and of its loss step
    writing each loss into a buffer of ``capacity`` (``m`` at most), as a user would to get
    the per-step losses a stepfuse trace holds."""

    def recording(p, s, m):
        def body(i, c):
            p, s, losses = c
            p, s, value = loss_step(p, s)
            return p, s, losses.at[i].set(value)

        return jax.lax.fori_loop(0, m, body, (p, s, jnp.full((capacity,), jnp.nan, jnp.float32)))

    return {
        "fori_loop": _jit(
            lambda p, s, m: jax.lax.fori_loop(0, m, lambda _, c: grad_step(*c), (p, s)),
            compiler_options,
        ),
        "fori_loop (loss each step)": _jit(
            lambda p, s, m: jax.lax.fori_loop(
                0, m, lambda _, c: loss_step(*c[:2]), (p, s, jnp.float32(0))
            ),
            compiler_options,
        ),
        "fori_loop (recording losses)": _jit(recording, compiler_options),
    }


OPTIMIZERS = {
    "sgd": optax.sgd,
    "momentum": lambda lr: optax.sgd(lr, momentum=0.9),
    "adam": optax.adam,
}


def contenders(
    size: str, n: int, lr: float = 0.01, compiler_options: Any = None, optimizer: str = "sgd"
) -> Any:
    """Builders (see `stepfuse.bench._timing.measure`) for every JAX contender on ``size``
    with ``OPTIMIZERS[optimizer](lr)``; ``compiler_options`` (XLA options) go to every
    contender's ``jax.jit`` alike."""
    layers, x, y = problem(size)
    params = jax.tree_util.tree_map(jnp.asarray, layers)
    batch = (jnp.asarray(x), jnp.asarray(y))
    tx = OPTIMIZERS[optimizer](lr)
    loss_fn = mlp_loss
    one_step, loss_step = optax_steps(tx, batch, loss_fn)
    loops = fori_loops(one_step, loss_step, compiler_options, capacity=n)

    def stepfuse():
        fit = sf.fuse(loss_fn, tx, steps=n, compiler_options=compiler_options)
        state = fit.init(params)
        return lambda m: fit(state, *batch, steps=m)[1].loss

    def fori(name):
        def build():
            run, s0 = loops[name], tx.init(params)
            return lambda m: jax.block_until_ready(run(params, s0, m))

        return build

    def scan():
        def body(c, _):
            p, s, value = loss_step(*c)
            return (p, s), value

        run = _jit(lambda p, s: jax.lax.scan(body, (p, s), None, length=n), compiler_options)
        s0 = tx.init(params)
        return lambda m: jax.block_until_ready(run(params, s0))

    def jit_per_step():
        step = _jit(one_step, compiler_options)
        s0 = tx.init(params)

        def run(m):
            c = (params, s0)
            for _ in range(m):
                c = step(*c)
            return jax.block_until_ready(c)

        return run

    return {
        "stepfuse": stepfuse,
        "fori_loop": fori("fori_loop"),
        "fori_loop (loss each step)": fori("fori_loop (loss each step)"),
        "fori_loop (recording losses)": fori("fori_loop (recording losses)"),
        "scan (with losses)": scan,
        "jit per step": jit_per_step,
    }, {"jit per step": min(n, 1000)}
