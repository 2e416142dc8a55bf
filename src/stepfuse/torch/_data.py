"""Data streams of the torch fit: a different minibatch at every step of a call.

A call's positional arguments (fixed tensors, `stepfuse.Batches`, `stepfuse.Epochs`)
become a `Fed`, which serves both loops:

- the eager steps (``mode="stepwise"``, a fused call's first step, the loss probe, the
  dropout check) read a step's minibatch with `Fed.at`;
- the compiled program is given `Fed.inputs` (the stacked arrays and datasets, each
  shuffled `Epochs`' permutation of the epoch, the call's first global step) and picks a
  step's minibatch inside its loop with `Fed.pick` (traced into the loop body: a
  Batches entry by ``index_select`` at the step's index, an epoch's rows by a slice of
  the permutation, then ``index_select``).

An epoch's permutation is ``argsort(epoch_keys(...))`` (`stepfuse._core.data`), computed
eagerly on the fit's device once per epoch, outside the program (inductor lowers those
integer operations inexactly on CPU): a fused call that crosses an epoch boundary runs
the program once per epoch segment (`Fed.room`), each with that epoch's permutation, on
the same compiled program. Without streams a `Fed` hands the call's arguments through
as they are (the program is the one of a fixed batch).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .._core import Described, fail
from .._core.data import (
    Epochs,
    Feed,
    FunctionInts,
    IntOps,
    Slot,
    epoch_keys,
    feed_of,
    warn_restarted,
)
from ._program import batch_key

__all__ = ["Fed", "TORCH_INTS", "epoch_order"]

_NO_EPOCH = 2**62  # `Fed.room` without a shuffled Epochs: no boundary to stop at


# Constants are Python ints, which mix with int64 tensors.
TORCH_INTS: IntOps = FunctionInts(
    operator.xor, operator.and_, operator.rshift, operator.lshift, int
)
"""`IntOps` over int64 torch tensors, run eagerly (`epoch_order`)."""


@functools.lru_cache(maxsize=8)
def epoch_order(rows: int, seed: int, epoch: int, device: torch.device) -> torch.Tensor:
    """The row order of epoch ``epoch`` of a shuffled dataset of ``rows`` rows, as an int64
    tensor on ``device``: `stepfuse.Epochs.order`, computed there (eagerly, one sort)."""
    r = torch.arange(rows, dtype=torch.int64, device=device)
    e = torch.tensor(epoch % 2**32, dtype=torch.int64, device=device)
    return torch.argsort(epoch_keys(TORCH_INTS, e, r, seed))


def _check_device(a: Any, device: torch.device, name: str) -> None:
    """A stream's tensor must be on the model's device (a NumPy array, or another
    framework's, is copied there)."""
    if isinstance(a, torch.Tensor) and a.device != device:
        fail(
            ValueError,
            name,
            Described(f"a tensor on {a.device}", a),
            f"a tensor on the model's device ({device})",
            f"Move it there first, e.g. .to({str(device)!r}) (nothing was run or changed).",
        )


def _place(a: Any, device: torch.device, copy: bool = False) -> torch.Tensor:
    """A stream's array as a tensor on ``device`` (`_check_device` passed): a tensor as it
    is, any other array shared where it can be (a call's `Batches`) or, with ``copy``,
    copied (an `Epochs` dataset, kept for later calls: as with JAX and TF, a NumPy array
    changed in place after the first call is not seen, on the CPU as on a GPU)."""
    if isinstance(a, torch.Tensor):
        return a.detach()
    array = np.asarray(a)
    if any(s < 0 for s in array.strides):  # (x[::-1]: torch takes no negative strides)
        array = np.ascontiguousarray(array)
    with warnings.catch_warnings():  # (a read-only memmap, shared: the fit only reads it)
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return (torch.tensor if copy else torch.as_tensor)(array, device=device)


class Fed:
    """A call's arguments as the fit feeds them, from the fit's global step ``start``
    (``fit.step`` at the call's start) on ``device`` (the model's).

    Raises (before anything runs) a ValueError naming the argument when a stream's
    tensor is on another device, or a `Batches` holds fewer minibatches than ``n``.
    An `Epochs`' dataset goes to the device once (`stepfuse.Epochs.placed`).

    Attributes:
      streams: whether any argument is a stream (otherwise the arguments pass through).
      slots: the layout of the arguments (`stepfuse._core.data.Slot`).
      pick: ``pick(inputs, i)`` -> the arguments of ``loss_fn`` at the call's step ``i``
        (a 0-dim int64 tensor) inside the program; None without streams.
    """

    def __init__(
        self, args: Sequence[Any], device: torch.device, start: int, n: int, optimizer: Any = None
    ):
        feed = feed_of(args)
        feed.check_steps(n)  # (a stream too short for the call raises here, before anything runs)
        if start == 0 and optimizer is not None:  # a fit rebuilt after a restore, at step 0?
            warn_restarted(args, start, _steps_taken(optimizer))
        self.args = tuple(args)
        self.streams = feed.streams
        self.slots = feed.slots
        self.start = int(start)
        self.device = device
        self._layout = Feed(feed.slots, ())  # `Feed.pick` reads the slots alone
        self._epochs: list[tuple[Slot, int]] = []  # (slot, rows) of each Epochs argument
        self.arrays: tuple[Any, ...] = self.args
        self.pick: Callable[[Sequence[Any], torch.Tensor], tuple] | None = None
        if not self.streams:
            return
        for k, (slot, source) in enumerate(zip(feed.slots, args)):
            for j, a in enumerate(source.arrays if slot.kind != "fixed" else ()):
                _check_device(a, device, f"batch[{k}] ({type(source).__name__} array {j})")
        put = functools.partial(_place, device=device)
        kept = functools.partial(_place, device=device, copy=True)  # an Epochs' dataset
        arrays: list[Any] = []
        for slot, source in zip(feed.slots, args):
            if slot.kind == "fixed":
                arrays.append(source)
            elif isinstance(source, Epochs):
                arrays.extend(source.placed(("torch", device), kept))
                self._epochs.append((slot, source.rows))
            else:
                arrays.extend(put(a) for a in source.arrays)
        self.arrays = tuple(arrays)
        self.pick = _Pick(self._layout, len(self.arrays), tuple(s for s, _ in self._epochs))

    @property
    def _shuffled(self) -> list[tuple[Slot, int]]:
        return [(s, rows) for s, rows in self._epochs if s.shuffle]

    # -- the eager side -----------------------------------------------------------------

    def at(self, i: int) -> tuple:
        """The arguments of ``loss_fn`` at the call's step ``i`` (eager tensors)."""
        if not self.streams:
            return self.args
        t = self.start + i
        rows_of = [self._rows(s, rows, t) for s, rows in self._epochs]
        return self._layout.pick(
            self.arrays, lambda a: a[i], lambda k: rows_of[k], lambda a, r: a.index_select(0, r)
        )

    def _rows(self, s: Slot, rows: int, t: int) -> torch.Tensor:
        """The rows of global step ``t``'s minibatch of an Epochs slot ``s``."""
        epoch, at = divmod(t, s.steps_per_epoch)
        lo = at * s.batch_size
        if not s.shuffle:
            return torch.arange(lo, lo + s.batch_size, dtype=torch.int64, device=self.device)
        return epoch_order(rows, s.seed, epoch, self.device)[lo : lo + s.batch_size]

    def room(self, i: int) -> int:
        """Steps from the call's step ``i`` to the next epoch boundary of a shuffled
        `Epochs` (where the program must be given another permutation)."""
        if not self._epochs:
            return _NO_EPOCH
        t = self.start + i
        return min(
            (s.steps_per_epoch - t % s.steps_per_epoch for s, _ in self._shuffled),
            default=_NO_EPOCH,
        )

    # -- the program's side -------------------------------------------------------------

    def inputs(self, i0: int) -> tuple:
        """What the program is given for a segment from the call's step ``i0``: the flat
        arrays, each shuffled Epochs' permutation of that step's epoch, the call's first
        global step (a 0-dim int64 tensor). Without streams: the arguments as given."""
        if not self.streams:
            return self.args
        t = self.start + i0
        perms = tuple(
            epoch_order(rows, s.seed, t // s.steps_per_epoch, self.device)
            for s, rows in self._shuffled
        )
        start = torch.tensor(self.start, dtype=torch.int64, device=self.device)
        return (*self.arrays, *perms, start)

    @property
    def key(self) -> tuple:
        """What a program for these arguments is specialised to (`_program.batch_key` of
        the inputs, with the slots; an Epochs' seed is an input's value, not part of it)."""
        if not self.streams:  # the arguments as given: every slot is a fixed one
            return batch_key(self.args)
        slots = tuple(dataclasses.replace(s, seed=0) for s in self.slots)
        return batch_key(self.inputs(0), slots)


def _steps_taken(optimizer: Any) -> int:
    """The steps a ``torch.optim`` optimizer has taken, from its state's ``step`` (0 where
    its state keeps no count, as plain SGD's)."""
    counts = [s["step"] for s in optimizer.state.values() if "step" in s]
    return int(max(float(c) for c in counts)) if counts else 0


@dataclasses.dataclass(frozen=True)
class _Pick:
    """`Fed.pick`: a step's minibatch inside the program, from static facts alone (the
    program holds it; it keeps no call's arrays alive)."""

    layout: Feed
    n_arrays: int
    epochs: tuple[Slot, ...]  # the Epochs slots, in argument order

    def __call__(self, inputs: Sequence[Any], i: torch.Tensor) -> tuple:
        """The arguments of ``loss_fn`` at the call's step ``i`` (a 0-dim tensor), traced
        into the loop body. A masked step past the call's end reads a valid entry."""
        m, shuffled = self.n_arrays, sum(s.shuffle for s in self.epochs)
        arrays, perms, start = inputs[:m], inputs[m : m + shuffled], inputs[m + shuffled]
        t = start + i
        order = iter(perms)
        perm_of = [next(order) if s.shuffle else None for s in self.epochs]

        def take(a: torch.Tensor) -> torch.Tensor:
            return a.index_select(0, torch.clamp(i, max=a.shape[0] - 1).reshape(1))[0]

        def rows(k: int) -> torch.Tensor:
            s, perm = self.epochs[k], perm_of[k]
            at = (t % s.steps_per_epoch) * s.batch_size
            idx = at + torch.arange(s.batch_size, dtype=torch.int64, device=t.device)
            return idx if perm is None else perm.index_select(0, idx)

        return self.layout.pick(arrays, take, rows, lambda a, r: a.index_select(0, r))
