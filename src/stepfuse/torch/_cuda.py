"""The CUDA path: a compiled chunk captured in CUDA graphs over static buffers.

On CUDA the chunk (with torch's capturable update rules) is compiled by inductor without
the loop and captured twice in CUDA graphs, once and `GRAPH_CHUNKS` times in a row, over
static buffers for the batch, parameters and state; a call replays them, then reads the
stop code once per segment. Where inductor cannot compile the model, the eager chunk is
captured instead (correct, several times slower a step: docs/internals/torch.md).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree

from .._core import ceil_div
from ._probe import interrupt_inside
from ._program import CHUNK_OPTIONS, Body, Carry, Result, options_for, outcome, traceable

__all__ = ["GRAPH_CHUNKS", "build_graphs", "cuda_graphs", "run_graphs"]

GRAPH_CHUNKS = 8
"""Chunks per replay of the long graph (a short one replays one chunk)."""


def cuda_graphs(chunk: Callable[[], None], dev: Any, sizes: Sequence[int]) -> list:
    """One CUDA graph per ``k`` in ``sizes``, each replaying ``chunk()`` ``k`` times.

    ``chunk`` runs three times first on a side stream (torch's recipe: compiles,
    autotuning and the allocator's growth happen there, outside any capture); it must
    change nothing while its static step count is zero.
    """
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            chunk()
    torch.cuda.current_stream(dev).wait_stream(side)
    graphs = []
    for k in sizes:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(k):
                chunk()
        graphs.append(graph)
    return graphs


def build_graphs(
    spec: Body,
    compile: Callable[[Callable, str, dict[str, Any]], Callable],
    eager_ok: bool,
    cap: int,
    params: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    batch: tuple,
    prev: torch.Tensor,
) -> types.SimpleNamespace:
    """Static buffers and two CUDA graphs of the chunk: one chunk, and `GRAPH_CHUNKS`
    chunks in a row (one replay = that many steps). The chunk is compiled by inductor
    (few fused kernels a step); where that fails and ``eager_ok`` (the rule's eager form
    can be captured), the eager chunk is captured instead (``fused_kernels`` says which).
    ``spec`` is built with torch's capturable update rules: `step` lives on the device
    (dynamo also refuses to trace the non-capturable ones with CUDA steps)."""
    dev = params[0].device
    i64 = lambda: torch.zeros((), dtype=torch.int64, device=dev)  # noqa: E731
    s = types.SimpleNamespace()
    s.n, s.i0, s.base = i64(), i64(), i64()
    s.code, s.applied = i64(), i64()
    # Static buffers for the batch: with data streams, the program's inputs (the stacked
    # minibatches, an Epochs' whole dataset and permutation: `stepfuse.torch._data.Fed`).
    s.batch = _pytree.tree_map(
        lambda b: b.detach().clone() if isinstance(b, torch.Tensor) else b, tuple(batch)
    )
    s.fed = {}  # leaf -> (source tensor, its version) last copied into the static buffer
    s.carry = spec.start(
        prev.detach(),
        ceil_div(cap, spec.record_every) + 2,
        [p.detach().clone() for p in params],
        [v.detach().to(dev).clone() for v in states],
        [b.detach().clone() for b in buffers],
    )
    s.state_cpu = [v.device.type == "cpu" for v in states]

    def run_chunk(n, i0, base, batch, code, applied, *flat):  # updates the buffers in place
        end = spec.make(n, i0, base, batch)(*flat)
        for dst, src in zip(flat, end):
            dst.copy_(src)
        flow = spec.carry(end).flow
        c, a = outcome(flow, spec.met)
        code.copy_(c)
        applied.copy_(a)

    args = (s.n, s.i0, s.base, s.batch, s.code, s.applied, *s.carry.flat())
    s.n.fill_(0)  # warm-up runs change nothing
    try:
        compiled = compile(run_chunk, "chunk", options_for(spec, CHUNK_OPTIONS))
        with traceable(spec.rnn):
            s.graphs = cuda_graphs(lambda: compiled(*args), dev, (1, GRAPH_CHUNKS))
        s.fused_kernels, s.compile_error = True, None
    except Exception as e:  # noqa: BLE001 - inductor cannot take this model: capture eagerly
        if interrupt_inside(e) is not None or not eager_ok:
            raise
        with traceable(spec.rnn):
            s.graphs = cuda_graphs(lambda: run_chunk(*args), dev, (1, GRAPH_CHUNKS))
        s.fused_kernels, s.compile_error = False, f"{type(e).__name__}: {e}"
    return s


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change), None where it has none
    (an inference-mode tensor: then it is copied every time)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def run_graphs(
    s: types.SimpleNamespace,
    chunk: int,
    record_every: int,
    n: int,
    i0: int,
    prev: torch.Tensor,
    params: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    batch: tuple,
) -> Result:
    """One segment of up to ``n`` steps on the captured graphs (a `Result`). A batch
    tensor already in its static buffer (the same tensor, unchanged since: an `Epochs`'
    dataset, segment after segment) is not copied again; the graphs never write them."""
    leaves = zip(_pytree.tree_leaves(s.batch), _pytree.tree_leaves(tuple(batch)))  # nested too
    for k, (dst, src) in enumerate(leaves):
        if isinstance(dst, torch.Tensor):
            last, version = s.fed.get(k), _version(src)
            if last is None or last[0] is not src or version is None or last[1] != version:
                dst.copy_(src)
                s.fed[k] = (src, version)
    c: Carry = s.carry
    for dst, src in zip(c.params + c.states + c.buffers, [*params, *states, *buffers]):
        dst.copy_(src)
    s.n.fill_(n)
    s.i0.fill_(i0)
    s.base.fill_(ceil_div(i0, record_every))
    c.flow.last.copy_(prev)  # the flow as at a call's start (`Body.start`)
    c.flow.i.zero_()
    c.flow.probe.zero_()
    if c.flow.before is not None:
        c.flow.before.fill_(math.nan)
    c.losses.fill_(math.nan)
    one, many = s.graphs
    chunks = ceil_div(n, chunk)
    for _ in range(chunks // GRAPH_CHUNKS):
        many.replay()
    for _ in range(chunks % GRAPH_CHUNKS):
        one.replay()
    out_states = tuple(v.to("cpu") if cpu else v for v, cpu in zip(c.states, s.state_cpu))
    return Result(s.code, s.applied, c._replace(states=out_states))
