"""The fused program: a compiled ``while_loop`` whose body is a chunk of masked steps.

Each step evaluates loss and gradients at the current parameters
(``torch.func.grad_and_value`` over ``torch.func.functional_call``), proposes the update
with the optimizer's own single-tensor update function (`stepfuse.torch._rules`) on
copies, and keeps it only if everything is finite. Its bookkeeping (which steps run,
where a loss is recorded, ``tol``, the stop code) is `stepfuse._core.loop`'s, over torch
tensors (`stepfuse.torch._ops.TORCH`). The loop bound is a tensor, so any ``steps`` runs
on the same program: compile time does not grow with ``steps``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree

from .._core import Flow, ceil_div, loop
from ._ops import TORCH

__all__ = ["Body", "Carry", "Result", "batch_key", "build_program", "compile_fn", "run_program"]

INDUCTOR_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}
"""Inductor options of the fused program: the C++ wrapper runs the loop without Python."""

Met = Callable[[Any, Any], Any]


class Carry(NamedTuple):
    """What the loop carries from step to step (on a device: 0-dim tensors and buffers).

    ``flow.before`` is carried only with ``tol``; ``losses`` has one slot per recorded
    loss of a program call and a spare last slot that unrecorded steps write.
    """

    flow: Flow
    losses: torch.Tensor
    params: tuple[torch.Tensor, ...]
    states: tuple[torch.Tensor, ...]

    def flat(self) -> tuple[torch.Tensor, ...]:
        """The tensors as ``while_loop`` carries them (a flat tuple, no None)."""
        flow = tuple(f for f in self.flow if f is not None)
        return (*flow, self.losses, *self.params, *self.states)


class Result(NamedTuple):
    """A program call's outcome: the `Stop` code, updates applied, and the final carry."""

    code: torch.Tensor
    applied: torch.Tensor
    carry: Carry


def met_of(tol: float | None, dtype: torch.dtype) -> Met | None:
    """The shared ``tol`` test for losses of ``dtype`` (None without ``tol``)."""
    if tol is None:
        return None
    return loop.within_tol(TORCH, tol, np.float64 if dtype == torch.float64 else np.float32)


