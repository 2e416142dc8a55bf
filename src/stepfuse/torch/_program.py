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
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree

from .._core import Flow, ceil_div, loop
from ._draws import exact_draws
from ._failure import index_error
from ._ops import TORCH
from ._scalars import RealizeScalars
from ._tracing import traceable

__all__ = [
    "Body",
    "Carry",
    "Program",
    "Result",
    "batch_key",
    "build_program",
    "clip_grads",
    "compile_fn",
    "options_for",
    "run_program",
    "traceable",
]

INDUCTOR_OPTIONS: dict[str, Any] = {
    "cpp_wrapper": True,
    "fallback_random": True,
    "emulate_precision_casts": True,
    "post_grad_custom_post_pass": RealizeScalars(),
}
"""Inductor options of the fused program: the C++ wrapper runs the loop without Python;
``fallback_random`` has random ops (``torch.rand``, ``randn``, ``bernoulli`` ...) draw from
torch's global generator, as in eager mode, rather than from inductor's own seeds;
``emulate_precision_casts`` rounds a float16/bfloat16 op's result where eager torch stores
it (a float16 Adam state computed in float32 and rounded once kept a second moment that
eager torch's float16 flushes to 0: 25% off in a step); a step's scalars (Adam's bias
corrections) computed once a step (`stepfuse.torch._scalars`)."""

CHUNK_OPTIONS: dict[str, Any] = {"fallback_random": True, "emulate_precision_casts": True}
"""Inductor options of the CUDA chunk (`stepfuse.torch._cuda`): random ops and float16 /
bfloat16 rounding as in `INDUCTOR_OPTIONS`."""


