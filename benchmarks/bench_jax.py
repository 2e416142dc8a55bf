"""JAX on the seed problem: stepfuse's fused call against the hand-written loops.

Contenders, timed side by side in this one process (best of interleaved repeats):
  stepfuse        sf.fuse(...)(state, x, y): the fused while loop with trace, tol/NaN checks
  fori_loop       a hand-written lax.fori_loop of optax steps, no trace
  scan            a hand-written lax.scan of optax steps returning per-step losses
  jit_per_step    jax.jit of one step, called N times from Python

Run:  python benchmarks/bench_jax.py [--steps 10000] [--json FILE]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import stepfuse.jax as sf
from stepfuse.bench._timing import measure, print_table, write_json
from stepfuse.problems import SEED_LR, blobs, perceptron_init


def seed_loss(params, x, y):
    logits = x @ params["kernel"] + params["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def contenders(loss_fn, params, batch, optimizer, n):
    params = jax.tree_util.tree_map(jnp.asarray, params)
    batch = tuple(jnp.asarray(b) for b in batch)

    def one_step(carry):
        p, s = carry
        g = jax.grad(loss_fn)(p, *batch)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s

    def build_stepfuse():
        fit = sf.fuse(loss_fn, optimizer, steps=n)
        state = fit.init(params)
        return lambda m: fit(state, *batch, steps=m)[0].params["kernel"].block_until_ready()

    def build_fori():
        @jax.jit
        def run(p, s, m):
            return jax.lax.fori_loop(0, m, lambda i, c: one_step(c), (p, s))
        s0 = optimizer.init(params)
        return lambda m: run(params, s0, m)[0]["kernel"].block_until_ready()

    def build_scan():
        def body(c, _):
            p, s = c
            value, g = jax.value_and_grad(loss_fn)(p, *batch)
            u, s = optimizer.update(g, s, p)
            return (optax.apply_updates(p, u), s), value

        run = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), None, length=n))
        s0 = optimizer.init(params)
        return lambda m: run(params, s0)[1].block_until_ready()

    def build_jit_step():
        step = jax.jit(one_step)
        s0 = optimizer.init(params)

        def run(m):
            c = (params, s0)
            for _ in range(m):
                c = step(c)
            return c[0]["kernel"].block_until_ready()
        return run

    return {"stepfuse": build_stepfuse, "fori_loop": build_fori, "scan": build_scan,
            "jit_per_step": build_jit_step}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    n = args.steps
    results = measure(
        contenders(seed_loss, perceptron_init(), blobs(), optax.sgd(SEED_LR), n),
        n, backend="jax", problem="seed perceptron", repeats=args.repeats,
        steps_for={"jit_per_step": min(n, 2000)},
    )
    print_table(results, title=f"JAX, seed perceptron, N={n} (ratio = us/step / stepfuse us/step)")
    ref = {r.contender: r for r in results}
    print(f"stepfuse / fori_loop = {ref['stepfuse'].us_per_step / ref['fori_loop'].us_per_step:.3f}  "
          f"jit_per_step / stepfuse = {ref['jit_per_step'].ratio:.1f}x")
    if args.json:
        write_json(results, args.json, command="python benchmarks/bench_jax.py", steps=n)


if __name__ == "__main__":
    main()