def outcome(flow: Flow, met: Met | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stop code, updates applied)`` of a loop whose carry ended at ``flow``."""
    return loop.stop_code(TORCH, flow, met), loop.applied(TORCH, flow)


class Body(NamedTuple):
    """Everything a loop body is built from, as plain values: no optimizer access when
    traced. ``info``: ``[(slice of params, state keys, hyper-parameters)]`` per group;
    ``others``: names of the modules' parameters the optimizer does not hold, which enter
    the loss as constants (the optimizer never changes them)."""

    wrapper: nn.Module
    names: tuple[str, ...]
    others: tuple[str, ...]
    update: Callable[..., None]
    info: list[tuple[slice, tuple[str, ...], dict[str, Any]]]
    chunk: int
    record_every: int
    tol: float | None
    n_params: int
    capturable: bool
    met: Met | None
    """The ``tol`` test for the loss dtype (`met_of`), built outside the traced code."""

    def carry(self, flat: Sequence[torch.Tensor]) -> Carry:
        """The named view of a flat carry (`Carry.flat` inverted)."""
        nf = 4 if self.tol is not None else 3
        at = nf + 1 + self.n_params
        return Carry(Flow(*flat[:nf]), flat[nf], tuple(flat[nf + 1 : at]), tuple(flat[at:]))

    def start(
        self,
        prev: torch.Tensor,
        nslots: int,
        params: Sequence[torch.Tensor],
        states: Sequence[torch.Tensor],
    ) -> Carry:
        """The carry at a program call's start: no step evaluated, ``last`` the call's
        previous loss (NaN at its start), ``before`` NaN (``tol`` met by no first step)."""
        dev = prev.device
        flow = Flow(
            torch.zeros((), dtype=torch.int64, device=dev),
            torch.zeros((), dtype=prev.dtype, device=dev),
            prev.clone(),
            torch.full((), math.nan, dtype=prev.dtype, device=dev)
            if self.tol is not None
            else None,
        )
        losses = torch.full((nslots,), math.nan, dtype=prev.dtype, device=dev)
        return Carry(flow, losses, tuple(params), tuple(states))

    def make(self, n: Any, i0: Any, base: Any, batch: tuple) -> Callable[..., tuple]:
        """The loop body over a flat carry: ``chunk`` steps, each masked so a stop mid-chunk
        (or the call's end) leaves the state of the stepwise loop."""
        wrapper, names, others, update = self.wrapper, self.names, self.others, self.update

        def loss_of(ps):
            held = {k: wrapper.get_parameter(k).detach() for k in others}
            return torch.func.functional_call(wrapper, {**held, **dict(zip(names, ps))}, batch)

        grad_and_loss = torch.func.grad_and_value(loss_of)

        def body(*flat):
            c = self.carry(flat)
            flow, losses, ps, ss = c.flow, c.losses, list(c.params), list(c.states)
            met = self.met
            spare = losses.shape[0] - 1
            for _ in range(self.chunk):
                active = loop.running(TORCH, flow, n, met)
                grads, loss = grad_and_loss(tuple(ps))
                loss = loss.detach()
                new_p = [p.clone() for p in ps]  # torch's update works in place: on copies
                new_s = [s.clone() for s in ss]
                self._update(update, new_p, new_s, grads)
                finite = torch.isfinite(loss)
                for t in list(grads) + new_p + [s for s in new_s if s.is_floating_point()]:
                    finite = finite & torch.isfinite(t).all()
                probe = torch.where(finite, 0.0, math.nan).to(flow.probe.dtype)
                stepped = loop.advance(flow, loss.to(flow.last.dtype), probe)
                ok = active & TORCH.logical_not(loop.refused(TORCH, stepped))
                ps = [torch.where(ok, a, b) for a, b in zip(new_p, ps)]
                ss = [torch.where(ok, a, b) for a, b in zip(new_s, ss)]
                ic = i0 + flow.i  # index of this step within the user's call
                slot = torch.where(
                    active, loop.record_slot(ic, self.record_every, base, spare, TORCH), spare
                )
                losses = losses.index_copy(0, slot.reshape(1), loss.reshape(1).to(losses.dtype))
                flow = loop.masked(TORCH, active, stepped, flow)
            return Carry(flow, losses, tuple(ps), tuple(ss)).flat()

        return body

    def _update(
        self,
        update: Callable[..., None],
        new_p: list[torch.Tensor],
        new_s: list[torch.Tensor],
        grads: Sequence[torch.Tensor],
    ) -> None:
        """Run each group's update rule in place on the copies ``new_p`` / ``new_s``."""
        j = 0
        for sl, keys, h in self.info:
            m = sl.stop - sl.start
            st = {}
            for k in keys:
                st[k] = new_s[j : j + m]
                if k == "step":
                    # Eager torch reads `step` as a Python float (double): do the
                    # bias-correction math in float64 too (the capturable rules on CUDA
                    # included; in float32 they drift from eager Adam within a few steps).
                    st[k] = [t.double() for t in st[k]]
                j += m
            update(new_p[sl], list(grads[sl]), st, h, self.capturable)
            if "step" in st:
                at = j - m * (len(keys) - list(keys).index("step"))
                for q, t in enumerate(st["step"]):
                    new_s[at + q] = t.to(new_s[at + q].dtype)


def compile_fn(
    fn: Callable, name: str, inductor_options: dict[str, Any], on_compile: Callable[[], None]
) -> Callable:
    """``torch.compile`` of ``fn`` (whole graph, static shapes) with inductor, calling
    ``on_compile()`` at each compilation. ``name`` names the code object: one per fit, so
    dynamo's per-code cache never mixes fits."""
    code = fn.__code__.replace(co_name=name)
    fn = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)

    def backend(gm, example_inputs):
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        on_compile()
        with config.patch(inductor_options):
            return compile_fx(gm, example_inputs)

    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def build_program(
    spec: Body, compile: Callable[[Callable, str, dict[str, Any]], Callable]
) -> Callable:
    """The compiled program: ``program(n, i0, base, prev, nslots, params, states, batch)``
    runs up to ``n`` steps of the call from its step ``i0`` and returns a `Result`."""

    def program(n, i0, base, prev, nslots, params, states, batch):
        from torch._higher_order_ops.while_loop import while_loop

        body = spec.make(n, i0, base, batch)
        met = spec.met
        start = spec.start(prev, nslots + 1, params, states)
        flat = while_loop(
            lambda *c: loop.running(TORCH, spec.carry(c).flow, n, met), body, start.flat()
        )
        end = spec.carry(flat)
        code, applied = outcome(end.flow, met)
        return Result(code, applied, end)

    return compile(program, "program", INDUCTOR_OPTIONS)


def run_program(
    program: Callable,
    cap: int,
    record_every: int,
    n: int,
    i0: int,
    prev: torch.Tensor,
    params: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    batch: tuple,
) -> Result:
    """One program call: up to ``n`` steps from the call's step ``i0`` (a `Result`)."""
    nslots = ceil_div(cap, record_every) + 1
    dev = params[0].device
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    # Without autograd around it: parameters the optimizer does not hold may require grad,
    # and the loop must not be recorded for a backward (torch.func.grad still works inside).
    with torch.no_grad():
        return program(
            t(n), t(i0), t(ceil_div(i0, record_every)), prev, nslots, params, states, batch
        )


def batch_key(batch: Sequence[Any]) -> tuple:
    """What a compiled program is specialised to: the batch's nesting and, per leaf, a
    tensor's shape, dtype and device or another value itself (never a tensor's repr,
    which elides the values of a large one)."""
    leaves, spec = _pytree.tree_flatten(tuple(batch))
    return (str(spec),) + tuple(
        (tuple(t.shape), t.dtype, t.device)
        if isinstance(t, torch.Tensor)
        else (type(t).__name__, repr(t))
        for t in leaves
    )
