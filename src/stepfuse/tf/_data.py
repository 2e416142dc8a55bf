"""Data streams for the TF2 fit: `stepfuse.Batches`, `stepfuse.Epochs` and ``tf.data``
iterators as arguments of a call, a different minibatch at every step, picked on the device.

The program receives the streams' arrays flat (an `Epochs` dataset placed on the device
once, `Epochs.placed`) and each step picks its minibatch by a position the fit keeps in a
variable, ``[i, t]``: the step's index within the call and the fit's global step, set
from the host at the start of each call (``[0, fit.step]``) and advanced by every
evaluated step. A refused (NaN/inf) step ends the call, so the next call starts at its
minibatch again. An `Epochs` slot keeps its epoch's permutation in a variable, refreshed
with ``tf.cond`` (`stepfuse._core.data.epoch_keys` and one ``argsort``, on the device)
only when the epoch changes. A ``tf.data`` iterator is handed in as its resource and
pulled once per step (``get_next_as_optional``); no XLA loop can hold one, so a fit that
is given one runs its loop without XLA.

In the fused loop the position and the permutation are not read from their variables at
each step but carried as loop variables (`carry_in`, `carrying`, `carry_out`: read once
before the loop, written once after it); the stepwise mode, one step per launch, reads
and writes the variables. A step's rows are a ``tf.gather`` of a fixed-size range of the
order: a ``tf.slice`` whose start is read from a variable made XLA compile the loop anew
at every call (2-4 s each, whatever the call's steps).

An epoch's permutation is an ``argsort``, and XLA:CPU sorts slowly: ~1.1 ms for 8,192
rows whatever the dtype, ~4 ms an epoch inside the fit's loop (14-18 us a step of the
``small`` MLP, 256 steps an epoch), against ~0.45 ms for NumPy. So each call also hands
the program the orders of the epochs it will enter, computed on the host by
`Epochs.order` (the definition every backend follows) in a table of a fixed number of
epochs (`OrderTables`); an epoch past the table (a call longer than the fit's ``steps``)
is sorted on the device as before. Same orders either way: only where they are computed
differs (docs/internals/tf.md).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from .._core import Trace, host_trace
from .._core.data import (
    Batches,
    Epochs,
    Feed,
    FunctionInts,
    Slot,
    epoch_keys,
    feed_of,
    rows_of_keys,
    warn_restarted,
)
from ._checks import _flat_batch

__all__ = ["OutOfDataError", "Streams", "only_given"]

_TAG = "stepfuse.streams"


class OutOfDataError(tf.errors.OutOfRangeError):
    """A ``tf.data`` iterator ran out during a call (a `tf.errors.OutOfRangeError`).

    The call stopped there: the updates before that step were applied (variables,
    optimizer state and ``fit.step`` agree), the step that found no element was not.

    Attributes:
      step: the index within the call of the step that found no element (= the updates
        the call applied).
      trace: the `stepfuse.Trace` of the updates applied (stop ``STEPS``).
    """

    def __init__(self, step: int, global_step: int, trace: Trace) -> None:
        super().__init__(
            None,
            None,
            f"stepfuse.tf: the tf.data iterator ran out at step {step} of the call (global "
            f"step {global_step}): the {step} update(s) before it were applied, that step was "
            "not. Pass a longer dataset (e.g. dataset.repeat()), or steps= at most the "
            "elements left.",
        )
        self.step, self.global_step, self.trace = step, global_step, trace


# `stepfuse._core.data.IntOps` over int64 tensors.
_INTS = FunctionInts(
    tf.bitwise.bitwise_xor,
    tf.bitwise.bitwise_and,
    lambda a, k: tf.bitwise.right_shift(a, tf.constant(k, tf.int64)),
    lambda a, k: tf.bitwise.left_shift(a, tf.constant(k, tf.int64)),
    lambda c: tf.constant(c, tf.int64),
)


def _is_iterator(a: Any) -> bool:
    return isinstance(a, tf.data.Iterator)


def _stand_in(spec: Any) -> Any:
    """Zeros of ``spec``'s dtype in place of an element the iterator did not give (its
    unknown dimensions 0; a scalar where even the rank is unknown): ``loss_fn`` never
    sees it, the step does not run."""
    if spec.shape.rank is None:
        return tf.zeros([], spec.dtype)
    return tf.zeros([d or 0 for d in spec.shape.as_list()], spec.dtype)


def streaming(args: Any) -> bool:
    """Whether a call's arguments hold a stream."""
    return any(isinstance(a, (Batches, Epochs)) or _is_iterator(a) for a in args)


