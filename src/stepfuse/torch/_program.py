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

import contextlib
import math
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree

from .._core import Flow, ceil_div, loop
from ._draws import exact_draws
from ._ops import TORCH

__all__ = [
    "Body",
    "Carry",
    "Result",
    "batch_key",
    "build_program",
    "clip_grads",
    "compile_fn",
    "run_program",
    "traceable",
]

INDUCTOR_OPTIONS: dict[str, Any] = {"cpp_wrapper": True, "fallback_random": True}
"""Inductor options of the fused program: the C++ wrapper runs the loop without Python;
``fallback_random`` has random ops (``torch.rand``, ``randn``, ``bernoulli`` ...) draw from
torch's global generator, as in eager mode, rather than from inductor's own seeds."""

CHUNK_OPTIONS: dict[str, Any] = {"fallback_random": True}
"""Inductor options of the CUDA chunk (`stepfuse.torch._cuda`)."""

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
    buffers: tuple[torch.Tensor, ...] = ()
    """The modules' buffers (BatchNorm's running statistics ...), as a forward leaves them."""

    def flat(self) -> tuple[torch.Tensor, ...]:
        """The tensors as ``while_loop`` carries them (a flat tuple, no None)."""
        flow = tuple(f for f in self.flow if f is not None)
        return (*flow, self.losses, *self.params, *self.states, *self.buffers)


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
    buffers: tuple[str, ...] = ()
    """Names of the modules' buffers, carried through the loop: a forward in train mode
    changes some (BatchNorm), and each step's forward starts from the last one's."""
    clip_norm: float | None = None
    """``max_norm`` of ``torch.nn.utils.clip_grad_norm_`` between gradient and update."""
    clip_value: float | None = None
    """``clip_value`` of ``torch.nn.utils.clip_grad_value_`` between gradient and update."""
    rnn: bool = False
    """Whether the modules hold recurrent layers (traced and run within `traceable`)."""
    pick: Callable[[Sequence[Any], Any], tuple] | None = None
    """``pick(batch, i)``: the arguments of ``loss_fn`` at the call's step ``i`` (a 0-dim
    tensor) from the program's ``batch`` (`stepfuse.torch._data.Fed.pick`, data streams);
    None: ``batch`` is the arguments, the same every step."""
    sync: Any = None
    """Several ranks: `stepfuse.torch._dist.Sync`, which broadcasts DDP's buffers before
    each step's forward and averages each step's gradients over the ranks; None: one."""

    def carry(self, flat: Sequence[torch.Tensor]) -> Carry:
        """The named view of a flat carry (`Carry.flat` inverted)."""
        nf = 4 if self.tol is not None else 3
        at = nf + 1 + self.n_params
        nb = len(flat) - len(self.buffers)
        return Carry(
            Flow(*flat[:nf]),
            flat[nf],
            tuple(flat[nf + 1 : at]),
            tuple(flat[at:nb]),
            tuple(flat[nb:]),
        )

    def start(
        self,
        prev: torch.Tensor,
        nslots: int,
        params: Sequence[torch.Tensor],
        states: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor] = (),
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
        return Carry(flow, losses, tuple(params), tuple(states), tuple(buffers))

    def make(self, n: Any, i0: Any, base: Any, batch: tuple) -> Callable[..., tuple]:
        """The loop body over a flat carry: ``chunk`` steps, each masked so a stop mid-chunk
        (or the call's end) leaves the state of the stepwise loop."""
        wrapper, names, others, update = self.wrapper, self.names, self.others, self.update
        bnames = self.buffers

        def loss_of(ps, bs, args):
            held = {k: wrapper.get_parameter(k).detach() for k in others}
            # The forward changes buffers in place (BatchNorm): on copies made inside the
            # transformed function, returned as the step's new buffers (a mutation of the
            # carried ones would be one of a captured tensor, which torch.func refuses).
            bs = [b.clone() for b in bs]
            tensors = {**held, **dict(zip(bnames, bs)), **dict(zip(names, ps))}
            return torch.func.functional_call(wrapper, tensors, args), tuple(bs)

        grad_and_loss = torch.func.grad_and_value(loss_of, has_aux=True)

        def body(*flat):
            c = self.carry(flat)
            flow, losses, ps, ss = c.flow, c.losses, list(c.params), list(c.states)
            bs = list(c.buffers)
            met = self.met
            spare = losses.shape[0] - 1
            for _ in range(self.chunk):
                active = loop.running(TORCH, flow, n, met)
                ic = i0 + flow.i  # index of this step within the user's call
                args = batch if self.pick is None else self.pick(batch, ic)
                fwd = bs if self.sync is None else self.sync.buffers(self, bs)
                grads, (loss, new_b) = grad_and_loss(tuple(ps), tuple(fwd), args)
                loss = loss.detach()
                if self.sync is not None:  # averaged over the ranks, before clipping
                    grads = self.sync.grads(self, grads, loss)
                grads = clip_grads(list(grads), self.clip_norm, self.clip_value)
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
                bs = [torch.where(ok, a.detach(), b) for a, b in zip(new_b, bs)]
                slot = torch.where(
                    active, loop.record_slot(ic, self.record_every, base, spare, TORCH), spare
                )
                losses = losses.index_copy(0, slot.reshape(1), loss.reshape(1).to(losses.dtype))
                flow = loop.masked(TORCH, active, stepped, flow)
            return Carry(flow, losses, tuple(ps), tuple(ss), tuple(bs)).flat()

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
            if m == 0:  # a group whose parameters are all frozen: torch updates none
                continue
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
    """The compiled program: ``program(n, i0, base, prev, nslots, params, states, buffers,
    batch)`` runs up to ``n`` steps of the call from its step ``i0`` and returns a `Result`."""

    def program(n, i0, base, prev, nslots, params, states, buffers, batch):
        from torch._higher_order_ops.while_loop import while_loop

        body = spec.make(n, i0, base, batch)
        met = spec.met
        start = spec.start(prev, nslots + 1, params, states, buffers)
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
    buffers: Sequence[torch.Tensor],
    batch: tuple,
    rnn: bool = False,
) -> Result:
    """One program call: up to ``n`` steps from the call's step ``i0`` (a `Result`);
    ``rnn``: the modules hold recurrent layers (`traceable`)."""
    nslots = ceil_div(cap, record_every) + 1
    dev = params[0].device
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    # Without autograd around it: parameters the optimizer does not hold may require grad,
    # and the loop must not be recorded for a backward (torch.func.grad still works inside).
    # Dropout draws the plain loop's masks (`stepfuse.torch._draws`).
    with torch.no_grad(), traceable(rnn), exact_draws():
        return program(
            t(n),
            t(i0),
            t(ceil_div(i0, record_every)),
            prev,
            nslots,
            params,
            states,
            buffers,
            batch,
        )


