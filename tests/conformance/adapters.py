"""One adapter per backend: build a fit for a problem through the public API, run calls,
read back parameters and optimizer state as NumPy.

An adapter's ``build(problem, optimizer, mode="fused", **options)`` returns a `Run`:
``run(steps=None, batch=None) -> Trace`` makes one call (``batch`` is ``(x, y)`` as
NumPy; default the seed's blobs), ``run.params()`` / ``run.opt_state()`` are lists of
NumPy arrays in a fixed order, ``run.step`` counts the updates applied, ``run.fit`` is the
backend's fit object (``mode``, ``compiles``, ``fallback_reason``). `attempt` builds with
``run.loss_calls`` counting the backend's calls of ``loss_fn`` (building or tracing it).

The problems are those of `stepfuse.problems` (the seed perceptron and a 2-16-2 tanh MLP,
softmax cross-entropy on the blobs), the optimizers those of `helpers.OPTIMIZERS`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from helpers import PROBLEMS, X, Y, leaves, make_optimizer

from stepfuse import NonFiniteError


class Run:
    """A fit of one backend with the state a call needs (see the module docstring)."""

    backend = ""
    fit: Any = None
    loss_calls = 0
    counting = False  # count loss_fn's calls (a side effect torch.compile refuses to trace)

    def _count(self) -> None:
        if self.counting:
            self.loss_calls += 1

    def __call__(self, steps: int | None = None, batch: tuple | None = None):
        raise NotImplementedError

    def params(self) -> list[np.ndarray]:
        raise NotImplementedError

    def opt_state(self) -> list[np.ndarray]:
        raise NotImplementedError

    @property
    def step(self) -> int:
        return int(self.fit.step)


def _arrays(tree) -> list[np.ndarray]:
    return [a for _, a in leaves(tree) if a is not None]


# -- JAX ---------------------------------------------------------------------------------------


class JaxRun(Run):
    backend = "jax"

    def __init__(self, problem, optimizer, mode, options):
        import jax.numpy as jnp
        import optax

        import stepfuse.jax as sf

        def loss_fn(params, x, y):
            self._count()
            layers = params if isinstance(params, list) else [params]
            h = x
            for i, layer in enumerate(layers):
                h = h @ layer["kernel"] + layer["bias"]
                if i < len(layers) - 1:
                    h = jnp.tanh(h)
            return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

        self.fit = sf.fuse(loss_fn, make_optimizer("jax", optimizer), mode=mode, **options)
        self.state = self.fit.init(PROBLEMS[problem]())

    def __call__(self, steps=None, batch=None):
        x, y = batch if batch is not None else (X, Y)
        try:
            self.state, trace = self.fit(self.state, x, y, steps=steps)
        except NonFiniteError as err:
            if err.state is not None:  # the state the call reached (the caller's is older)
                self.state = err.state
            raise
        return trace

    def params(self):
        return _arrays(self.state.params)

    def opt_state(self):
        return _arrays(self.state.opt_state)

    @property
    def step(self):
        return int(self.state.step)


# -- TF2 / Keras -------------------------------------------------------------------------------


class Tf2Run(Run):
    backend = "tf2"

    def __init__(self, problem, optimizer, mode, options):
        import tensorflow as tf

        import stepfuse.tf as sf

        init = PROBLEMS[problem]()
        layers = init if isinstance(init, list) else [init]
        self.variables = []
        for layer in layers:
            self.variables += [tf.Variable(layer["kernel"]), tf.Variable(layer["bias"])]
        pairs = list(zip(self.variables[::2], self.variables[1::2]))

        def loss_fn(x, y):
            self._count()
            h = x
            for i, (k, b) in enumerate(pairs):
                h = tf.matmul(h, k) + b
                if i < len(pairs) - 1:
                    h = tf.tanh(h)
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h)
            )

        self.optimizer = make_optimizer("tf2", optimizer)
        self.fit = sf.fuse(loss_fn, self.optimizer, self.variables, mode=mode, **options)

    def __call__(self, steps=None, batch=None):
        import tensorflow as tf

        x, y = batch if batch is not None else (X, Y)
        return self.fit(tf.constant(x), tf.constant(y), steps=steps)

    def params(self):
        return [v.numpy().copy() for v in self.variables]

    def opt_state(self):
        return [np.array(v.numpy()) for v in self.optimizer.variables]


# -- TF1 graph mode (its own tf.Graph and Session; eager stays on for everything else) ---------


class Tf1Run(Run):
    backend = "tf1"

    def __init__(self, problem, optimizer, mode, options):
        import tensorflow as tf

        import stepfuse.tf.v1 as v1

        tf1 = tf.compat.v1
        init = PROBLEMS[problem]()
        layers = init if isinstance(init, list) else [init]
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.x = tf1.placeholder(tf.float32, [None, 2], name="x")
            self.y = tf1.placeholder(tf.int32, [None], name="y")
            self.ops_before_fuse = len(self.graph.get_operations())

            def loss_fn():
                self._count()
                h = self.x
                for i, layer in enumerate(layers):
                    k = tf1.get_variable(f"kernel{i}", initializer=layer["kernel"])
                    b = tf1.get_variable(f"bias{i}", initializer=layer["bias"])
                    h = tf.matmul(h, k) + b
                    if i < len(layers) - 1:
                        h = tf.tanh(h)
                return tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=self.y, logits=h)
                )

            self.fit = v1.fuse(loss_fn, make_optimizer("tf1", optimizer), mode=mode, **options)
            init_op = tf1.global_variables_initializer()
        self.sess = tf1.Session(graph=self.graph)
        self.sess.run(init_op)
        ids = {id(v) for v in self.fit.var_list}
        self._slots = [v for v in self.fit.state if id(v) not in ids]

    def __call__(self, steps=None, batch=None):
        x, y = batch if batch is not None else (X, Y)
        return self.fit.run(self.sess, {self.x: x, self.y: y}, steps=steps)

    def params(self):
        return [np.array(a) for a in self.sess.run(self.fit.var_list)]

    def opt_state(self):
        return [np.array(a) for a in self.sess.run(self._slots)]


# -- PyTorch -----------------------------------------------------------------------------------


class TorchRun(Run):
    backend = "torch"

    def __init__(self, problem, optimizer, mode, options):
        import torch
        import torch.nn.functional as F
        from torch import nn

        import stepfuse.torch as sf

        init = PROBLEMS[problem]()
        layers = init if isinstance(init, list) else [init]
        mods: list[nn.Module] = []
        for i, layer in enumerate(layers):
            lin = nn.Linear(*layer["kernel"].shape)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(layer["kernel"].T))
                lin.bias.copy_(torch.from_numpy(layer["bias"]))
            mods.append(lin)
            if i < len(layers) - 1:
                mods.append(nn.Tanh())
        self.model = model = nn.Sequential(*mods)

        def loss_fn(x, y):
            self._count()
            return F.cross_entropy(model(x), y)

        self.optimizer = make_optimizer("torch", optimizer, model.parameters())
        # Two steps a loop iteration unless told: stops and call ends fall inside a chunk,
        # at less compile time than the perceptron's default (4).
        options = {"chunk": 2, **options}
        self.fit = sf.fuse(loss_fn, self.optimizer, mode=mode, **options)

    def __call__(self, steps=None, batch=None):
        import torch

        x, y = batch if batch is not None else (X, Y)
        return self.fit(torch.from_numpy(x), torch.from_numpy(y).long(), steps=steps)

    def params(self):
        return [p.detach().numpy().copy() for p in self.model.parameters()]

    def opt_state(self):
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                out += _arrays({k: v for k, v in state.items() if v is not None})
        return out


RUNS: dict[str, type[Run]] = {"jax": JaxRun, "tf2": Tf2Run, "tf1": Tf1Run, "torch": TorchRun}


def build(backend: str, problem: str, optimizer: str, mode: str = "fused", **options) -> Run:
    """A `Run` of ``backend``'s ``fuse`` for ``problem`` and ``optimizer`` (names of
    `helpers.PROBLEMS` / `helpers.OPTIMIZERS`) with the shared ``options``."""
    return RUNS[backend](problem, optimizer, mode, options)


def attempt(
    backend: str, problem: str, optimizer: str, mode: str = "fused", **options
) -> tuple[Run, BaseException | None]:
    """Build as `build` does, catching what ``fuse`` raises: ``(run, error)``, where
    ``run`` holds what was made before ``fuse`` was called (``loss_calls``, the TF1 graph)."""
    cls = RUNS[backend]
    run = cls.__new__(cls)
    run.counting = True
    try:
        run.__init__(problem, optimizer, mode, options)
    except Exception as err:  # noqa: BLE001 - handed to the caller
        return run, err
    return run, None


# Backends whose fused calls are compared bit for bit with fused calls of other lengths
# of the same program (3 calls of 4 steps against one of 12; a call refused at step k
# against one of exactly k steps): one program on the same inputs, so nothing may differ.
# torch is left out only for the cost of the extra compiled fit each needs; it is compared
# with its stepwise fit within the float32 contract like every backend.
BITWISE_FUSED = {"jax", "tf2", "tf1"}
