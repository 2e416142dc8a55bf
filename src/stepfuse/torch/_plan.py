"""How many steps the fused program runs per iteration of its loop (``chunk``), by model.

A ``while_loop`` iteration costs a few microseconds on the CPU beyond its steps (the loop's
test, the carried tensors' handles and buffers), and the steps of a chunk after the call's
last one are computed and discarded (masked). Both matter only at the two ends:

- a tiny model (the seed's perceptron: a step is a few microseconds) runs ~25% faster a step
  with ``chunk=4`` than with ``chunk=1``, and its three discarded steps cost little;
- a larger one (an MLP on 1,024 rows, a CNN, an LSTM: a step is 0.1 ms or more) gains
  nothing from a longer chunk, while the discarded steps made a call of one step cost four,
  and its compile time grows with the chunk (a chunk of four LSTM steps compiled ~4x longer).

So ``chunk=None`` (the default) picks `TINY_CHUNK` for a tiny step and 1 otherwise. Tiny is
measured, not guessed: one forward pass of ``loss_fn`` on the call's batch (no gradient,
random state and BatchNorm statistics put back) is counted by a dispatch mode, its floating
point operations by torch's own formulas (``torch.utils.flop_counter``: matrix products,
convolutions, attention) and the elements its operations write. Recurrent layers always
count as large (their cells are many small operations a step, which the count of an
eager forward on oneDNN's fused kernel does not see). The measurements behind the
thresholds: docs/internals/torch.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ._probe import KeptGenerators, cuda_devices, hold_buffers
from ._state import put_back

__all__ = [
    "CUDA_CHUNK",
    "Plan",
    "TINY_CHUNK",
    "TINY_ELEMENTS",
    "TINY_FLOPS",
    "choose",
    "describe",
    "forward_size",
]

TINY_CHUNK = 4
"""Steps per loop iteration for a tiny model."""

TINY_FLOPS = 400_000
"""A forward pass of at most this many floating point operations (x 3 for a step: the
backward is about twice the forward) and at most `TINY_ELEMENTS` written is tiny. Measured
on the 2-core CPU VM (2026-12-04), an MLP 32-64-10 with Adam on minibatches of 32 from
`Epochs` (172,032 flops, 7,426 elements): 45.5 us a step with 4 steps an iteration against
61.3 with 1 over 2,048 steps, even at 3 steps a call, 462 against 361 us for a call of one
step."""

TINY_ELEMENTS = 100_000

CUDA_CHUNK = 4
"""Steps per captured chunk on CUDA when ``fuse`` is given no chunk (its measurements)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chunk a fit's program runs and why (`stepfuse.torch.Fit.plan`)."""

    chunk: int
    reason: str
    flops: int | None = None
    """Floating point operations of one forward pass (None: not measured)."""
    elements: int | None = None
    """Elements written by that forward pass's operations."""


class _Count(TorchDispatchMode):
    """Counts the floating point operations and the elements written of what runs."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.flops = 0
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def forward_size(
    loss_fn: Callable[..., Any], modules: Sequence[nn.Module], batch: tuple
) -> tuple[int, int]:
    """``(flops, elements)`` of one forward pass of ``loss_fn(*batch)``; changes nothing."""
    held = hold_buffers(modules)
    params = [p for m in modules for p in m.parameters()]
    try:
        with torch.random.fork_rng(devices=cuda_devices([*params, *batch])), torch.no_grad():
            with KeptGenerators(), _Count() as count:
                loss_fn(*batch)
    finally:
        put_back(held)
    return count.flops, count.elements


def choose(
    chunk: int | None,
    loss_fn: Callable[..., Any],
    modules: Sequence[nn.Module],
    batch: tuple,
    rnn: bool,
    draws: bool = False,
    cuda: bool = False,
) -> Plan:
    """The plan of a fit whose ``fuse`` was given ``chunk`` (None: chosen here) on its
    first ``batch``; ``draws``: ``loss_fn`` draws random numbers; ``cuda``: the CUDA path.

    A ``loss_fn`` that draws runs one step a chunk whatever ``chunk`` says: each step of
    a chunk runs its forward pass, also the masked steps after the call's last one, whose
    draws would advance the random state past the plain loop's."""
    if draws:
        return Plan(1, "loss_fn draws random numbers (dropout, torch.randn ...): one step a chunk")
    if chunk is not None:
        return Plan(chunk, "given to fuse")
    if cuda:
        return Plan(CUDA_CHUNK, "CUDA graphs (measured with this chunk)")
    if rnn:
        return Plan(1, "recurrent layers: a step is many small operations")
    try:
        flops, elements = forward_size(loss_fn, modules, batch)
    except Exception as e:  # noqa: BLE001 - a forward without autograd may fail: one step
        return Plan(1, f"the step could not be measured ({type(e).__name__})")
    size = f"{flops:,} flops, {elements:,} elements written by a forward pass"
    if flops <= TINY_FLOPS and elements <= TINY_ELEMENTS:
        return Plan(TINY_CHUNK, f"a tiny step ({size})", flops, elements)
    return Plan(1, f"not a tiny step ({size})", flops, elements)


def describe(plan: Plan | None, chunk: int, direct: bool, steps: int) -> dict[str, Any]:
    """`stepfuse.torch.Fit.plan`: ``chunk`` and why, the forward pass's size it was chosen
    from, whether calls run the compiled code directly (`_program.Program`), and the most
    steps one program call runs (a longer call runs several)."""
    p = plan or Plan(chunk, "not chosen yet: the first call chooses")
    return {
        "chunk": chunk,
        "reason": p.reason,
        "flops": p.flops,
        "elements": p.elements,
        "direct_call": direct,
        "steps_per_program_call": steps,
    }