def _tensor(a: Any) -> Any:
    return tf.convert_to_tensor(a)


# The host-computed orders a call hands its program take at most this many bytes (per
# shuffled dataset); a dataset whose one order is larger is sorted on the device only.
_TABLE_BYTES = 64 << 20


class OrderTables:
    """The host-computed orders of one shuffled dataset (`Epochs` of ``rows`` rows and a
    seed), handed to each call as ``(table, span)``: ``table[k]`` (int64, ``[size,
    rows]``) is the order of epoch ``span[0] + k`` for ``k < span[1]``. ``size`` is fixed
    at the first call (the program's argument shape): enough epochs for the fit's
    ``steps`` (or that call's, if more), within `_TABLE_BYTES`."""

    def __init__(self, data: Epochs, steps: int) -> None:
        spe = data.steps_per_epoch
        fit = -(-steps // spe) + 1  # a call of `steps` steps from any step
        self.size = max(1, min(fit, _TABLE_BYTES // (8 * data.rows)))
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()  # recent epochs' orders
        self._held: tuple[Any, Any, Any] | None = None  # (key, table, span) of the last call

    def tensors(self, data: Epochs, step: int, n: int) -> tuple[Any, Any]:
        """``(table, span)`` for a call of ``n`` steps from global step ``step``."""
        spe = data.steps_per_epoch
        first = step // spe
        count = min(self.size, (step + max(n, 1) - 1) // spe - first + 1)
        key = (first, count)
        if self._held is not None and self._held[0] == key:
            return self._held[1], self._held[2]
        table = np.zeros((self.size, data.rows), np.int64)
        for k in range(count):
            e = first + k
            if e not in self._orders:
                self._orders[e] = data.order(e)
                while len(self._orders) > self.size + 1:
                    self._orders.popitem(last=False)
            table[k] = self._orders[e]
        held = (tf.constant(table), tf.constant([first, count], tf.int64))
        self._held = (key, *held)
        return held


class Streams:
    """A fit's stream state: the position variable, the epochs' permutations, and the
    layout of the streams the programs were traced for."""

    def __init__(self) -> None:
        self._pos: tf.Variable | None = None  # [index in the call, global step]
        self._perms: dict[tuple[int, int], tuple[tf.Variable, tf.Variable]] = {}
        self._tables: dict[tuple[int, int], OrderTables] = {}  # by `_perms` key
        self._feed: Feed | None = None
        self._specs: tuple[Any, ...] = ()  # each iterator slot's element structure
        self._exhausted: tf.Variable | None = None  # the call index an iterator ran out at
        self.iterators = False
        # While the fused loop's step is traced: the position ("pos") and each permutation's
        # (order, epoch) by `_perms` key, as the loop carries them (see `carrying`).
        self._carry: dict[Any, Any] | None = None
        # While a step is traced: each table's (table, span) tensors by `_perms` key.
        self._table_at: dict[tuple[int, int], tuple[Any, Any]] = {}

    # -- the host side ------------------------------------------------------------------

    def flatten(self, args: Any, n: int, step: int, fit: Any) -> tuple[Any, Any]:
        """``(tensors, structure)`` for the program: `_flat_batch`'s for plain arguments;
        for streams their arrays flat and a structure naming their layout. Checks before
        anything runs; sets the position to ``[0, step]``."""
        if not streaming(args):
            return _flat_batch(args)
        slots: list[Any] = []
        flat: list[Any] = []
        specs: list[Any] = []
        for j, a in enumerate(args):
            if _is_iterator(a):
                spec = a.element_spec
                parts = tf.nest.flatten(spec)
                if not all(isinstance(p, tf.TensorSpec) for p in parts):
                    raise TypeError(
                        f"`batch[{j}]`, a tf.data iterator, must yield dense tensors (or tuples "
                        f"of them); its element_spec is {spec}. Map the dataset to dense tensors."
                    )
                slots.append(("iterator", len(parts)))
                specs.append(spec)
                flat.extend(a._type_spec._to_components(a))
                continue
            feed = feed_of([a])
            if isinstance(a, Batches):
                feed.check_steps(n)
                flat.extend(_tensor(x) for x in a.arrays)
            elif isinstance(a, Epochs):
                flat.extend(a.placed(("tf", "default"), _tensor))
            else:
                if tf.nest.is_nested(a):
                    raise TypeError(
                        f"`batch[{j}]`: beside a stream, fixed arguments must be single "
                        f"tensors; got a nested {type(a).__name__}. Pass its tensors as "
                        "separate arguments."
                    )
                flat.extend(_flat_batch((a,))[0])
            slots.append(feed.slots[0])
        if step == 0:  # (a fit rebuilt after a restore that left its step count behind)
            warn_restarted(args, step, int(fit._iterations.numpy()))
        tables: list[tuple[tuple[int, int], int]] = []
        for s, a in zip(slots, args):
            if isinstance(s, Slot) and s.kind == "epochs" and s.shuffle:
                self._perm_vars(a.rows, s.seed)
                key = (a.rows, s.seed)
                if key in (k for k, _ in tables) or 8 * a.rows > _TABLE_BYTES:
                    continue
                if key not in self._tables:
                    self._tables[key] = OrderTables(a, max(n, fit.opts.steps))
                held = self._tables[key]
                flat.extend(held.tensors(a, step, n))
                tables.append((key, held.size))
        if any(not isinstance(s, Slot) for s in slots) and fit.jit_compile:
            if fit._jit_given is True:  # not "auto"
                warnings.warn(
                    "stepfuse.tf: a tf.data iterator cannot be read inside an XLA-compiled loop, "
                    "so the fit runs its loop without XLA from now on (fit.jit_compile is now "
                    "False). Pass jit_compile=False to silence this, or stack the data "
                    "(sf.Batches, sf.Epochs) to keep XLA.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            fit._without_xla("a tf.data iterator is read inside the loop, which XLA cannot compile")
        if self._pos is None:
            self._pos = tf.Variable([0, 0], dtype=tf.int64, trainable=False)
            self._exhausted = tf.Variable(-1, dtype=tf.int64, trainable=False)
        self._pos.assign([0, step])
        self.iterators = bool(specs)
        if specs:
            assert self._exhausted is not None
            self._exhausted.assign(-1)
        self._specs = tuple(specs)
        return tuple(flat), (_TAG, tuple(slots), tuple(map(str, specs)), tuple(tables))

    def step_rows(self, structure: Any, flat: Any) -> list[tuple[str, int | None]]:
        """``(what, leading size)`` of each tensor a step's minibatch holds (None for a
        scalar, -1 where unknown): what a strategy splits over its replicas
        (`_distribute.check_split`)."""

        def lead(shape: Any) -> int | None:
            if shape.rank is None:
                return -1
            if len(shape) == 0:
                return None
            return -1 if shape[0] is None else int(shape[0])

        if not (isinstance(structure, tuple) and structure[:1] == (_TAG,)):
            return [(f"batch tensor {i}", lead(t.shape)) for i, t in enumerate(flat)]
        rows: list[tuple[str, int | None]] = []
        at, k = 0, 0
        for j, s in enumerate(structure[1]):
            if isinstance(s, Slot) and s.kind == "batches":
                rows += [
                    (f"batch[{j}] (Batches)", lead(a.shape[1:])) for a in flat[at : at + s.width]
                ]
            elif isinstance(s, Slot) and s.kind == "epochs":
                rows += [(f"batch[{j}] (Epochs)", s.batch_size)]
            elif isinstance(s, Slot):
                rows += [(f"batch[{j}]", lead(flat[at].shape))]
            else:
                spec = self._specs[k]
                k += 1
                rows += [(f"batch[{j}] (tf.data)", lead(p.shape)) for p in tf.nest.flatten(spec)]
            at += s.width if isinstance(s, Slot) else 1
        return rows

    def variables(self) -> list[tf.Variable]:
        """The variables a call writes: the position, where an iterator ran out and the
        epochs' permutations."""
        if self._pos is None:
            return []
        perms = (v for pair in self._perms.values() for v in pair)
        return [self._pos, self._exhausted, *perms]

    def _perm_vars(self, rows: int, seed: int) -> tuple[tf.Variable, tf.Variable]:
        """The permutation of a dataset of ``rows`` rows and its epoch (-1: none yet)."""
        key = (rows, seed)
        if key not in self._perms:
            self._perms[key] = (
                tf.Variable(tf.zeros([rows], tf.int64), trainable=False),
                tf.Variable(-1, dtype=tf.int64, trainable=False),
            )
        return self._perms[key]

    def check_exhausted(self, trace: Trace, start: int, record_every: int) -> None:
        """An `OutOfDataError` if an iterator ran out in the call just run."""
        if not self.iterators or self._exhausted is None:
            return
        at = int(self._exhausted.numpy())
        if at < 0:
            return
        kept = -(-at // record_every)
        applied = host_trace(trace.loss[:kept], at, 0, record_every)
        raise OutOfDataError(at, start + at, applied)

    # -- inside the program -------------------------------------------------------------

    def _carried(self, structure: Any, flat: Any) -> list[tuple[int, int]]:
        """The `_perms` keys of the shuffled `Epochs` slots of ``structure``, each once."""
        if not (isinstance(structure, tuple) and structure[:1] == (_TAG,)):
            return []
        keys: list[tuple[int, int]] = []
        at = 0
        for s in structure[1]:
            width = s.width if isinstance(s, Slot) else 1
            if isinstance(s, Slot) and s.kind == "epochs" and s.shuffle:
                key = (int(flat[at].shape[0]), s.seed)
                if key not in keys:
                    keys.append(key)
            at += width
        return keys

    def carry_in(self, structure: Any, flat: Any) -> tuple[Any, ...] | None:
        """The fused loop's initial carry: the position ``[i, t]`` and each permutation's
        ``order, epoch``, as their variables hold them (flat); None without streams."""
        if not (isinstance(structure, tuple) and structure[:1] == (_TAG,)):
            return None
        assert self._pos is not None
        keys = self._carried(structure, flat)
        return (self._pos.read_value(), *(v.read_value() for key in keys for v in self._perms[key]))

    def carry_out(self, structure: Any, flat: Any, carry: Any) -> None:
        """Write the loop's final carry back into the variables (the next launch starts
        from them, and a call in the same epoch sorts nothing)."""
        assert self._pos is not None
        self._pos.assign(carry[0])
        for k, key in enumerate(self._carried(structure, flat)):
            order, epoch = self._perms[key]
            order.assign(carry[1 + 2 * k])
            epoch.assign(carry[2 + 2 * k])

    @contextlib.contextmanager
    def carrying(self, structure: Any, flat: Any, carry: Any) -> Iterator[Any]:
        """Within: `unpack` takes the position and permutations from ``carry`` (the loop's,
        laid out as `carry_in`'s) instead of their variables; yields a function returning
        the carry after the step. ``carry`` None: the variables, as outside a loop."""
        if carry is None:
            yield lambda: None
            return
        keys = self._carried(structure, flat)
        box: dict[Any, Any] = {
            key: (carry[1 + 2 * k], carry[2 + 2 * k]) for k, key in enumerate(keys)
        }
        box["pos"] = carry[0]
        self._carry = box
        try:
            yield lambda: (box["pos"], *(x for key in keys for x in box[key]))
        finally:
            self._carry = None

    def unpack(self, structure: Any, flat: Any) -> tuple[Any, tuple[Any, ...]]:
        """``(loss_fn's arguments at this step, extra)``: for streams, the step's
        minibatches (and advances the position); ``extra`` is ``(has_value,)`` when an
        iterator may have run out, else ``()``."""
        if not (isinstance(structure, tuple) and structure[:1] == (_TAG,)):
            return tf.nest.pack_sequence_as(structure, list(flat)), ()
        carry = self._carry
        assert self._pos is not None
        tables = structure[3]
        at_table = len(flat) - 2 * len(tables)  # (after the slots' tensors)
        self._table_at = {
            key: (flat[at_table + 2 * k], flat[at_table + 2 * k + 1])
            for k, (key, _) in enumerate(tables)
        }
        pos = self._pos.read_value() if carry is None else carry["pos"]
        i, t = pos[0], pos[1]
        out: list[Any] = []
        has: list[Any] = []
        at, k = 0, 0
        for s in structure[1]:
            if isinstance(s, Slot) and s.kind == "fixed":
                out.append(flat[at])
                at += 1
            elif isinstance(s, Slot) and s.kind == "batches":
                out.extend(tf.gather(a, i) for a in flat[at : at + s.width])
                at += s.width
            elif isinstance(s, Slot):
                group = flat[at : at + s.width]
                rows = self._rows(s, group[0], t)
                out.extend(tf.gather(a, rows) for a in group)
                at += s.width
            else:
                spec = self._specs[k]
                k += 1
                it = tf.data.IteratorSpec(spec)._from_components([flat[at]])
                at += 1
                opt = it.get_next_as_optional()
                ok = opt.has_value()
                empty = tf.nest.map_structure(_stand_in, spec)
                element = tf.cond(ok, opt.get_value, lambda: empty)
                # as a plain loop calls it: a tuple's parts as the arguments (each keeping
                # its nesting), any other element (a dict, a tensor) as one argument
                out.extend(element if isinstance(spec, tuple) else (element,))
                has.append(ok)
        if carry is not None:  # in the fused loop (see `carrying`)
            carry["pos"] = pos + 1
        else:
            with tf.control_dependencies(out):
                self._pos.assign_add(tf.constant([1, 1], tf.int64))
        if not has:
            return tuple(out), ()
        ok = tf.reduce_all(tf.stack(has))
        assert self._exhausted is not None
        tf.cond(
            ok,
            tf.no_op,
            lambda: tf.group(self._exhausted.assign(tf.cast(i, tf.int64))),
        )
        return tuple(out), (ok,)

    def _rows(self, s: Slot, first: Any, t: Any) -> Any:
        """The rows of global step ``t`` in an `Epochs` slot (its permutation refreshed
        when the epoch changes)."""
        bs, spe = s.batch_size, s.steps_per_epoch
        epoch, at = t // spe, t % spe
        start = at * bs
        span = start + tf.range(bs, dtype=tf.int64)  # (a static size, for XLA)
        if not s.shuffle:
            return span
        n = int(first.shape[0])
        key = (n, s.seed)

        def sort() -> Any:
            e = epoch % 2**32
            keys = epoch_keys(_INTS, e, tf.range(n, dtype=tf.int64), s.seed)
            return rows_of_keys(_INTS, e, tf.sort(keys), s.seed)  # (an argsort, ~20% faster)

        def refresh() -> Any:
            if key not in self._table_at:  # (a dataset too large for a table)
                return sort()
            table, span = self._table_at[key]
            k = epoch - span[0]
            inside = tf.logical_and(k >= 0, k < span[1])
            size = int(table.shape[0])
            return tf.cond(inside, lambda: tf.gather(table, tf.clip_by_value(k, 0, size - 1)), sort)

        if self._carry is not None:  # in the fused loop: the carried order (see `carrying`)
            held, current = self._carry[key]
            order = tf.cond(tf.equal(current, epoch), lambda: tf.identity(held), refresh)
            self._carry[key] = (order, epoch)
            return tf.gather(order, span)
        perm, current = self._perms[key]
        # The branches only compute; the variables are written after the cond.
        order = tf.cond(tf.equal(current, epoch), perm.read_value, refresh)
        with tf.control_dependencies([perm.assign(order), current.assign(epoch)]):
            return tf.gather(order, span)


def only_given(given: Any, compute: Any, variables: list) -> tuple[Any, list]:
    """``compute()`` (a step's ``(loss, grads)``) where ``given`` (the iterators gave the
    step an element); where not, a NaN loss (the step is refused: `OutOfDataError`) and zero
    gradients of the same kinds, so ``loss_fn`` never runs on the made-up element (one of 0
    rows may fail it, mid-call)."""
    seen: dict[str, Any] = {}  # from the first branch's trace: the loss dtype, the kinds

    def real() -> tuple[Any, list]:
        loss, grads = compute()
        seen["dtype"] = loss.dtype
        seen["kinds"] = [
            None if g is None else g.indices.dtype if isinstance(g, tf.IndexedSlices) else "dense"
            for g in grads
        ]
        return loss, [g for g in grads if g is not None]

    def missing() -> tuple[Any, list]:
        zeros: list = []
        for v, kind in zip(variables, seen["kinds"]):
            if kind == "dense":
                zeros.append(tf.zeros_like(v))
            elif kind is not None:  # an embedding's gradient: no rows
                shape = tf.concat([[0], tf.shape(v)[1:]], 0)
                zeros.append(
                    tf.IndexedSlices(tf.zeros(shape, v.dtype), tf.zeros([0], kind), tf.shape(v))
                )
        return tf.constant(float("nan"), seen["dtype"]), zeros

    loss, got = tf.cond(given, real, missing)
    it = iter(got)
    return loss, [None if k is None else next(it) for k in seen["kinds"]]
