"""What evaluation inside the loop costs a step: the seed's perceptron fused with
``eval_fn`` (its loss on 25 held-out points) at several ``eval_every``, against the same fit
without ``eval_fn``, in calls of ``--steps`` steps, timed interleaved (each round calls every
fit once). Prints the median and the best time per step of each.

Run:  python benchmarks/eval_overhead.py --backend jax|tf|tf-nojit [--steps 10000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from stepfuse.problems import blobs, perceptron_init

EVERY = (None, "steps", 1000, 100, 10, 1)  # None: no eval_fn; "steps": the default


def jax_calls(steps: int) -> dict[str, Callable[[], None]]:
    import jax
    import jax.numpy as jnp
    import optax

    import stepfuse.jax as sf

    x, y = (jnp.asarray(a) for a in blobs())
    xv, yv = x[:25], y[:25]

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(
            x @ p["kernel"] + p["bias"], y
        ).mean()

    calls = {}
    for every in EVERY:
        kw = {} if every is None else {"eval_fn": loss_fn}
        if isinstance(every, int):
            kw["eval_every"] = every
        fit = sf.fuse(loss_fn, optax.sgd(0.01), steps=steps, **kw)
        state = fit.init(perceptron_init())
        eb = {} if every is None else {"eval_batch": (xv, yv)}

        def call(fit=fit, state=state, eb=eb):
            jax.block_until_ready(fit(state, x, y, **eb)[0])

        calls[f"eval_every={every}"] = call
    return calls


def tf_calls(steps: int, jit: bool) -> dict[str, Callable[[], None]]:
    import keras
    import tensorflow as tf

    import stepfuse.tf as sf

    x, y = (tf.constant(a) for a in blobs())
    xv, yv = x[:25], y[:25]
    calls = {}
    for every in EVERY:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
        ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def loss_fn(a, b, model=model, ce=ce):
            return ce(b, model(a))

        kw = {} if every is None else {"eval_fn": loss_fn}
        if isinstance(every, int):
            kw["eval_every"] = every
        fit = sf.fuse(
            loss_fn, keras.optimizers.SGD(0.01), model, steps=steps, jit_compile=jit, **kw
        )
        eb = {} if every is None else {"eval_batch": (xv, yv)}

        def call(fit=fit, eb=eb):
            fit(x, y, **eb)

        calls[f"eval_every={every}"] = call
    return calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="jax", choices=("jax", "tf", "tf-nojit"))
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    if args.backend == "jax":
        calls = jax_calls(args.steps)
    else:
        calls = tf_calls(args.steps, args.backend == "tf")
    for call in calls.values():  # compile
        call()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.rounds):
        for k, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[k].append((time.perf_counter() - t0) / args.steps * 1e6)
    print(f"{args.backend}, the seed, {args.steps} steps a call: us a step (median, best)")
    for k, v in times.items():
        print(f"  {k:20s} {statistics.median(v):8.3f} {min(v):8.3f}")


if __name__ == "__main__":
    main()