def options_for(spec: Body, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with what ``spec``'s program needs: with ``eval_fn``, no layout optimization
    (inductor's channels-last convolutions inside the evaluation's ``torch.cond`` failed
    their own stride checks at run time, torch 2.13: a Conv2d model with ``eval_fn``)."""
    return base if spec.evaluate is None else {**base, "layout_optimization": False}


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
    evals: tuple[torch.Tensor, ...] = ()
    """With ``eval_fn``: the evaluations' count, steps and values (`stepfuse.torch._eval.Spec`)."""

    def flat(self) -> tuple[torch.Tensor, ...]:
        """The tensors as ``while_loop`` carries them (a flat tuple, no None)."""
        flow = tuple(f for f in self.flow if f is not None)
        return (*flow, self.losses, *self.params, *self.states, *self.buffers, *self.evals)


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
    evaluate: Any = None
    """With ``eval_fn``: its `stepfuse.torch._eval.Spec`; the program's ``batch`` then ends
    with the evaluation's inputs (`stepfuse.torch._eval.Evaluations.inputs`)."""
    rates: int = 0
    """Rows of the table of each group's ``lr`` the program reads (`Program`'s ``rates``,
    float64: a Python float's value exactly), so that a new ``lr`` (an lr scheduler's)
    runs the same compiled program: 1, one row for the call; more, a row a step (an
    ``lr_scheduler`` stepped inside the call, `stepfuse.torch._schedule`); 0, the ``lr``
    of ``info`` is compiled in (the CUDA chunk's graphs)."""

    def carry(self, flat: Sequence[torch.Tensor]) -> Carry:
        """The named view of a flat carry (`Carry.flat` inverted)."""
        nf = 4 if self.tol is not None else 3
        at = nf + 1 + self.n_params
        ne = len(flat) - (self.evaluate.size if self.evaluate is not None else 0)
        nb = ne - len(self.buffers)
        return Carry(
            Flow(*flat[:nf]),
            flat[nf],
            tuple(flat[nf + 1 : at]),
            tuple(flat[at:nb]),
            tuple(flat[nb:ne]),
            tuple(flat[ne:]),
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

    def make(
        self, n: Any, i0: Any, base: Any, batch: tuple, lrs: Any = None
    ) -> Callable[..., tuple]:
        """The loop body over a flat carry: ``chunk`` steps. The loop's test has just passed
        for the first, so it runs as it is; each later one is masked, so that a stop
        mid-chunk (or the call's end) leaves the state of the stepwise loop. ``lrs``: each
        group's ``lr`` (with `rates`)."""
        wrapper, names, others, update = self.wrapper, self.names, self.others, self.update
        bnames, ev = self.buffers, self.evaluate
        if ev is not None:  # the evaluation's inputs: the fit's step at the start, eval_batch
            batch, (step0, *eval_args) = tuple(batch[:-1]), batch[-1]

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
            bs, es = list(c.buffers), c.evals
            met = self.met
            spare = losses.shape[0] - 1
            for k in range(self.chunk):
                active = loop.running(TORCH, flow, n, met) if k else None
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
                row = lrs
                if lrs is not None and self.rates > 1:  # this step's row of the table
                    at = flow.i.clamp(max=self.rates - 1).reshape(1)
                    row = lrs.index_select(0, at).squeeze(0)
                self._update(update, new_p, new_s, grads, row)
                finite = all_finite([loss, *grads, *new_p, *new_s])
                probe = torch.where(finite, 0.0, math.nan).to(flow.probe.dtype)
                stepped = loop.advance(flow, loss.to(flow.last.dtype), probe)
                ok = TORCH.logical_not(loop.refused(TORCH, stepped))
                slot = loop.record_slot(ic, self.record_every, base, spare, TORCH)
                if active is not None:
                    ok = active & ok
                    slot = torch.where(active, slot, spare)
                    stepped = loop.masked(TORCH, active, stepped, flow)
                ps = [torch.where(ok, a, b) for a, b in zip(new_p, ps)]
                ss = [torch.where(ok, a, b) for a, b in zip(new_s, ss)]
                bs = [torch.where(ok, a.detach(), b) for a, b in zip(new_b, bs)]
                losses = losses.index_copy(0, slot.reshape(1), loss.reshape(1).to(losses.dtype))
                flow = stepped
                if ev is not None:
                    held = {k: wrapper.get_parameter(k).detach() for k in others}
                    now = {**held, **dict(zip(bnames, bs)), **dict(zip(names, ps))}
                    step = step0 + loop.applied(TORCH, flow)
                    es = ev.after(es, step, ok, now, tuple(eval_args))
            if flow.before is not None and self.chunk == 1:
                # With tol, `before` is the input's `last`: torch's while_loop refuses a body
                # that returns one of its inputs as an output.
                flow = flow._replace(before=flow.before.clone())
            return Carry(flow, losses, tuple(ps), tuple(ss), tuple(bs), tuple(es)).flat()

        return body

    def _update(
        self,
        update: Callable[..., None],
        new_p: list[torch.Tensor],
        new_s: list[torch.Tensor],
        grads: Sequence[torch.Tensor],
        lrs: Any = None,
    ) -> None:
        """Run each group's update rule in place on the copies ``new_p`` / ``new_s``
        (``lrs``: each group's ``lr``, a 0-dim float64 tensor each, in place of ``info``'s)."""
        j = 0
        for gi, (sl, keys, h) in enumerate(self.info):
            m = sl.stop - sl.start
            if m == 0:  # a group whose parameters are all frozen: torch updates none
                continue
            if lrs is not None:
                h = {**h, "lr": lrs[gi]}
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
    fn: Callable,
    name: str,
    inductor_options: dict[str, Any],
    on_compile: Callable[[], None],
    sink: list | None = None,
) -> Callable:
    """``torch.compile`` of ``fn`` (whole graph, static shapes) with inductor, calling
    ``on_compile()`` at each compilation. ``name`` names the code object: one per fit, so
    dynamo's per-code cache never mixes fits. ``sink`` (a list) receives each compiled
    graph as ``(compiled, example_inputs)`` (`Program.bind` calls it directly)."""
    code = fn.__code__.replace(co_name=name)
    fn = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)

    def backend(gm, example_inputs):
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        with config.patch(inductor_options):
            compiled = compile_fx(gm, example_inputs, decompositions=_decompositions())
        on_compile()  # (after: dynamo may restart an analysis, which calls this again)
        if sink is not None:
            sink.append((compiled, list(example_inputs)))
        return compiled

    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


