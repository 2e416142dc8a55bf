"""Training on a resident dataset with JAX: stepfuse with `stepfuse.Epochs` against a
hand-written ``lax.scan`` over epochs x minibatches (an on-device permutation per epoch,
``jax.random.permutation``) and a ``jax.jit`` step per minibatch, side by side in one
process (us/step; x = the rival's time / stepfuse's).

Problems: ``small`` (MLP 32-64-10 tanh, batch 32) and ``mnist`` (MLP 784-256-10 tanh,
batch 128) on 8192 synthetic rows; Adam 1e-3; 2048 steps (shuffled epochs). Each contender
is compiled first, then timed ``--repeat`` times, interleaved; the best time is reported.
Two more rows separate what streams cost from what the loop costs: a hand-written scan
that also checks every step for NaN/inf as stepfuse does, and stepfuse on a fixed batch.

    python benchmarks/data_jax.py [--steps 2048] [--rows 8192] [--problems small mnist]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stepfuse as sf
import stepfuse.jax as sfj

PROBLEMS = {"small": (32, 64, 10, 32), "mnist": (784, 256, 10, 128)}


def _init(d_in: int, hidden: int, classes: int) -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "w1": jax.random.normal(k1, (d_in, hidden)) / np.sqrt(d_in),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, classes)) / np.sqrt(hidden),
        "b2": jnp.zeros(classes),
    }


def loss_fn(params: Any, x: Any, y: Any) -> Any:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _opt() -> optax.GradientTransformation:
    return optax.adam(1e-3)


def _step(params: Any, opt_state: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = _opt().update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make_stepfuse(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> Callable[[], Any]:
    d_in, hidden, classes, bs = dims
    data = sf.Epochs(x, y, batch_size=bs, shuffle=True, seed=0)
    fit = sfj.fuse(loss_fn, _opt(), steps=steps)
    state0 = fit.init(_init(d_in, hidden, classes))
    fit(state0, data, steps=8)  # compile (one program serves every steps <= the built)

    def run() -> Any:
        state, trace = fit(state0, data)
        assert trace.steps == steps and fit.compiles == 1 and fit.mode == "fused"
        return jax.block_until_ready(state.params)

    return run


def make_scan(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> Callable[[], Any]:
    """What users write: a scan over epochs, each a scan over its minibatches."""
    d_in, hidden, classes, bs = dims
    rows = len(x)
    spe = rows // bs
    epochs = -(-steps // spe)
    xd, yd = jnp.asarray(x), jnp.asarray(y)

    @jax.jit
    def train(params: Any, opt_state: Any, key: Any) -> tuple[Any, Any, Any]:
        def epoch(carry: Any, k: Any) -> tuple[Any, Any]:
            perm = jax.random.permutation(k, rows)[: spe * bs].reshape(spe, bs)

            def minibatch(carry: Any, idx: Any) -> tuple[Any, Any]:
                params, opt_state = carry
                params, opt_state, loss = _step(params, opt_state, xd[idx], yd[idx])
                return (params, opt_state), loss

            return jax.lax.scan(minibatch, carry, perm)

        (params, opt_state), losses = jax.lax.scan(
            epoch, (params, opt_state), jax.random.split(key, epochs)
        )
        return params, opt_state, losses.reshape(-1)[:steps]

    params = _init(d_in, hidden, classes)
    opt_state = _opt().init(params)
    key = jax.random.PRNGKey(0)
    jax.block_until_ready(train(params, opt_state, key))  # compile

    def run() -> Any:
        p, _, losses = train(params, opt_state, key)
        np.asarray(losses)  # the losses on the host, as stepfuse's trace
        return jax.block_until_ready(p)

    return run


def make_scan_checked(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> Callable[[], Any]:
    """`make_scan` that also checks every step's loss, gradients, parameters and optimizer
    state for NaN/inf (the check stepfuse makes at every step; here it only ORs a flag)."""
    d_in, hidden, classes, bs = dims
    rows = len(x)
    spe = rows // bs
    epochs = -(-steps // spe)
    xd, yd = jnp.asarray(x), jnp.asarray(y)

    def finite(*trees: Any) -> Any:
        return sum(jnp.sum(a * 0) for a in jax.tree_util.tree_leaves(trees) if a.dtype == x.dtype)

    @jax.jit
    def train(params: Any, opt_state: Any, key: Any) -> tuple[Any, Any, Any]:
        def epoch(carry: Any, k: Any) -> tuple[Any, Any]:
            perm = jax.random.permutation(k, rows)[: spe * bs].reshape(spe, bs)

            def minibatch(carry: Any, idx: Any) -> tuple[Any, Any]:
                params, opt_state, bad = carry
                loss, grads = jax.value_and_grad(loss_fn)(params, xd[idx], yd[idx])
                updates, opt_state = _opt().update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                bad = bad + finite(loss, grads, params, opt_state)
                return (params, opt_state, bad), loss

            return jax.lax.scan(minibatch, carry, perm)

        (params, opt_state, bad), losses = jax.lax.scan(
            epoch, (params, opt_state, jnp.float32(0)), jax.random.split(key, epochs)
        )
        return params, bad, losses.reshape(-1)[:steps]

    params = _init(d_in, hidden, classes)
    opt_state = _opt().init(params)
    key = jax.random.PRNGKey(0)
    jax.block_until_ready(train(params, opt_state, key))  # compile

    def run() -> Any:
        p, bad, losses = train(params, opt_state, key)
        np.asarray(losses)
        assert float(bad) == 0
        return jax.block_until_ready(p)

    return run


def make_stepfuse_fixed(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> Callable[[], Any]:
    """stepfuse on one fixed minibatch: the loop without a stream, for comparison."""
    d_in, hidden, classes, bs = dims
    xb, yb = jnp.asarray(x[:bs]), jnp.asarray(y[:bs])
    fit = sfj.fuse(loss_fn, _opt(), steps=steps)
    state0 = fit.init(_init(d_in, hidden, classes))
    fit(state0, xb, yb, steps=8)

    def run() -> Any:
        state, trace = fit(state0, xb, yb)
        assert trace.steps == steps and fit.compiles == 1
        return jax.block_until_ready(state.params)

    return run


def make_jit_step(x: np.ndarray, y: np.ndarray, dims: tuple, steps: int) -> Callable[[], Any]:
    """A ``jax.jit`` step per minibatch, the dataset on the device, rows given per step."""
    d_in, hidden, classes, bs = dims
    data = sf.Epochs(x, y, batch_size=bs, shuffle=True, seed=0)
    xd, yd = jnp.asarray(x), jnp.asarray(y)
    idx = [jnp.asarray(data.indices(t), jnp.int32) for t in range(steps)]
    step = jax.jit(lambda p, o, r: _step(p, o, xd[r], yd[r]))
    params = _init(d_in, hidden, classes)
    opt_state = _opt().init(params)
    jax.block_until_ready(step(params, opt_state, idx[0]))  # compile

    def run() -> Any:
        p, o = params, opt_state
        losses = []
        for r in idx:
            p, o, loss = step(p, o, r)
            losses.append(loss)
        np.asarray(jnp.stack(losses))
        return jax.block_until_ready(p)

    return run


CONTENDERS = {
    "stepfuse Epochs": make_stepfuse,
    "lax.scan by hand": make_scan,
    "jax.jit step": make_jit_step,
    "lax.scan + NaN check": make_scan_checked,
    "stepfuse fixed batch": make_stepfuse_fixed,
}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    print(f"jax {jax.__version__}, {jax.default_backend()}")
    for name in args.problems:
        dims = PROBLEMS[name]
        x = rng.normal(size=(args.rows, dims[0])).astype("float32")
        y = rng.integers(0, dims[2], size=args.rows).astype("int32")
        runs = {k: make(x, y, dims, args.steps) for k, make in CONTENDERS.items()}
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeat):
            for k, run in runs.items():
                t0 = time.perf_counter()
                run()
                best[k] = min(best[k], time.perf_counter() - t0)
        row = {k: v / args.steps * 1e6 for k, v in best.items()}
        out[name] = row
        base = row["stepfuse Epochs"]
        print(f"{name} (batch {dims[3]}, {args.rows} rows, {args.steps} steps):")
        for k, v in row.items():
            print(f"  {k:22s} {v:9.1f} us/step   x{v / base:6.2f}")
        print(f"  stepfuse Epochs / lax.scan by hand: {base / row['lax.scan by hand']:.3f}")
    return out


if __name__ == "__main__":
    main()
