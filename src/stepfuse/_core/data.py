"""Data streams, defined once: a different minibatch at every step of a call.

A call's positional arguments may be fixed arrays (the same every step, as the seed's
batch) or streams:

- `Batches` ``(*arrays)``: stacked minibatches; step ``i`` of a call uses ``a[i]`` of each
  array ``a``.
- `Epochs` ``(*arrays, batch_size, shuffle, seed)``: a resident dataset; the fit's global
  step ``t`` uses rows ``order(t // steps_per_epoch)[(t % steps_per_epoch) * batch_size :
  ... + batch_size]`` (full batches only). The order is a function of ``(seed, epoch)``
  alone, so a fit resumed from a checkpoint (which holds ``t``) continues with exactly
  the minibatches of an uninterrupted run.

Each stream expands to as many arguments of ``loss_fn`` as it holds arrays, in place:
``fit(Batches(xs), y)`` calls ``loss_fn(xs[i], y)`` at step ``i``.

The epoch's order is defined by integer arithmetic every framework does exactly
(`stepfuse._core.shuffle`, re-exported here), on the host (`Epochs.order`) and on every
device. The backends gather the rows inside their loops (`Feed`); this module holds what
does not depend on a framework.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .driver import user_stacklevel
from .options import Described, a_type, fail
from .shuffle import NUMPY_INTS, FunctionInts, IntOps, epoch_keys, rows_of_keys

__all__ = [
    "Batches",
    "Epochs",
    "Feed",
    "FunctionInts",
    "IntOps",
    "NUMPY_INTS",
    "Slot",
    "epoch_keys",
    "feed_of",
    "rows_of_keys",
    "warn_restarted",
]


def _is_array(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, (Batches, Epochs))


def _dims(a: Any) -> tuple[Any, ...] | None:
    """``a``'s shape as a tuple of ints, None where a graph tensor's size is unknown (a TF1
    placeholder's ``None``); None for a tensor of unknown rank."""
    shape = a.shape
    if getattr(shape, "rank", 0) is None:
        return None
    return tuple(getattr(d, "value", d) for d in shape)  # (TF1 `Dimension`s hold .value)


def _not_numbers(a: Any) -> str:
    """The dtype of an array that holds no numbers (NumPy object, string, structured or
    date arrays; TensorFlow strings), else ``""``."""
    dtype = getattr(a, "dtype", None)
    if isinstance(dtype, np.dtype):  # (ml_dtypes' bfloat16, float8 ...: kind "V", no fields)
        custom = dtype.kind == "V" and dtype.names is None and dtype.isbuiltin == 2
        return "" if dtype.kind in "biufc" or custom else str(dtype)
    name = getattr(dtype, "name", "")
    return name if name in ("string", "variant", "resource") else ""


def _check_arrays(cls: str, arrays: Sequence[Any], what: str, unknown: bool = False) -> int | None:
    """The common leading length of ``arrays``, or a ValueError naming the offending one.

    ``unknown``: graph tensors whose leading length is only known when they are fed
    (``Batches`` of TF1 placeholders) are accepted; the known lengths must still agree, and
    the result is that length (None if none is known): the rest is checked at the call
    (`Batches.check_fed`).
    """
    if not arrays:
        raise ValueError(
            f"`{cls}(*arrays)` needs at least one array; got none. Pass the {what}, "
            f"e.g. {cls}(x, y)."
        )
    lengths: list[int | None] = []
    for j, a in enumerate(arrays):
        if not _is_array(a):
            fail(
                ValueError,
                f"{cls}(*arrays)[{j}]",
                a if isinstance(a, (int, float, str)) else Described(a_type(a), a),
                "an array (NumPy, JAX, TensorFlow or torch) with a leading axis",
                (
                    f"Pass its arrays in the order loss_fn takes them, e.g. {cls}(d['x'], d['y']), "
                    "or in sorted key order: "
                    f"{cls}(*(d[k] for k in sorted(d))); a stream holds arrays only."
                    if isinstance(a, Mapping)
                    else (
                        "Convert it first, e.g. np.asarray(data), or np.stack(batches) for a "
                        "list of minibatches (full ones only: drop a smaller last one); a "
                        "stream holds arrays only."
                    )
                ),
            )
        kind = _not_numbers(a)
        if kind:
            fail(
                ValueError,
                f"{cls}(*arrays)[{j}]",
                Described(f"an array of dtype {kind}", a),
                "an array of numbers or booleans (the loop reads it on the device)",
                "Encode it first, e.g. np.unique(labels, return_inverse=True)[1] for string "
                "labels, or np.asarray(column, dtype=np.float32) for an object array.",
            )
        dims = _dims(a)
        if dims is not None and len(dims) == 0:
            raise ValueError(
                f"`{cls}(*arrays)[{j}]` must have a leading axis to index; got a scalar "
                f"array (shape ()). Pass a scalar as a fixed argument of the call instead."
            )
        lead = None if dims is None else dims[0]
        if lead is None and not unknown:
            raise ValueError(
                f"`{cls}(*arrays)[{j}]` must have a known leading length ({what}); got a "
                f"graph tensor of shape {a.shape}. Pass NumPy arrays (or tensors of a known "
                "shape)."
            )
        lengths.append(None if lead is None else int(lead))
    known = [n for n in lengths if n is not None]
    if len(set(known)) > 1:
        raise ValueError(
            f"`{cls}(*arrays)` must all have the same leading length ({what}); got leading "
            f"axes {lengths} (shapes {[_dims(a) for a in arrays]}). Cut or pad them to "
            "one length."
        )
    return known[0] if known else None


def _stack(items: list[Any]) -> Any:
    """``items`` (arrays of one framework) stacked along a new leading axis, by that
    framework (a torch stack stays on its device)."""
    module = type(items[0]).__module__.split(".")[0]
    if module == "torch":
        import torch

        return torch.stack(items)
    if module in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.stack(items)
    if module == "tensorflow":
        import tensorflow as tf

        return tf.stack(items)
    return np.stack([np.asarray(a) for a in items])


class Batches:
    """Stacked minibatches: step ``i`` of a call uses ``arrays[j][i]`` of every array.

    The leading axis must hold at least the call's ``steps``; each array's other axes are
    one minibatch's. A call passes it where the batch would go (``fit(Batches(xs, ys))``
    is ``loss_fn(xs[i], ys[i])`` at step ``i``), alone or beside fixed arguments. Graph
    tensors whose leading length is known only when fed (TF1 placeholders of shape
    ``(None, ...)``) are accepted: their lengths are checked at each call (`check_fed`).

    Attributes:
      arrays: the stacked arrays, as given.
      n: the number of minibatches (the common leading length); None while it is known
        only from a feed.
    """

    def __init__(self, *arrays: Any):
        self.n: int | None = _check_arrays("Batches", arrays, "one entry per step", unknown=True)
        self.arrays: tuple[Any, ...] = tuple(arrays)

    def check_fed(self, lengths: Sequence[int | None], steps: int, names: Sequence[str]) -> None:
        """The check of a call whose arrays' leading lengths are known only now (a TF1
        feed): ``lengths[j]`` of ``arrays[j]`` (None: not known), named ``names[j]`` in the
        errors. A ValueError if the known lengths differ or one holds fewer minibatches
        than the call's ``steps``."""
        known = [(n, name) for n, name in zip(lengths, names) if n is not None]
        if len({n for n, _ in known}) > 1:
            raise ValueError(
                f"`{known[0][1]}` and the other `Batches` arrays must have the same leading "
                f"length (one entry per step); got leading axes "
                f"{dict((name, n) for n, name in known)}. Feed them cut to one length."
            )
        for have, name in known:
            if have < steps:
                raise ValueError(
                    f"`{name}` holds {have} stacked minibatches but the call runs {steps} "
                    f"steps: its leading axis must be at least the call's steps. Pass "
                    f"steps={have} to the call, or stack {steps} minibatches."
                )

    @classmethod
    def from_iterable(cls, iterable: Iterable[Any], n: int, *, device: Any = None) -> Batches:
        """The next ``n`` batches of ``iterable`` (e.g. a ``DataLoader``), stacked.

        Each item is an array, a tuple/list of arrays (``(x, y)``) or a dict of arrays, the
        same structure every time. A dict's values become the stream's arrays in sorted key
        order (``{"y": ..., "x": ...}`` reaches ``loss_fn`` as ``(x, y)``): a stream holds
        arrays, so the dict is not passed whole (unlike a ``tf.data`` element that is a
        dict, which `stepfuse.tf` passes as one argument). ``device`` (torch): where the
        stack goes (``"cuda"``: pinned memory and non-blocking copies); by default, where
        the items are.
        """
        if not (isinstance(n, numbers.Integral) and not isinstance(n, bool)) or n < 1:
            fail(
                ValueError,
                "n",
                n,
                "an int >= 1, the number of batches to stack",
                "Pass the call's steps, e.g. Batches.from_iterable(loader, 100).",
            )
        if not hasattr(iterable, "__iter__"):
            fail(
                TypeError,
                "iterable",
                Described(a_type(iterable), iterable),
                "an iterable of batches (a DataLoader, a generator, a list)",
                "Pass an object you can iterate over, e.g. a torch DataLoader.",
            )
        items = list(itertools.islice(iter(iterable), int(n)))
        if len(items) < n:
            raise ValueError(
                f"`iterable` ran out after {len(items)} batches; `n` asks for {n}. Pass a "
                "smaller n (at most the batches left in this pass), or start a new pass: "
                "it = iter(loader) (a shuffling DataLoader draws a new order; "
                "itertools.cycle(loader) would replay the first pass's order and its smaller "
                "last batch)."
            )
        rows, labels = _rows(items)
        columns = []
        for j, label in enumerate(labels):
            parts = [row[j] for row in rows]
            for k, p in enumerate(parts):
                if not _is_array(p):
                    fail(
                        ValueError,
                        f"iterable (batch {k}, {label})",
                        Described(a_type(p), p),
                        "an array",
                        "Yield arrays (or tuples or dicts of arrays) from the iterable.",
                    )
                if tuple(p.shape) != tuple(parts[0].shape):
                    raise ValueError(
                        f"`iterable`'s batch {k}, {label} has shape {tuple(p.shape)}, batch 0 "
                        f"had {tuple(parts[0].shape)}: stacked batches must all be full (a "
                        "DataLoader with drop_last=True)."
                    )
            columns.append(_to_device(_stack(parts), device))
        return cls(*columns)

    def __repr__(self) -> str:
        shapes = ", ".join(str(_dims(a)) for a in self.arrays)
        return f"Batches({shapes})"


def _structure(item: Any) -> str:
    if isinstance(item, Mapping):
        return f"a dict with keys {sorted(map(str, item))}"
    if isinstance(item, (tuple, list)):
        return f"{a_type(item)} of {len(item)}"
    return "one array" if _is_array(item) else a_type(item)


def _rows(items: list[Any]) -> tuple[list[tuple[Any, ...]], list[str]]:
    """Each item's arrays, in order (a dict's values in sorted key order), and their names.

    Every item must have item 0's structure (one array, a tuple/list of the same length,
    or a dict with the same string keys).
    """
    first = items[0]
    if isinstance(first, Mapping):
        keys = list(first)
        if not all(isinstance(key, str) for key in keys):
            raise ValueError(
                f"`iterable`'s batch 0 is a dict with keys {keys!r}: a dict batch needs "
                "string keys (its values reach loss_fn in sorted key order). Yield a tuple "
                "instead."
            )
        keys.sort()
        labels = [f"key {key!r}" for key in keys]

        def row(item: Any) -> tuple[Any, ...] | None:
            ok = isinstance(item, Mapping) and set(item) == set(keys)
            return tuple(item[key] for key in keys) if ok else None

    elif isinstance(first, (tuple, list)):
        labels = [f"part {j}" for j in range(len(first))]

        def row(item: Any) -> tuple[Any, ...] | None:
            ok = isinstance(item, (tuple, list)) and len(item) == len(first)
            return tuple(item) if ok else None

    else:
        labels = ["part 0"]

        def row(item: Any) -> tuple[Any, ...] | None:
            return None if isinstance(item, (tuple, list, Mapping)) else (item,)

    rows = []
    for k, item in enumerate(items):
        r = row(item)
        if r is None:
            raise ValueError(
                f"`iterable`'s batch {k} is {_structure(item)}, batch 0 was "
                f"{_structure(first)}: every batch must have the same structure."
            )
        rows.append(r)
    return rows, labels


def _to_device(stacked: Any, device: Any) -> Any:
    if device is None:
        return stacked
    if type(stacked).__module__.split(".")[0] != "torch":
        raise ValueError(
            f"`device` applies to torch tensors; got a stack of {type(stacked).__name__}. "
            "Drop `device`, or yield torch tensors."
        )
    import torch

    device = torch.device(device)
    if device.type == "cuda" and stacked.device.type == "cpu":
        return stacked.pin_memory().to(device, non_blocking=True)
    return stacked.to(device)


class Epochs:
    """A resident dataset fed epoch after epoch, each epoch in its own shuffled order.

    The minibatch of the fit's global step ``t`` (the steps applied since ``init``) is
    rows ``order(t // steps_per_epoch)[(t % steps_per_epoch) * batch_size : ... +
    batch_size]`` of every array, ``steps_per_epoch = len(x) // batch_size`` (full
    batches only: the last ``len(x) % batch_size`` rows of an epoch's order are left out).
    Stateless: the order is a function of ``seed`` and the epoch alone, so a fit restored
    from a checkpoint continues with the minibatches an uninterrupted run would use.

    Attributes:
      arrays: the dataset's arrays, as given (each backend puts them on its device once).
      rows: the number of rows (the common leading length).
      batch_size, shuffle, seed: as given.
      steps_per_epoch: full minibatches per epoch.
    """

    def __init__(self, *arrays: Any, batch_size: int, shuffle: bool = True, seed: int = 0):
        rows = _check_arrays("Epochs", arrays, "one entry per row of the dataset")
        assert rows is not None  # (an Epochs needs known lengths: refused above)
        if not (isinstance(batch_size, numbers.Integral) and not isinstance(batch_size, bool)):
            fail(
                TypeError,
                "batch_size",
                batch_size,
                "an int >= 1",
                "Pass the rows per minibatch, e.g. batch_size=128.",
            )
        if rows == 0:
            fail(
                ValueError,
                "Epochs(*arrays)",
                Described("arrays of 0 rows", arrays[0]),
                "a dataset of at least one row",
                "Pass arrays of at least batch_size rows.",
            )
        if not 1 <= batch_size <= rows:
            fail(
                ValueError,
                "batch_size",
                batch_size,
                f"an int from 1 to the dataset's {rows} rows",
                f"Pass at most {rows} (full batches only), e.g. batch_size={min(128, rows)}.",
            )
        if not isinstance(shuffle, bool):
            fail(TypeError, "shuffle", shuffle, "True or False", "Pass shuffle=True or False.")
        if not (isinstance(seed, numbers.Integral) and not isinstance(seed, bool)) or not (
            0 <= seed < 2**64
        ):
            fail(
                ValueError,
                "seed",
                seed,
                "an int from 0 to 2**64 - 1",
                "Pass a non-negative int, e.g. seed=0.",
            )
        self.arrays: tuple[Any, ...] = tuple(arrays)
        self.rows: int = rows
        self.batch_size: int = int(batch_size)
        self.shuffle: bool = shuffle
        self.seed: int = int(seed)
        self.steps_per_epoch: int = rows // self.batch_size
        self._placed: dict[Any, Any] = {}  # see `placed`

    def order(self, epoch: int) -> np.ndarray:
        """The row order of epoch ``epoch`` (``0, 1, ...``), as an int64 NumPy array: the
        identity without ``shuffle``. The loop of every backend uses exactly this order."""
        _check_count(epoch, "epoch", "Pass an epoch number, e.g. 0.")
        if not self.shuffle:
            return np.arange(self.rows, dtype=np.int64)
        with np.errstate(over="ignore"):
            keys = epoch_keys(
                NUMPY_INTS, np.int64(epoch % 2**32), np.arange(self.rows, dtype=np.int64), self.seed
            )
        # The keys are distinct, so any sort gives this order; NumPy's default sort is ~4x
        # faster than its stable one on them (105 against 458 us for 8,192 rows).
        return np.argsort(keys).astype(np.int64)

    def indices(self, step: int) -> np.ndarray:
        """The rows of global step ``step``'s minibatch (int64, ``batch_size`` of them)."""
        _check_count(step, "step", "Pass a global step of the fit, e.g. 0 (the first).")
        epoch, at = divmod(int(step), self.steps_per_epoch)
        return self.order(epoch)[at * self.batch_size : (at + 1) * self.batch_size]

    def batch(self, step: int) -> tuple[Any, ...]:
        """Global step ``step``'s minibatch of every array, indexed on the host with NumPy
        (to build a plain loop over the same minibatches)."""
        idx = self.indices(step)
        return tuple(np.asarray(a)[idx] for a in self.arrays)

    def placed(self, key: Any, put: Callable[[Any], Any]) -> tuple[Any, ...]:
        """The arrays as ``put`` places them, made once per ``key`` (a backend and its
        device): the dataset goes to the device once, not at every call."""
        if key not in self._placed:
            self._placed[key] = tuple(put(a) for a in self.arrays)
        return self._placed[key]

    def __repr__(self) -> str:
        return (
            f"Epochs(rows={self.rows}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"seed={self.seed}, steps_per_epoch={self.steps_per_epoch})"
        )