SMALL_MM = 16384
"""CPU matrix products of at most this many multiply-adds (``m * k * n``) are compiled as
inductor's own loops (a product and a sum, fused with their neighbours) rather than calls
of ATen's ``mm`` / ``addmm``, whose fixed cost dominates a tiny model's step (the seed's
perceptron: 50x2 by 2x2); docs/internals/torch.md has the measurements."""


def _small(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device.type == "cpu"
        and a.dim() == 2
        and b.dim() == 2
        and a.dtype in (torch.float32, torch.float64)
        and a.dtype == b.dtype
        and a.shape[0] * a.shape[1] * b.shape[1] <= SMALL_MM
    )


def _decompositions() -> dict:
    """Inductor's decompositions, with `SMALL_MM` matrix products as a product and a sum."""
    from torch._inductor.decomposition import select_decomp_table

    aten = torch.ops.aten
    table = dict(select_decomp_table())
    base_mm, base_addmm = table.get(aten.mm.default), table.get(aten.addmm.default)

    def mm(a, b, *rest, **kw):
        if not rest and not kw and _small(a, b):
            return (a.unsqueeze(2) * b.unsqueeze(0)).sum(1)
        return base_mm(a, b, *rest, **kw) if base_mm is not None else NotImplemented

    def addmm(c, a, b, *rest, beta=1, alpha=1, **kw):
        if not rest and not kw and beta == 1 and alpha == 1 and _small(a, b):
            return c + (a.unsqueeze(2) * b.unsqueeze(0)).sum(1)
        if base_addmm is None:
            return NotImplemented
        return base_addmm(c, a, b, *rest, beta=beta, alpha=alpha, **kw)

    table[aten.mm.default] = mm
    table[aten.addmm.default] = addmm
    return table


def build_program(
    spec: Body, compile: Callable[[Callable, str, dict[str, Any]], Callable]
) -> Callable:
    """The compiled program: ``program(ctl, rates, prev, nslots, params, states, buffers,
    batch)`` runs up to ``n`` steps of the call from its step ``i0`` and returns a
    `Result`, where ``ctl`` holds ``(n, i0, base)`` (int64; ``base``: the loss buffer's
    first record) and ``rates`` each group's ``lr`` (float64; read with `Body.rates`)."""

    def program(ctl, rates, prev, nslots, params, states, buffers, batch):
        from torch._higher_order_ops.while_loop import while_loop

        n, i0, base = (ctl[k].clone() for k in range(3))  # a loop's inputs may not alias
        lrs = None
        if spec.rates == 1:  # the call's lr: one per group
            lrs = [rates[0, k].clone() for k in range(len(spec.info))]
        elif spec.rates > 1:  # a row a step, read in the loop
            lrs = rates.clone()
        body = spec.make(n, i0, base, batch, lrs)
        met = spec.met
        start = spec.start(prev, nslots + 1, params, states, buffers)
        if spec.evaluate is not None:
            start = start._replace(evals=spec.evaluate.start(prev.device))
        flat = while_loop(
            lambda *c: loop.running(TORCH, spec.carry(c).flow, n, met), body, start.flat()
        )
        end = spec.carry(flat)
        code, applied = outcome(end.flow, met)
        return Result(code, applied, end)

    return compile(program, "program", options_for(spec, INDUCTOR_OPTIONS))


def _leaves(batch: Sequence[Any]) -> list[Any]:
    """The leaves of a batch (a flat tuple of tensors without pytree's walk)."""
    if all(isinstance(b, torch.Tensor) for b in batch):
        return list(batch)
    return _pytree.tree_leaves(tuple(batch))


