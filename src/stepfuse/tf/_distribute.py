"""A TF2 fit over several devices: a model and optimizer created under a
``tf.distribute.Strategy`` scope (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``).

Each step of the fused loop picks its global minibatch (a fixed batch, a `Batches` entry or
an `Epochs` gather: `_data`), then runs ``strategy.run`` as TensorFlow's custom training
loops do: every replica takes its equal share of the minibatch's rows (replica ``r`` of
``R``: rows ``[r * b, (r + 1) * b)``, ``b = rows / R``), computes ``loss_fn`` and its
gradients on them, and applies the Keras optimizer in replica context, which all-reduces
the gradients (a sum) and updates every copy of the variables alike. ``loss_fn`` follows
TensorFlow's convention for replica context: it returns its share of the global batch's
mean loss, as Keras ``Loss`` objects (which divide by the replicas there) and
``tf.nn.compute_average_loss`` do; the step's loss is the sum over replicas
(``strategy.reduce``), so the fit equals the same fit on one device with the whole batch.

The NaN/inf guard stays consistent across replicas: each replica's loss and gradients go
into one scalar (``x * 0`` summed, `stepfuse.tf._loop._all_finite`'s trick), summed over
replicas with the loss, and the updated state is checked once; a refused step is undone in
cross-replica context, which writes every copy. XLA compiles a program for one device and
the replicas' variables live on several, so a distributed fit runs its loop on TensorFlow's
kernels (``fit.plan`` says so).
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

from ._checks import _ArgValueError, _fail, _tf_var
from ._loop import _all_finite, _finite_probe

__all__ = ["check_split", "distributed_step", "no_xla_under", "strategy_of", "xla_refused"]


def strategy_of(variables: list, optimizer: Any) -> Any:
    """The strategy the variables were created under, or None (the default strategy);
    errors naming ``variables`` / ``optimizer`` where they disagree."""
    found: dict[int, Any] = {}
    for v in variables:
        s = getattr(_tf_var(v), "_distribute_strategy", None)
        if s is not None:
            found[id(s)] = s
    if not found:
        return None
    if len(found) > 1 or any(
        getattr(_tf_var(v), "_distribute_strategy", None) is None for v in variables
    ):
        _fail(
            ValueError,
            "variables",
            variables,
            "variables created under one tf.distribute strategy (or none)",
            "Create the whole model under one `with strategy.scope():`.",
        )
    strategy = next(iter(found.values()))
    if getattr(optimizer, "_distribution_strategy", None) is not strategy:
        _fail(
            ValueError,
            "optimizer",
            optimizer,
            f"an optimizer created under the same {type(strategy).__name__}.scope() as the "
            "model's variables",
            "Create the optimizer inside the `with strategy.scope():` block that creates the "
            "model, e.g. `with strategy.scope(): model = ...; optimizer = keras.optimizers."
            "Adam(1e-3)`.",
        )
    return strategy


def xla_refused(strategy: Any) -> str:
    """Why a fit under ``strategy`` runs without XLA (``fit.plan``'s reason)."""
    return (
        f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replica(s): XLA "
        "compiles a program for one device and the replicas' variables live on several "
        "(TensorFlow refuses it: 'Trying to access resource ... located in device ... from "
        "device ...'), so the loop runs on TensorFlow's kernels"
    )


def check_split(rows: list[tuple[str, int | None]], replicas: int, strategy: Any) -> None:
    """A named error unless every tensor of a step's minibatch splits evenly over the
    replicas: ``rows`` is ``(what, leading size)`` for each (None: a scalar, -1: unknown)."""
    for what, n in rows:
        if n == -1:
            raise _ArgValueError(
                f"`batch` must split evenly over the {replicas} replicas of "
                f"{type(strategy).__name__}; {what} has an unknown number of rows a step "
                "(its element_spec's leading dimension is None). Batch the dataset with a "
                f"fixed size, e.g. `dataset.batch({2 * replicas}, drop_remainder=True)`, so "
                "that every step's rows split evenly."
            )
        if n is None or n % replicas:
            got = "is a scalar (no rows to split)" if n is None else f"has {n} rows a step"
            raise _ArgValueError(
                f"`batch` must split evenly over the {replicas} replicas of "
                f"{type(strategy).__name__} (each takes an equal share of a step's rows); "
                f"{what} {got}. Pass a global batch whose rows are a multiple of {replicas} "
                f"(e.g. {replicas * max(1, -(-(n or 1) // replicas))}), and give loss_fn "
                "per-step constants by closure rather than as batch arguments."
            )


def _share(a: Any, replica: Any, replicas: int) -> Any:
    """Replica ``replica``'s rows of ``a`` (an equal share, in order)."""
    b = int(a.shape[0]) // replicas
    return a[replica * b : (replica + 1) * b]


def distributed_step(fit: Any, batch: Any) -> tuple:
    """One step over the replicas: ``(loss, snapshot, new, ok)`` as `Fit._propose`."""
    strategy = fit._strategy
    args, has = fit._streams.unpack(fit._structure, batch)  # the step's global minibatch
    snapshot = [v.read_value() for v in fit._state]
    replicas = strategy.num_replicas_in_sync

    def replica_step(*global_args: Any) -> tuple:
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        local = tf.nest.map_structure(lambda a: _share(a, r, replicas), global_args)
        loss, grads = fit._loss_and_grads_of(local, has)
        fit.optimizer.apply_gradients(zip(grads, fit.variables))
        return loss, tf.cast(_finite_probe([loss, *grads]), tf.float64)

    losses, probes = strategy.run(replica_step, args=tuple(args))
    loss = strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)
    probe = strategy.reduce(tf.distribute.ReduceOp.SUM, probes, axis=None)
    new = [v.read_value() for v in fit._state]
    ok = tf.logical_and(tf.math.is_finite(probe), _all_finite(new))
    return loss, snapshot, new, ok


def no_xla_under(fit: Any, strategy: Any, jit_compile: Any) -> None:
    """A fit under ``strategy`` runs without XLA (`xla_refused` says why); a given
    ``jit_compile=True`` warns that it cannot be kept."""
    reason = xla_refused(strategy)
    if jit_compile is True:
        warnings.warn(
            f"stepfuse.tf: jit_compile=True cannot be kept: {reason}. Pass "
            "jit_compile='auto' or False to silence this.",
            RuntimeWarning,
            stacklevel=4,
        )
    fit.plan = {"xla": False, "reason": reason}
    fit.jit_compile = False
