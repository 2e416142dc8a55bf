"""The seed's experiment, end to end, on any installed backend (``stepfuse demo``).

The seed trains a 2->2 dense layer (kernel of ones, bias of zeros, softmax
cross-entropy, plain gradient descent) on 50 two-dimensional blobs twice from the same
start: once with 1 step per run, once with N steps per run, and prints the loss before
each run. Row k of the N-step table must equal row N*k of the 1-step table; the first
row is ln 2 = 0.693 whatever the data. Each backend below runs both tables with
stepfuse's fused call and times it against that framework's one-step-per-call loop.

With ``batch_size`` (``stepfuse demo --batch-size 10``) every step takes a different
minibatch: the 50 points as a `stepfuse.Epochs`, reshuffled each epoch. The N-step calls
feed the data once per call and the loop picks each step's minibatch on the device; the
1-step table, the stale-gradient aid and the timed one-step loop take global step ``t``'s
minibatch ``data.batch(t)``, so the check still compares the same training, step by step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable
from typing import Any, cast

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
    batch_size: int | None = None  # None: the seed's full batch at every step

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


class _Data:
    """The seed's 50 points as each step sees them: the full batch at every step, or
    (``batch_size``) the minibatches of a shuffled `stepfuse.Epochs` over them."""

    def __init__(self, batch_size: int | None, convert: Callable[[np.ndarray], Any]):
        from ._core.data import Epochs

        self.convert = convert
        self.full = tuple(convert(a) for a in blobs())
        self.epochs = (
            None if batch_size is None else Epochs(*self.full, batch_size=batch_size, seed=0)
        )

    def args(self) -> tuple:
        """A fused call's data arguments."""
        return self.full if self.epochs is None else (self.epochs,)

    def at(self, t: int) -> tuple:
        """The arguments of global step ``t`` alone (the one-step loops)."""
        if self.epochs is None:
            return self.full
        return tuple(self.convert(a) for a in self.epochs.batch(t))


