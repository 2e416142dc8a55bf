"""Whether an XLA compiler option pays on a given model shape, before passing it to stepfuse.

Times one hand-written `lax.fori_loop` of optax SGD steps (gradient only) per model shape,
compiled twice in this one process: with JAX's defaults and with the given options (what
``stepfuse.jax.fuse(..., compiler_options=...)`` passes to its ``jax.jit``). Prints
microseconds per step and the ratio (< 1: the option is faster). Models are tanh MLPs
(no hidden layer: a linear model) with softmax cross-entropy on `stepfuse.problems` data.

    python benchmarks/xla_options.py [--option xla_cpu_experimental_ynn_fusion_type=] [--steps 300]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from stepfuse.bench._timing import interleaved_best
from stepfuse.bench.jax import fori_loops, optax_steps
from stepfuse.problems import blobs, mlp_init

# (layer widths, points): linear models first, then MLPs; the first is the seed's shape and data.
SHAPES = [
    ((2, 2), 50),
    ((2, 2), 10_000),
    ((10, 10), 1_000),
    ((784, 10), 256),
    ((2, 16, 2), 50),
    ((8, 8, 2), 1_000),
    ((32, 32, 10), 256),
    ((2, 64, 64, 2), 1_024),
]


def model(widths, points):
    """Parameters and a batch from `stepfuse.problems`: blobs, Glorot-initialised layers."""
    x, y = blobs(points, features=widths[0], classes=widths[-1])
    return jax.tree_util.tree_map(jnp.asarray, mlp_init(widths)), (jnp.asarray(x), jnp.asarray(y))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--option",
        action="append",
        metavar="NAME=VALUE",
        help="an XLA option (repeatable); default: xla_cpu_experimental_ynn_fusion_type=",
    )
    ap.add_argument("--steps", type=int, default=300, help="steps per timed call")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    options = dict(
        o.split("=", 1) for o in (args.option or ["xla_cpu_experimental_ynn_fusion_type="])
    )
    print(f"fori_loop of SGD steps on {jax.default_backend()}, us per step: default vs {options}")
    for widths, points in SHAPES:
        params, batch = model(widths, points)
        opt = optax.sgd(0.01)
        s0 = opt.init(params)
        steps = optax_steps(opt, batch)
        runs = {
            "default": fori_loops(*steps)["fori_loop"],
            "options": fori_loops(*steps, compiler_options=options)["fori_loop"],
        }
        calls = {
            name: (lambda run=run: jax.block_until_ready(run(params, s0, args.steps)))
            for name, run in runs.items()
        }
        for call in calls.values():  # compiles
            call()
        best = {
            name: 1e6 * t / args.steps for name, t in interleaved_best(calls, args.repeats).items()
        }
        label = "-".join(map(str, widths)) + f" on {points:,}"
        print(
            f"  {label:22s} default {best['default']:9.2f}   options {best['options']:9.2f}   "
            f"options/default {best['options'] / best['default']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