class Program:
    """A compiled fused program (`build_program`) and the way to call it.

    Its first call goes through ``torch.compile``: dynamo traces ``program`` and inductor
    compiles the graph. `bind` then maps each input of the compiled graph to the
    argument of ``program`` it was traced from (by identity), and checks that a direct
    call of the compiled graph returns what ``program`` returned. From then on a call
    runs the compiled graph directly: dynamo's per-call work (its guards over the loop
    body, the modules and the optimizer's hyper-parameters, tens of microseconds a call
    on the seed) is left out. What the guards would check is what a program is built
    for (`stepfuse.torch.Fit` builds one per hyper-parameters, batch signature, set of
    trainable parameters and the modules' training flags), and torch's global state
    (grad mode, autocast, deterministic algorithms ...: dynamo's own `GlobalStateGuard`,
    ~0.2 us) is checked at each call: a call in another state takes ``torch.compile``'s
    path. A graph whose inputs are not all the program's arguments (a tensor ``loss_fn``
    reads from elsewhere) stays on that path for good. Plain Python values ``loss_fn``
    reads (a float in a closure) are compiled in, as the hyper-parameters but ``lr``
    are: a fit does not see them change (docs/internals/torch.md).

    ``ctl`` (``n, i0, base``) is one int64 tensor that every call reuses, written through
    a NumPy view on the CPU (no torch call a segment); ``rates`` (each group's ``lr``,
    float64) likewise: an lr scheduler's new value is the next call's input."""

    def __init__(self, spec: Body, compile: Callable[..., Callable], device: torch.device):
        self.spec = spec
        self.sink: list = []  # the compiled graph, from ``compile(..., sink=)`` (`compile_fn`)
        sink = self.sink
        self.compiled = build_program(
            spec, lambda fn, kind, options: compile(fn, kind, options, sink=sink)
        )
        self.direct: Callable | None = None
        self.take: list[int] = []
        self.nslots = -1
        self.state: Any = None  # torch's global state (grad mode, autocast ...) at `bind`
        self.ctl = torch.zeros(3, dtype=torch.int64, device=device)
        self._ctl = self.ctl.numpy() if device.type == "cpu" else None
        shape = (max(spec.rates, 1), max(len(spec.info), 1))
        self.rates = torch.zeros(shape, dtype=torch.float64, device=device)
        self._rates = self.rates.numpy() if device.type == "cpu" else None

    def __call__(
        self,
        n: int,
        i0: int,
        base: int,
        prev: torch.Tensor,
        nslots: int,
        params: Sequence[torch.Tensor],
        states: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batch: tuple,
        lrs: Any = (),
    ) -> Result:
        """Up to ``n`` steps from the call's step ``i0`` (``base``: `loop.record_slot`'s
        first record, ``nslots`` the loss buffer's size without its spare slot), each
        group's ``lr`` ``lrs`` (with `Body.rates`)."""
        ctl, rates = self.ctl, self.rates
        if self._ctl is not None:
            self._ctl[0], self._ctl[1], self._ctl[2] = n, i0, base
        else:
            ctl.copy_(torch.tensor([n, i0, base], dtype=torch.int64))
        if self.spec.rates:  # a row (each group's lr) or a row a step
            table = np.asarray(lrs, dtype=np.float64).reshape(-1, rates.shape[1])
            if self._rates is not None:
                self._rates[: len(table)] = table
            else:
                rates[: len(table)].copy_(torch.from_numpy(table))
        if self.direct is not None and nslots == self.nslots and self.state.check():
            pool = [ctl, rates, prev, *params, *states, *buffers, *_leaves(batch)]
            pool += self._others()
            out = self.direct(*[pool[j] for j in self.take])
            return Result(out[0], out[1], self.spec.carry(out[2:]))
        args = (ctl, rates, prev, nslots, params, states, buffers, batch)
        result = self.compiled(*args)
        if self.sink:
            compiled, inputs = self.sink[-1]
            self.sink.clear()  # no reference to the build's tensors (the batch) is kept
            self.bind(compiled, inputs, args, result)
        return result

    def _others(self) -> list[torch.Tensor]:
        w = self.spec.wrapper
        return [w.get_parameter(k) for k in self.spec.others]

    def bind(self, compiled: Callable, inputs: Sequence[Any], args: tuple, result: Result) -> None:
        """Call ``compiled`` directly from now on, if every input it takes is one of the
        program's arguments and it returns what the traced call returned (``result``)."""
        ctl, rates, prev, nslots, params, states, buffers, batch = args
        pool = [ctl, rates, prev, *params, *states, *buffers, *_leaves(batch), *self._others()]
        where = {id(t): j for j, t in enumerate(pool) if isinstance(t, torch.Tensor)}
        take = [where.get(id(t), -1) for t in inputs]
        if -1 in take or len(set(take)) != len(take):
            return
        out = compiled(*[pool[j] for j in take])
        want = [t for t in _pytree.tree_leaves(tuple(result)) if isinstance(t, torch.Tensor)]
        if not isinstance(out, (list, tuple)) or len(out) != len(want):
            return
        for a, b in zip(out, want):
            if not (isinstance(a, torch.Tensor) and _same(a, b)):
                return
        guard = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
        if guard is None or not hasattr(guard, "GlobalStateGuard"):
            return
        self.state = guard.GlobalStateGuard()  # a later call in another state: dynamo's path
        self.direct, self.take, self.nslots = compiled, take, nslots


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype, device and values (NaN equal to NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


def run_program(
    program: Program,
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
    lrs: Any = (),
) -> Result:
    """One program call: up to ``n`` steps from the call's step ``i0`` (a `Result`);
    ``rnn``: the modules hold recurrent layers (`traceable`: tracing needs it); ``lrs``:
    each group's ``lr``, or a row of them a step (`Body.rates`)."""
    nslots = ceil_div(cap, record_every) + 1
    base = ceil_div(i0, record_every)
    # Without autograd around it: parameters the optimizer does not hold may require grad,
    # and the loop must not be recorded for a backward (torch.func.grad still works inside).
    try:
        with torch.no_grad():
            if program.direct is not None:  # the compiled code, called directly
                return program(n, i0, base, prev, nslots, params, states, buffers, batch, lrs)
            # Through torch.compile (tracing on the first call): recurrent layers made
            # traceable, dropout drawing the plain loop's masks (`stepfuse.torch._draws`).
            with traceable(rnn), exact_draws(), warnings.catch_warnings():
                # torch's own (inductor imports it): a user's -W error must not stop fusion
                warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\b")
                return program(n, i0, base, prev, nslots, params, states, buffers, batch, lrs)
    except RuntimeError as e:
        if "index out of bounds" not in str(e):
            raise
        raise index_error(e, i0, n) from e


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether every float tensor of ``tensors`` is finite, as one boolean tensor. Tensors
    of one shape are tested together (``isfinite(a) & isfinite(b)``, then one ``all``), so
    the compiled step holds one reduction per shape rather than one per tensor."""
    by_shape: dict[tuple, torch.Tensor] = {}
    for t in tensors:
        if not t.is_floating_point():
            continue
        key = (tuple(t.shape), t.device)
        f = torch.isfinite(t)
        by_shape[key] = f if key not in by_shape else by_shape[key] & f
    checks = [f if f.dim() == 0 else f.all() for f in by_shape.values()]
    out = checks[0]
    for f in checks[1:]:
        out = out & f
    return out


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


def batch_key(batch: Sequence[Any], slots: tuple = ()) -> tuple:
    """What a compiled program is specialised to: the batch's nesting and, per leaf, a
    tensor's shape, strides, dtype and device (calls after the first run the compiled code
    directly, which holds the strides it was traced with) or another value itself (never a
    tensor's repr,
    which elides the values of a large one); with data streams, the program's inputs and
    the call's ``slots`` (`stepfuse._core.data.Slot`: how the program picks a step's
    arguments from them)."""
    if all(isinstance(t, torch.Tensor) for t in batch):  # a flat tuple of tensors
        return ("tensors", *slots) + tuple(_tensor_key(t) for t in batch)
    leaves, spec = _pytree.tree_flatten(tuple(batch))
    return (str(spec), *slots) + tuple(
        _tensor_key(t) if isinstance(t, torch.Tensor) else (type(t).__name__, repr(t))
        for t in leaves
    )


def _tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)
