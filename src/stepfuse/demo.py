"""The seed's experiment, end to end, on any installed backend (``stepfuse demo``).

The seed trains a 2->2 dense layer (kernel of ones, bias of zeros, softmax
cross-entropy, plain gradient descent) on 50 two-dimensional blobs twice from the same
start: once with 1 step per run, once with N steps per run, and prints the loss before
each run. Row k of the N-step table must equal row N*k of the 1-step table; the first
row is ln 2 = 0.693 whatever the data. Each backend below runs both tables with
stepfuse's fused call and times it against that framework's one-step-per-call loop.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .problems import blobs, perceptron_init

__all__ = ["BACKENDS", "SeedResult", "available_backends", "run_seed"]

BACKENDS = ("jax", "tf", "tf1", "torch")
_MODULE = {"jax": "jax", "tf": "tensorflow", "tf1": "tensorflow", "torch": "torch"}


def available_backends() -> list[str]:
    """The backends whose framework is installed, in the default order."""
    return [b for b in BACKENDS if importlib.util.find_spec(_MODULE[b]) is not None]


@dataclasses.dataclass
class SeedResult:
    backend: str
    steps: int
    calls: int
    lr: float
    one_step: list[float]  # loss before each of steps*calls one-step calls
    n_step: list[float]  # loss before each of `calls` N-step calls
    check_passed: bool
    max_abs_diff: float
    fused_us_per_step: float
    stepwise_us_per_step: float
    stale_gradient: bool = False

    @property
    def speedup(self) -> float:
        return self.stepwise_us_per_step / self.fused_us_per_step


def _best(run: Callable[[], object], repeats: int = 3) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


# -- one function per backend: (table(n, calls), us/step fused, us/step stepwise) -----------


_Run = tuple[Callable[[int], Any], float, float]
"""A backend's runner result: ``table(k)`` (the losses with k steps per call), and the
fused and stepwise times per step in seconds."""


def _jax(n: int, calls: int, lr: float, stale: bool, timing_steps: int) -> _Run:
    import jax
    import jax.numpy as jnp
    import optax

    from . import jax as sf

    x, y = blobs()

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(
            x @ p["kernel"] + p["bias"], y
        ).mean()

    def table(k):
        fit = sf.fuse(loss_fn, optax.sgd(lr), steps=k)
        state, rows = fit.init(perceptron_init()), []
        for _ in range(calls * (n // k)):
            if stale and k > 1:  # the seed's worry: the first gradient applied k times
                rows.append(float(loss_fn(state.params, x, y)))
                g = jax.grad(loss_fn)(state.params, x, y)
                p = jax.tree_util.tree_map(lambda w, g: w - lr * k * g, state.params, g)
                state = state._replace(params=p)
                continue
            state, trace = fit(state, x, y)
            rows.append(float(trace.loss[0]))
        return rows

    fit = sf.fuse(loss_fn, optax.sgd(lr), steps=timing_steps)
    state = fit.init(perceptron_init())
    fused = _best(lambda: fit(state, x, y)[0].params["kernel"].block_until_ready())

    opt = optax.sgd(lr)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    m = min(timing_steps, 500)

    def stepwise():
        p = jax.tree_util.tree_map(jnp.asarray, perceptron_init())
        s = opt.init(p)
        for _ in range(m):
            p, s = step(p, s)
        p["kernel"].block_until_ready()

    return table, fused / timing_steps, _best(stepwise) / m


def _tf(n: int, calls: int, lr: float, stale: bool, timing_steps: int) -> _Run:
    import keras
    import tensorflow as tf

    from . import tf as sf

    x, y = (tf.constant(a) for a in blobs())
    init = perceptron_init()

    def make():
        kernel, bias = tf.Variable(init["kernel"]), tf.Variable(init["bias"])

        def loss_fn(x, y):
            logits = tf.matmul(x, kernel) + bias
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            )

        return [kernel, bias], loss_fn

    def table(k):
        variables, loss_fn = make()
        fit = sf.fuse(loss_fn, keras.optimizers.SGD(lr), variables, steps=k)
        rows = []
        for _ in range(calls * (n // k)):
            if stale and k > 1:
                with tf.GradientTape() as tape:
                    loss = loss_fn(x, y)
                grads = tape.gradient(loss, variables)
                rows.append(float(loss))
                for v, g in zip(variables, grads):
                    v.assign_sub(lr * k * g)
                continue
            rows.append(float(fit(x, y).loss[0]))
        return rows

    variables, loss_fn = make()
    fit = sf.fuse(loss_fn, keras.optimizers.SGD(lr), variables, steps=timing_steps)
    fused = _best(lambda: fit(x, y))

    variables, loss_fn = make()
    opt = keras.optimizers.SGD(lr)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(x, y)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    m = min(timing_steps, 300)

    def stepwise():
        for _ in range(m):
            loss = step()
        float(loss)

    return table, fused / timing_steps, _best(stepwise) / m


def _tf1(n: int, calls: int, lr: float, stale: bool, timing_steps: int) -> _Run:
    import tensorflow as tf

    from .tf import v1 as sf1

    tf1 = tf.compat.v1
    x_np, y_np = blobs()
    init = perceptron_init()

    def build(steps):
        graph = tf.Graph()
        with graph.as_default():
            x = tf1.placeholder(tf.float32, (None, 2))
            y = tf1.placeholder(tf.int32, (None,))
            kernel = tf1.get_variable("kernel", initializer=init["kernel"])
            bias = tf1.get_variable("bias", initializer=init["bias"])

            def loss_fn():
                logits = tf.matmul(x, kernel) + bias
                return tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                )

            opt = tf1.train.GradientDescentOptimizer(lr)
            fused = sf1.fuse(loss_fn, opt, steps=steps)
            loss = loss_fn()
            grads_and_vars = opt.compute_gradients(loss, [kernel, bias])
            stale_ops = [v.assign_sub(lr * steps * g) for g, v in grads_and_vars]
            single = opt.apply_gradients(grads_and_vars)
            sess = tf1.Session(graph=graph)
            sess.run(tf1.global_variables_initializer())
        return sess, fused, loss, stale_ops, single, {x: x_np, y: y_np}

    def table(k):
        sess, fused, loss, stale_ops, _, feed = build(k)
        rows = []
        with sess:
            for _ in range(calls * (n // k)):
                if stale and k > 1:
                    rows.append(float(sess.run(loss, feed)))
                    sess.run(stale_ops, feed)
                    continue
                rows.append(float(sess.run(fused.losses, feed)[0]))
        return rows

    sess, fused, _, _, single, feed = build(timing_steps)
    with sess:
        fused_t = _best(lambda: sess.run(fused.train_op, feed))
        m = min(timing_steps, 300)
        stepwise_t = _best(lambda: [sess.run(single, feed) for _ in range(m)])
    return table, fused_t / timing_steps, stepwise_t / m


def _torch(n: int, calls: int, lr: float, stale: bool, timing_steps: int) -> _Run:
    import torch

    from . import torch as sf

    x_np, y_np = blobs()
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np).long()
    init = perceptron_init()

    def make():
        model = torch.nn.Linear(2, 2)
        with torch.no_grad():
            model.weight.copy_(torch.from_numpy(init["kernel"].T.copy()))
            model.bias.copy_(torch.from_numpy(init["bias"]))
        return model, torch.optim.SGD(model.parameters(), lr=lr)

    def table(k):
        model, opt = make()

        def loss_fn(x, y):
            return torch.nn.functional.cross_entropy(model(x), y)

        fit = sf.fuse(loss_fn, opt, steps=k, model=model)
        rows = []
        for _ in range(calls * (n // k)):
            if stale and k > 1:
                opt.zero_grad()
                loss = loss_fn(x, y)
                loss.backward()
                rows.append(float(loss))
                with torch.no_grad():
                    for p in model.parameters():
                        p -= lr * k * p.grad
                continue
            rows.append(float(fit(x, y).loss[0]))
        return rows

    model, opt = make()
    fit = sf.fuse(
        lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
        opt,
        steps=timing_steps,
        model=model,
    )
    fused = _best(lambda: fit(x, y))
    model, opt = make()
    m = min(timing_steps, 300)

    def stepwise():
        for _ in range(m):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    return table, fused / timing_steps, _best(stepwise) / m


_RUNNERS: dict[str, Callable] = {"jax": _jax, "tf": _tf, "tf1": _tf1, "torch": _torch}


def run_seed(
    backend: str,
    steps: int = 3,
    calls: int = 10,
    lr: float = 0.01,
    *,
    stale_gradient: bool = False,
    timing_steps: int = 2000,
) -> SeedResult:
    """Run the seed's experiment on ``backend``: both tables, the check and the timings.

    ``stale_gradient=True`` runs the N-step table the way the seed feared it would
    run (the first gradient of each call applied N times); the check then fails.
    """
    table, fused_s, stepwise_s = _RUNNERS[backend](steps, calls, lr, stale_gradient, timing_steps)
    one, many = table(1), table(steps)
    diff = float(np.max(np.abs(np.asarray(many) - np.asarray(one[::steps]))))
    passed = bool(np.allclose(many, one[::steps], rtol=1e-6, atol=1e-7))
    return SeedResult(
        backend,
        steps,
        calls,
        lr,
        one,
        many,
        passed,
        diff,
        fused_s * 1e6,
        stepwise_s * 1e6,
        stale_gradient,
    )
