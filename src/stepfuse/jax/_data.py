"""Data streams on the JAX backend: `stepfuse.Batches` and `stepfuse.Epochs` as arguments
of a call, a different minibatch at every step, picked inside the fused loop.

Both streams are pytrees here (their arrays are the leaves; an `Epochs`' ``batch_size``,
``shuffle`` and ``seed`` are static), so a call passes them through ``jax.jit``,
``jax.vmap`` and ``jax.grad`` like any batch. `prepare` checks a call's arguments before
anything runs and puts an `Epochs` dataset on the device once (`Epochs.placed`).

Inside the program (`Streams`, built while the loop is traced) step ``i`` of the call,
global step ``t = state.step + i``, reads entry ``i`` of a `Batches` array and rows
``order(t // steps_per_epoch)[(t % steps_per_epoch) * batch_size : ... + batch_size]`` of
an `Epochs` one. A shuffled `Epochs` carries its epoch's permutation in the loop's carry
(`Carry.feed`): ``argsort(epoch_keys(...))`` over unsigned 32-bit words (computed as the
keys sorted, mapped back to rows: `rows_of_keys`), the order
`Epochs.order` gives on the host, computed once at the call's start and again only when
the epoch changes (a ``lax.cond`` at the start of each chunk of steps, and the chunk ends
at the epoch boundary), so a step pays a slice and a gather, never a sort.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import fail
from .._core.data import (
    Batches,
    Epochs,
    FunctionInts,
    IntOps,
    Slot,
    epoch_keys,
    feed_of,
    rows_of_keys,
)

__all__ = ["JAX_INTS", "Streams", "epoch_order", "host_pick", "prepare"]

JAX_INTS: IntOps = FunctionInts(
    jnp.bitwise_xor,
    jnp.bitwise_and,
    lambda a, k: jnp.right_shift(a, jnp.uint32(k)),
    lambda a, k: jnp.left_shift(a, jnp.uint32(k)),
    jnp.uint32,
)
"""`stepfuse._core.data.IntOps` over unsigned 32-bit JAX arrays (they wrap at 2**32)."""


def epoch_order(rows: int, seed: int, epoch: Any) -> jax.Array:
    """The row order of epoch ``epoch`` (an int32 scalar, traced or not) of a shuffled
    dataset of ``rows`` rows: `stepfuse.Epochs.order`, as an int32 array on the device."""
    e = jnp.asarray(epoch).astype(jnp.uint32)
    keys = epoch_keys(JAX_INTS, e, jnp.arange(rows, dtype=jnp.uint32), seed)
    # The keys sorted, mapped back to their rows: XLA:CPU sorts one operand ~6x faster
    # than it sorts keys with their indices (an argsort).
    return rows_of_keys(JAX_INTS, e, jnp.sort(keys), seed).astype(jnp.int32)


# -- the streams as pytrees ---------------------------------------------------------------


def _leading(children: Sequence[Any], default: int) -> int:
    """The leading length of the first array among ``children`` (JAX also unflattens
    placeholders, which have none: then ``default``)."""
    for a in children:
        shape = getattr(a, "shape", None)
        if isinstance(shape, tuple) and len(shape) > 0:
            return int(shape[0])
    return default


def _batches_of(_: None, children: Sequence[Any]) -> Batches:
    b = object.__new__(Batches)  # no checks: `prepare` runs them on what a call receives
    b.arrays = tuple(children)
    b.n = _leading(children, 0)
    return b


def _layouts(arrays: Sequence[Any]) -> Any:
    """Per array of a dataset, its `NamedSharding` where it is placed over several devices
    (else None); None when no array is. Tracers have none: a dataset's layout is read
    where its arrays are concrete, in the call (or the user's transform) that flattens it."""
    out = tuple(
        s
        if not _is_tracer(a)
        and isinstance(s := getattr(a, "sharding", None), jax.sharding.NamedSharding)
        and len(s.device_set) > 1
        else None
        for a in arrays
    )
    return out if any(s is not None for s in out) else None


def _epochs_aux(e: Epochs) -> tuple:
    layouts = getattr(e, "layouts", None) or _layouts(e.arrays)
    return (e.rows, e.batch_size, e.shuffle, e.seed, layouts)


def _epochs_of(aux: tuple, children: Sequence[Any]) -> Epochs:
    rows, batch_size, shuffle, seed, layouts = aux
    e = object.__new__(Epochs)
    # The dataset's shardings, kept while the fit's program traces it (its arrays are
    # tracers then): each step's minibatch is laid out as its dataset (`Streams.pick`).
    # None inside a user's transform (`prepare`), where the outer arrays' shardings
    # need not describe the arrays the call sees (shard_map, vmap).
    e.layouts = layouts  # type: ignore[attr-defined]
    e.arrays = tuple(children)
    # Beneath vmap over the dataset the arrays are one model's: their rows, not the stack's.
    e.rows = _leading(children, rows)
    e.batch_size, e.shuffle, e.seed = batch_size, shuffle, seed
    e.steps_per_epoch = e.rows // batch_size if batch_size > 0 else 0
    e._placed = {}
    return e


jax.tree_util.register_pytree_node(Batches, lambda b: (b.arrays, None), _batches_of)
jax.tree_util.register_pytree_node(Epochs, lambda e: (e.arrays, _epochs_aux(e)), _epochs_of)


# -- a call's arguments, on the host ------------------------------------------------------


def _is_tracer(a: Any) -> bool:
    return isinstance(a, jax.core.Tracer)


def _foreign(a: Any) -> bool:
    """An array of another framework (a torch or TensorFlow tensor)."""
    return type(a).__module__.split(".")[0] in ("torch", "tensorflow")


def _put(a: Any) -> jax.Array:
    with jax.ensure_compile_time_eval():  # concrete, even while a user's jit traces the call
        return jnp.asarray(a)


def prepare(batch: tuple, n: int) -> tuple:
    """A call's arguments checked and placed: raises (before anything runs) a ValueError
    or TypeError naming the argument when a stream is malformed as the call sees it (also
    beneath ``jax.vmap``, where its arrays are one model's) or a `Batches` holds fewer
    minibatches than the call's ``n`` steps. An `Epochs` whose arrays are not traced is
    replaced by one over its dataset on the device (placed once per `Epochs`)."""
    if not any(isinstance(b, (Batches, Epochs)) for b in batch):
        return batch
    out: list[Any] = []
    for b in batch:
        if isinstance(b, Batches):
            Batches(*b.arrays)  # the core's checks, on the arrays this call holds
            if any(map(_foreign, b.arrays)):  # (jit takes no torch or TF tensors)
                b = _batches_of(None, [_put(a) if _foreign(a) else a for a in b.arrays])
        elif isinstance(b, Epochs):
            Epochs(*b.arrays, batch_size=b.batch_size, shuffle=b.shuffle, seed=b.seed)
            if not any(map(_is_tracer, b.arrays)):
                b = _epochs_of(_epochs_aux(b), b.placed(("jax",), _put))
                check_split(b)
            else:  # inside a user's transform (shard_map: one device's rows): XLA's layout
                b = _epochs_of((*_epochs_aux(b)[:4], None), b.arrays)
        out.append(b)
    feed_of(out).check_steps(n)
    return tuple(out)


def check_split(e: Epochs) -> None:
    """Raise a ValueError naming ``batch_size`` when a dataset split over several devices
    along its rows cannot split each minibatch the same way (its rows must then be a
    multiple of the devices, as they are for the dataset)."""
    for a, s in zip(e.arrays, getattr(e, "layouts", None) or ()):
        if s is None or not np.ndim(a):
            continue
        parts = int(a.shape[0]) // int(s.shard_shape(a.shape)[0])
        if parts > 1 and e.batch_size % parts:
            axes = s.spec[0] if len(s.spec) else None
            fail(
                ValueError,
                "batch_size",
                e.batch_size,
                f"a multiple of the {parts} devices the Epochs dataset's rows are split over "
                f"(NamedSharding along mesh axis {axes!r}), so that each step's minibatch is "
                "split over them as the dataset is",
                f"Pass a batch_size that is a multiple of {parts}, e.g. "
                f"{max(parts, e.batch_size - e.batch_size % parts)}, or place the dataset "
                "along a mesh axis whose size divides the batch_size.",
            )


def _constrained(a: Any, layout: Any) -> Any:
    """``a`` (a minibatch) laid out as its dataset is, where the dataset is placed over
    several devices."""
    return a if layout is None else jax.lax.with_sharding_constraint(a, layout)


def host_pick(batch: tuple, i: int, t: int, orders: dict[Any, np.ndarray]) -> tuple:
    """The arguments of ``loss_fn`` at step ``i`` of a call (global step ``t``), indexed on
    the host: what the stepwise reference feeds its one-step program. ``orders``: the
    epochs' orders computed so far in the call (`Epochs.order`, once per epoch)."""
    out: list[Any] = []
    for k, b in enumerate(batch):
        if isinstance(b, Batches):
            out.extend(a[i] for a in b.arrays)
        elif isinstance(b, Epochs):
            epoch, at = divmod(t, b.steps_per_epoch)
            if (k, epoch) not in orders:
                orders[(k, epoch)] = b.order(epoch)
            rows = orders[(k, epoch)][at * b.batch_size : (at + 1) * b.batch_size]
            out.extend(
                a[rows] if isinstance(a, np.ndarray) else jnp.asarray(a)[jnp.asarray(rows)]
                for a in b.arrays
            )
        else:
            out.append(b)
    return tuple(out)


# -- inside the program -------------------------------------------------------------------


class _Order:
    """The branch of `Streams.refresh` that computes a new epoch's permutation."""

    def __init__(self, rows: int, seed: int):
        self.rows, self.seed = rows, seed

    def __call__(self, epoch: Any, perm: Any) -> jax.Array:
        return epoch_order(self.rows, self.seed, epoch)


def _keep(epoch: Any, perm: Any) -> Any:
    return perm


class Streams:
    """The stream layout of a call being traced, and the loop's functions over it.

    ``feed`` (carried by the loop, None when no argument is a shuffled `Epochs`): per
    shuffled `Epochs`, ``(epoch, permutation)`` of the epoch the loop is in.

    Attributes:
      active: whether any argument is a stream (else every function hands the call's
        arguments through and the program is that of a fixed batch).
      shuffled: whether the loop carries permutations.
    """

    def __init__(self, batch: tuple):
        self.slots: tuple[Slot, ...] = feed_of(batch).slots
        self.active = any(s.kind != "fixed" for s in self.slots)
        self._shuffled: list[tuple[Slot, int]] = [  # (slot, rows) of each shuffled Epochs
            (s, b.rows) for s, b in zip(self.slots, batch) if s.kind == "epochs" and s.shuffle
        ]
        self.shuffled = bool(self._shuffled)

    def start(self, t: Any) -> Any:
        """The carried permutations for global step ``t`` (the call's first)."""
        if not self.shuffled:
            return None
        return tuple(
            (t // s.steps_per_epoch, epoch_order(rows, s.seed, t // s.steps_per_epoch))
            for s, rows in self._shuffled
        )

    def refresh(self, feed: Any, t: Any) -> Any:
        """``feed`` for global step ``t``: a permutation is computed again only when its
        epoch changed."""
        if feed is None:
            return None
        out = []
        for (s, rows), (old, perm) in zip(self._shuffled, feed):
            epoch = t // s.steps_per_epoch
            perm = jax.lax.cond(epoch != old, _Order(rows, s.seed), _keep, epoch, perm)
            out.append((epoch, perm))
        return tuple(out)

    def room(self, t: Any) -> Any:
        """Steps from global step ``t`` to the next epoch boundary of a shuffled `Epochs`
        (where its permutation changes); None without one."""
        if not self.shuffled:
            return None
        rooms = [s.steps_per_epoch - t % s.steps_per_epoch for s, _ in self._shuffled]
        room = rooms[0]
        for r in rooms[1:]:
            room = jnp.minimum(room, r)
        return room

    def pick(self, batch: tuple, feed: Any, i: Any, t: Any) -> tuple:
        """The arguments of ``loss_fn`` at step ``i`` of the call, global step ``t``, with
        ``feed``'s permutations (those of ``t``'s epoch)."""
        if not self.active:
            return batch
        perms = iter(() if feed is None else [p for _, p in feed])
        out: list[Any] = []
        for s, b in zip(self.slots, batch):
            if s.kind == "fixed":
                out.append(b)
            elif s.kind == "batches":
                out.extend(jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in b.arrays)
            else:
                lo = (t % s.steps_per_epoch) * s.batch_size
                if s.shuffle:
                    rows = jax.lax.dynamic_slice_in_dim(next(perms), lo, s.batch_size)
                    picked = [a.at[rows].get(mode="promise_in_bounds") for a in b.arrays]
                else:
                    picked = [jax.lax.dynamic_slice_in_dim(a, lo, s.batch_size) for a in b.arrays]
                layouts = getattr(b, "layouts", None) or (None,) * len(picked)
                out.extend(map(_constrained, picked, layouts))
        return tuple(out)

    def sample(self, batch: tuple) -> tuple:
        """Arguments of ``loss_fn`` of one step's shapes and dtypes (to trace it: unused
        in the program, so compiled away)."""
        if not self.active:
            return batch
        out: list[Any] = []
        for s, b in zip(self.slots, batch):
            if s.kind == "fixed":
                out.append(b)
            elif s.kind == "batches":
                out.extend(a[0] for a in b.arrays)
            else:
                out.extend(a[: s.batch_size] for a in b.arrays)
        return tuple(out)
