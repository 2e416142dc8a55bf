"""Kernels per loop step on XLA:CPU: stepfuse's fused loop against the hand-written loops.

On small problems a compiled step costs about its number of kernels (fusions, dots,
copies, concatenations ...) times XLA:CPU's per-kernel cost, so counting them says where
a loop's time goes. Compiles, for the given size and optimizer, `fori_loop` (gradient
only), `fori_loop` with the loss evaluated each step, the same with each loss written
into a buffer of 10,000, and stepfuse's fused call (with and without `tol`), and prints
the kernels in each one's innermost loop body (stepfuse runs its steps in an inner loop
of chunks; its outer loop's kernels run once per chunk and are printed apart).

Kernels do not all cost alike: a YNN fusion (the seed's forward matmul) costs about as
much as the rest of a `fori_loop` step, and a loop body that touches a buffer over 512
bytes (the 10,000 recorded losses) ran slower a kernel here, as XLA:CPU's thunk executor
runs a body's kernels one after another only when every buffer they touch is at most
512 bytes (see the README's Benchmarks).

Run:  python benchmarks/jax_kernels.py [--size seed|mlp|wide|deep] [--optimizer sgd|momentum|adam]
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp

from stepfuse import jax as sf
from stepfuse.bench.jax import OPTIMIZERS, fori_loops, mlp_loss, optax_steps
from stepfuse.bench.problems import SIZES, problem

# What runs no kernel of its own: a computation's parameters, tuples, views, constants.
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][\w\-]*)\(")


def loop_bodies(hlo: str):
    """``(name, kernels)`` for each computation of ``hlo`` that is a while body."""
    bodies = set(re.findall(r"while\([^)]*\), condition=%?[\w.\-]+, body=%?([\w.\-]+)", hlo))
    out = []
    for comp in re.split(r"\n(?=%\S+ \(|ENTRY)", hlo):
        name = comp.split(" ", 1)[0].lstrip("%")
        if name in bodies:
            ops = [m.group(1) for m in map(_OP.match, comp.splitlines()[1:]) if m]
            out.append((name, sum(op not in _FREE for op in ops)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="seed", choices=SIZES)
    ap.add_argument("--optimizer", default="sgd", choices=tuple(OPTIMIZERS))
    args = ap.parse_args(argv)
    layers, x, y = problem(args.size)
    params = jax.tree_util.tree_map(jnp.asarray, layers)
    batch = (jnp.asarray(x), jnp.asarray(y))
    opt = OPTIMIZERS[args.optimizer](0.01)
    s0 = opt.init(params)

    # the loops bench_jax.py times
    loops = {
        name: run.lower(params, s0, 10).compile().as_text()
        for name, run in fori_loops(*optax_steps(opt, batch)).items()
    }
    for name, tol in (("stepfuse", None), ("stepfuse (tol)", 1e-7)):
        fit = sf.fuse(mlp_loss, opt, steps=10, tol=tol)
        loops[name] = fit._compiled_text(fit.init(params), *batch)
    print(f"kernels per loop-body run, {args.size}, {args.optimizer} ({jax.default_backend()}):")
    for name, hlo in loops.items():
        counts = sorted((k for _, k in loop_bodies(hlo)), reverse=True)
        outer = (
            f"  (outer loop, once per chunk: {', '.join(map(str, counts[1:]))})"
            if len(counts) > 1
            else ""
        )
        print(f"  {name:28s} {counts[0]}{outer}")


if __name__ == "__main__":
    main()
