"""Optax optimizers that read or re-evaluate the loss, fused against optax's own loop.

`optax.lbfgs` (a zoom line search inside every update), a backtracking line search and
`optax.contrib.reduce_on_plateau` get ``value``/``grad``/``value_fn`` at every update.
The usual way to run them is a Python loop of jitted steps, as optax's docs write it:

    value, grad = value_and_grad(params, ...)
    updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=f)

Contenders, timed side by side in this one process (interleaved best of rounds):
  stepfuse      sf.fuse(loss, opt, steps=N)(state, x, y): the N updates in one call
  jit per step  jax.jit of that step, called N times from Python (what the docs show)

Both run the same updates; the script checks that their final losses agree (1e-5
relative) and that the fused call ran all N before timing. Model: the tanh MLP 2-16-2
on overlapping `stepfuse.problems` blobs (spread 3: the loss stays away from zero).

Run:  python benchmarks/optax_extra_args.py [--steps 200] [--rounds 7]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stepfuse import jax as sf
from stepfuse.bench._timing import interleaved_best
from stepfuse.bench.jax import mlp_loss
from stepfuse.problems import blobs, mlp_init

OPTIMIZERS = {
    "lbfgs": (lambda: optax.lbfgs(), ("value", "grad", "value_fn")),
    "sgd + backtracking line search": (
        lambda: optax.chain(
            optax.sgd(1.0), optax.scale_by_backtracking_linesearch(max_backtracking_steps=15)
        ),
        ("value", "grad", "value_fn"),
    ),
    "adam + reduce_on_plateau": (
        lambda: optax.chain(optax.adam(0.02), optax.contrib.reduce_on_plateau(patience=5)),
        ("value",),
    ),
}


def per_step_loop(make, extra, params, batch):
    """``run(n) -> losses``: the docs' loop, one jitted step per Python iteration."""
    opt = make()

    @jax.jit
    def step(p, s):
        value, grad = jax.value_and_grad(mlp_loss)(p, *batch)
        offered = {"value": value, "grad": grad, "value_fn": lambda q: mlp_loss(q, *batch)}
        updates, s = opt.update(grad, s, p, **{k: offered[k] for k in extra})
        return optax.apply_updates(p, updates), s, value

    def run(n):
        p, s, losses = params, opt.init(params), []
        for _ in range(n):
            p, s, value = step(p, s)
            losses.append(value)
        return np.asarray(jax.block_until_ready(jnp.stack(losses)))

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    n = args.steps
    x, y = blobs(1024, features=2, classes=2, spread=3.0)
    batch = (jnp.asarray(x), jnp.asarray(y))
    params = jax.tree_util.tree_map(jnp.asarray, mlp_init((2, 16, 2)))
    print(
        f"tanh MLP 2-16-2 on 1,024 overlapping points, N={n} updates a call ({jax.default_backend()})"
    )
    for name, (make, extra) in OPTIMIZERS.items():
        fit = sf.fuse(mlp_loss, make(), steps=n)
        state = fit.init(params)
        fused = lambda: fit(state, *batch)[1].loss  # noqa: E731
        loop = per_step_loop(make, extra, params, batch)
        assert fit(state, *batch)[1].steps == n, f"{name}: the fused call stopped early"
        a, b = fused(), loop(n)
        np.testing.assert_allclose(a[-1], b[-1], rtol=1e-5, err_msg=f"{name}: final losses differ")
        best = interleaved_best({"stepfuse": fused, "jit per step": lambda: loop(n)}, args.rounds)
        us = {k: v / n * 1e6 for k, v in best.items()}
        print(
            f"  {name:32s} stepfuse {us['stepfuse']:9.1f} us/update   jit per step "
            f"{us['jit per step']:9.1f}   ratio {us['jit per step'] / us['stepfuse']:5.1f}x   "
            f"(final loss {float(a[-1]):.3g})"
        )


if __name__ == "__main__":
    main()