class _Held:
    """What torch's gradient clipping reads of a parameter: its ``.grad``."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad


def clip_grads(
    grads: list[torch.Tensor], max_norm: float | None, clip_value: float | None
) -> list[torch.Tensor]:
    """``grads`` clipped by torch's own ``clip_grad_norm_`` / ``clip_grad_value_`` (in
    place, on the gradients the loop computed), as the plain loop clips ``p.grad``."""
    # Per tensor (foreach=False): inductor cannot lower a foreach op's list inside the
    # while_loop; eager torch's foreach norm on CPU runs the same per-tensor norm.
    held: list[Any] = [_Held(g) for g in grads]
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(held, max_norm, foreach=False)
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(held, clip_value, foreach=False)
    return grads


def _rnn_flat_weights(self: nn.RNNBase) -> list[torch.Tensor | None]:
    return [getattr(self, n, None) for n in self._flat_weights_names]


@contextlib.contextmanager
def traceable(rnn: bool) -> Iterator[None]:
    """Tracing and running the fused program with recurrent layers (``nn.RNN``, ``LSTM``,
    ``GRU``) made traceable, as torch runs them eagerly on CPU (without ``rnn``: nothing).

    Their forward caches the current weights on the module (``_flat_weights``, refreshed
    when `functional_call` swaps them), a mutation dynamo refuses inside ``while_loop``:
    here the list is read from the module's parameters at each forward instead, which is
    what the cache holds. Dynamo traces RNNs only with ``allow_rnn``; torch's LSTM
    decomposition picks oneDNN's kernel when its input needs no gradient, whose backward
    cannot be traced under ``torch.func.grad``, so oneDNN is off here: the decomposition's
    composite cell is what eager CPU training runs."""
    if not rnn:
        yield
        return
    base = nn.RNNBase
    saved = {k: base.__dict__[k] for k in ("_update_flat_weights", "__setattr__")}
    patch = {
        "_flat_weights": property(_rnn_flat_weights, lambda self, value: None),
        "_update_flat_weights": lambda self: None,
        "__setattr__": nn.Module.__setattr__,
    }
    for k, v in patch.items():
        setattr(base, k, v)
    try:
        with torch._dynamo.config.patch(allow_rnn=True), torch.backends.mkldnn.flags(enabled=False):
            yield
    finally:
        delattr(base, "_flat_weights")
        for k, v in saved.items():
            setattr(base, k, v)


def batch_key(batch: Sequence[Any], slots: tuple = ()) -> tuple:
    """What a compiled program is specialised to: the batch's nesting and, per leaf, a
    tensor's shape, dtype and device or another value itself (never a tensor's repr,
    which elides the values of a large one); with data streams, the program's inputs and
    the call's ``slots`` (`stepfuse._core.data.Slot`: how the program picks a step's
    arguments from them)."""
    leaves, spec = _pytree.tree_flatten(tuple(batch))
    return (str(spec), *slots) + tuple(
        (tuple(t.shape), t.dtype, t.device)
        if isinstance(t, torch.Tensor)
        else (type(t).__name__, repr(t))
        for t in leaves
    )