def _check_count(value: Any, name: str, fix: str) -> None:
    """A ValueError naming ``name`` unless ``value`` is an int >= 0."""
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)) or value < 0:
        fail(ValueError, name, value, "an int >= 0", fix)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One positional argument of a call, as the loop reads it.

    Attributes:
      kind: ``"fixed"`` (one array, the same every step), ``"batches"`` or ``"epochs"``.
      width: how many arrays (and so arguments of ``loss_fn``) it holds.
      batch_size, steps_per_epoch, shuffle, seed: an ``"epochs"`` slot's static facts.
    """

    kind: str
    width: int = 1
    batch_size: int = 0
    steps_per_epoch: int = 0
    shuffle: bool = False
    seed: int = 0


def _short(slot: Slot, arrays: tuple[Any, ...], n: int) -> bool:
    """A `Batches` slot of fewer than ``n`` minibatches."""
    dims = _dims(arrays[0]) if slot.kind == "batches" else None
    return dims is not None and len(dims) > 0 and dims[0] is not None and int(dims[0]) < n


@dataclasses.dataclass(frozen=True)
class Feed:
    """A call's arguments split into the layout a program is built for (`slots`, hashable:
    part of what a compiled program is specialised to) and the arrays it is given
    (`arrays`, flat, in argument order).

    Attributes:
      slots: one `Slot` per positional argument.
      arrays: every array of every argument, flat.
      batches: the number of minibatches of the shortest `Batches` (None without one).
    """

    slots: tuple[Slot, ...]
    arrays: tuple[Any, ...]
    batches: int | None = None

    @property
    def streams(self) -> bool:
        """Whether any argument changes from step to step."""
        return any(s.kind != "fixed" for s in self.slots)

    @property
    def epochs(self) -> tuple[int, ...]:
        """The positions in `slots` of the `Epochs` arguments."""
        return tuple(k for k, s in enumerate(self.slots) if s.kind == "epochs")

    def check_steps(self, n: int) -> None:
        """A ValueError if a `Batches` holds fewer minibatches than the call's ``n`` steps
        (which one, where the call has several)."""
        if self.batches is not None and self.batches < n:
            at = [k for k, s in enumerate(self.slots) if s.kind == "batches"]
            which = ""
            if len(at) > 1:
                k = next(k for k, (s, a) in enumerate(self.spans()) if _short(s, a, n))
                which = f"The call's argument {k} (of {len(at)} `Batches`): "
            raise ValueError(
                which + f"`Batches` holds {self.batches} minibatches but the call runs {n} steps: "
                "its leading axis must be at least the call's steps. "
                + (f"Pass steps={self.batches} to the call, or s" if self.batches else "S")
                + f"tack {n} minibatches."
            )

    def spans(self) -> list[tuple[Slot, tuple[Any, ...]]]:
        """Each slot with its arrays."""
        out, at = [], 0
        for s in self.slots:
            out.append((s, self.arrays[at : at + s.width]))
            at += s.width
        return out

    def pick(
        self,
        arrays: Sequence[Any],
        take: Callable[[Any], Any],
        rows: Callable[[int], Any] | None = None,
        gather: Callable[[Any, Any], Any] | None = None,
    ) -> tuple[Any, ...]:
        """The arguments of ``loss_fn`` at one step, from the program's ``arrays`` (this
        feed's arrays as the program holds them), with the backend's functions:
        ``take(a)`` is a `Batches` array's entry of the step; for `Epochs`, ``rows(k)`` the
        rows of the step in the ``k``-th Epochs argument and ``gather(a, rows)`` ``a[rows]``."""
        out: list[Any] = []
        at, k = 0, 0
        for s in self.slots:
            group = arrays[at : at + s.width]
            at += s.width
            if s.kind == "fixed":
                out.extend(group)
            elif s.kind == "batches":
                out.extend(take(a) for a in group)
            else:
                assert rows is not None and gather is not None
                r = rows(k)
                out.extend(gather(a, r) for a in group)
                k += 1
        return tuple(out)


def feed_of(args: Sequence[Any]) -> Feed:
    """The `Feed` of a call's positional arguments (streams and fixed arrays)."""
    slots: list[Slot] = []
    arrays: list[Any] = []
    lengths: list[int] = []
    for a in args:
        if isinstance(a, Batches):
            slots.append(Slot("batches", len(a.arrays)))
            arrays.extend(a.arrays)
            if a.n is not None:  # (an unknown length is checked at the call: check_fed)
                lengths.append(a.n)
        elif isinstance(a, Epochs):
            slots.append(
                Slot("epochs", len(a.arrays), a.batch_size, a.steps_per_epoch, a.shuffle, a.seed)
            )
            arrays.extend(a.arrays)
        else:
            slots.append(Slot("fixed"))
            arrays.append(a)
    return Feed(tuple(slots), tuple(arrays), min(lengths) if lengths else None)


def warn_restarted(args: Sequence[Any], step: int, taken: int) -> None:
    """Warn where a call starts its `Epochs` at the fit's step 0 while the optimizer has
    already taken ``taken`` steps: a fit rebuilt after a checkpoint that restored the model
    and optimizer but not the step count would start the data over at epoch 0."""
    if step != 0 or taken <= 0 or not any(isinstance(a, Epochs) for a in args):
        return
    warnings.warn(
        f"stepfuse: this call starts its Epochs at the fit's step 0 (epoch 0's first "
        f"minibatch) while the optimizer has already taken {taken} steps. If the run "
        f"continues from a checkpoint that restored the model and optimizer only, set "
        f"fit.step to the step count at the save (e.g. fit.step = {taken}) before the call, "
        "so the minibatches continue where they were; if it starts the data over on "
        "purpose, ignore this (it is said while fit.step is 0).",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