def _jax(n: int, calls: int, lr: float, stale: bool, timing_steps: int, bs: int | None) -> _Run:
    import jax
    import jax.numpy as jnp
    import optax

    from . import jax as sf

    data = _Data(bs, jnp.asarray)

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(
            x @ p["kernel"] + p["bias"], y
        ).mean()

    def table(k):
        fit = sf.fuse(loss_fn, optax.sgd(lr), steps=k)
        state, rows = fit.init(perceptron_init()), []
        for c in range(calls * (n // k)):
            if stale and k > 1:  # the seed's worry: the first gradient applied k times
                rows.append(float(loss_fn(state.params, *data.at(c * k))))
                g = jax.grad(loss_fn)(state.params, *data.at(c * k))
                p = jax.tree_util.tree_map(lambda w, g: w - lr * k * g, state.params, g)
                state = state._replace(params=p, step=state.step + k)
                continue
            state, trace = fit(state, *data.args())
            rows.append(float(trace.loss[0]))
        return rows

    fit = sf.fuse(loss_fn, optax.sgd(lr), steps=timing_steps)
    state = fit.init(perceptron_init())
    fused = _best(lambda: fit(state, *data.args())[0].params["kernel"].block_until_ready())

    opt = optax.sgd(lr)

    @jax.jit
    def step(p, s, x, y):
        g = jax.grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    m = min(timing_steps, 500)
    feeds = [data.at(t) for t in range(m)]  # on the device before the clock starts

    def stepwise():
        p = jax.tree_util.tree_map(jnp.asarray, perceptron_init())
        s = opt.init(p)
        for args in feeds:
            p, s = step(p, s, *args)
        p["kernel"].block_until_ready()

    return table, fused / timing_steps, _best(stepwise) / m


def _tf(n: int, calls: int, lr: float, stale: bool, timing_steps: int, bs: int | None) -> _Run:
    import keras
    import tensorflow as tf

    from . import tf as sf

    data = _Data(bs, tf.constant)
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
        for c in range(calls * (n // k)):
            if stale and k > 1:
                with tf.GradientTape() as tape:
                    loss = loss_fn(*data.at(c * k))
                grads = tape.gradient(loss, variables)
                rows.append(float(loss))
                for v, g in zip(variables, grads):
                    v.assign_sub(lr * k * g)
                fit.step += k  # the next call's minibatch: that of global step (c + 1) * k
                continue
            rows.append(float(fit(*data.args()).loss[0]))
        return rows

    variables, loss_fn = make()
    fit = sf.fuse(loss_fn, keras.optimizers.SGD(lr), variables, steps=timing_steps)
    fused = _best(lambda: fit(*data.args()))

    variables, loss_fn = make()
    opt = keras.optimizers.SGD(lr)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(x, y)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    m = min(timing_steps, 300)
    feeds = [data.at(t) for t in range(m)]

    def stepwise():
        for args in feeds:
            loss = step(*args)
        float(loss)

    return table, fused / timing_steps, _best(stepwise) / m


def _tf1(n: int, calls: int, lr: float, stale: bool, timing_steps: int, bs: int | None) -> _Run:
    import tensorflow as tf

    from .tf import v1 as sf1

    tf1 = tf.compat.v1
    data = _Data(bs, np.asarray)
    init = perceptron_init()

    def build(steps):
        graph = tf.Graph()
        with graph.as_default():
            x = tf1.placeholder(tf.float32, (None, 2))
            y = tf1.placeholder(tf.int32, (None,))
            kernel = tf1.get_variable("kernel", initializer=init["kernel"])
            bias = tf1.get_variable("bias", initializer=init["bias"])

            def loss_of(x, y):
                logits = tf.matmul(x, kernel) + bias
                return tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                )

            opt = tf1.train.GradientDescentOptimizer(lr)
            if bs is None:
                fused = sf1.fuse(lambda: loss_of(x, y), opt, steps=steps)
                feeds = lambda t, k: {x: data.full[0], y: data.full[1]}  # noqa: E731
            else:  # the 50 points in the graph once: each step takes its global step's rows
                fused = sf1.fuse(
                    cast(Callable[[], Any], loss_of), opt, steps=steps, data=data.epochs
                )
                feeds = lambda t, k: {}  # noqa: E731

            loss = loss_of(x, y)
            grads_and_vars = opt.compute_gradients(loss, [kernel, bias])
            stale_ops = [v.assign_sub(lr * steps * g) for g, v in grads_and_vars]
            single = opt.apply_gradients(grads_and_vars)
            sess = tf1.Session(graph=graph)
            sess.run(tf1.global_variables_initializer())
        one = lambda t: dict(zip((x, y), data.at(t)))  # noqa: E731
        return sess, fused, loss, stale_ops, single, feeds, one

    def table(k):
        sess, fused, loss, stale_ops, _, feeds, one = build(k)
        rows = []
        with sess:
            for c in range(calls * (n // k)):
                if stale and k > 1:
                    rows.append(float(sess.run(loss, one(c * k))))
                    sess.run(stale_ops, one(c * k))
                    continue
                rows.append(float(sess.run(fused.losses, feeds(c * k, k))[0]))
        return rows

    sess, fused, _, _, single, feeds, one = build(timing_steps)
    with sess:
        feed = feeds(0, timing_steps)
        fused_t = _best(lambda: sess.run(fused.train_op, feed))
        m = min(timing_steps, 300)
        singles = [one(t) for t in range(m)]
        stepwise_t = _best(lambda: [sess.run(single, f) for f in singles])
    return table, fused_t / timing_steps, stepwise_t / m


def _torch(n: int, calls: int, lr: float, stale: bool, timing_steps: int, bs: int | None) -> _Run:
    import torch

    from . import torch as sf

    def convert(a: np.ndarray) -> torch.Tensor:  # labels as int64, as cross_entropy wants
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.long() if a.dtype.kind == "i" else t

    data = _Data(bs, convert)
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
        for c in range(calls * (n // k)):
            if stale and k > 1:
                opt.zero_grad()
                loss = loss_fn(*data.at(c * k))
                loss.backward()
                rows.append(float(loss))
                with torch.no_grad():
                    for p in model.parameters():
                        p -= lr * k * p.grad
                fit.step += k  # the next call's minibatch: that of global step (c + 1) * k
                continue
            rows.append(float(fit(*data.args()).loss[0]))
        return rows

    model, opt = make()
    fit = sf.fuse(
        lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
        opt,
        steps=timing_steps,
        model=model,
    )
    fused = _best(lambda: fit(*data.args()))
    model, opt = make()
    m = min(timing_steps, 300)
    feeds = [data.at(t) for t in range(m)]

    def stepwise():
        for x, y in feeds:
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
    batch_size: int | None = None,
) -> SeedResult:
    """Run the seed's experiment on ``backend``: both tables, the check and the timings.

    ``stale_gradient=True`` runs the N-step table the way the seed feared it would
    run (the first gradient of each call applied N times); the check then fails.
    ``batch_size``: every step takes its own minibatch of that many of the 50 points
    (a shuffled `stepfuse.Epochs`, seed 0) instead of all of them.
    """
    if batch_size is not None and not 1 <= batch_size <= len(blobs()[0]):
        raise ValueError(
            f"`batch_size` must be between 1 and {len(blobs()[0])} (the seed's points), "
            f"got {batch_size!r}"
        )
    table, fused_s, stepwise_s = _RUNNERS[backend](
        steps, calls, lr, stale_gradient, timing_steps, batch_size
    )
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
        batch_size,
    )
