"""PyTorch backend: many ``torch.optim`` steps inside one compiled program.

``fuse(loss_fn, optimizer, steps=...)`` returns a `FusedFit`; ``fit(*batch)`` runs the
steps and updates the model's parameters and ``optimizer.state`` in place, so the
model and optimizer carry on with ordinary PyTorch afterwards.

How the fused mode works (CPU): one ``torch.compile`` (inductor, C++ wrapper) of a
``while_loop`` whose body is a fixed chunk of ``chunk`` masked steps. Each step
evaluates loss and gradients at the current parameters (``torch.func.grad_and_value``
over ``torch.func.functional_call``), proposes the update with the optimizer's own
single-tensor update function (``torch.optim.adam.adam`` & co.) on copies, and keeps
it only if everything is finite. The loop bound is a tensor, so any ``steps`` runs on
the same program: compile time does not grow with ``steps``. On CUDA the chunk (with
torch's capturable update rules) is compiled by inductor without the loop and captured
twice in CUDA graphs, once and ``_GRAPH_CHUNKS`` times in a row, over static buffers for
the batch, parameters and state; a call replays them (one replay of the long graph = 32
steps by default), then reads the stop code once per segment. Where inductor cannot
compile the model, the eager chunk is captured instead (correct, ~7x slower a step on the
seed: `benchmarks/gpu_check.py`).

``mode="stepwise"`` runs the identical semantics with eager ``loss.backward();
optimizer.step()`` through `stepfuse._loop.run_stepwise` (the reference); it is also
the fallback, with a warning naming the reason, when the fused path cannot handle a
model or optimizer.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import math
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree

from .._core import (
    OPTIONS_DOC,
    Notifier,
    Options,
    Stop,
    Trace,
    check_call_steps,
    check_int,
    check_options,
    deferred_interrupts,
    finish,
    host_trace,
    n_recorded,
    run_stepwise,
)

__all__ = ["fuse", "FusedFit", "BatchError", "SUPPORTED_OPTIMIZERS"]

_MODES = ("fused", "stepwise")
_DEFAULT_CHUNK = 4  # steps per while_loop iteration (compile cost grows with it; see benchmarks)
_SEGMENT = 512  # at most this many steps per program call (see FusedFit._cap)
_GRAPH_CHUNKS = 8  # CUDA: chunks per replay of the long graph (a short one replays one chunk)
_GRAPH_CACHE = 4  # programs kept (per batch signature and hyper-parameters)
_INDUCTOR_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}
"""Inductor options of the fused program: the C++ wrapper runs the loop without Python."""


# --------------------------------------------------------------------------------------
# The optimizers' own update rules (torch.optim functional, single-tensor form).


def _scalar_dtype():
    from torch.optim.optimizer import _get_scalar_dtype

    return _get_scalar_dtype()


def _sgd_keys(g):
    return ("momentum_buffer",) if g["momentum"] != 0 else ()


def _adam_keys(g):
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g["amsgrad"] else ())


def _rmsprop_keys(g):
    keys = ("step", "square_avg")
    if g["momentum"] > 0:
        keys += ("momentum_buffer",)
    if g["centered"]:
        keys += ("grad_avg",)
    return keys


def _adagrad_keys(g):
    return ("step", "sum")


def _sgd_update(p, gr, s, g, capturable):
    from torch.optim.sgd import sgd

    bufs = s.get("momentum_buffer", [None] * len(p))
    sgd(
        p,
        gr,
        bufs,
        foreach=False,
        weight_decay=g["weight_decay"],
        momentum=g["momentum"],
        lr=g["lr"],
        dampening=g["dampening"],
        nesterov=g["nesterov"],
        maximize=g["maximize"],
    )


def _adam_update(p, gr, s, g, capturable, fn=None):
    from torch.optim.adam import adam

    extra = {}
    if "decoupled_weight_decay" in g:  # torch >= 2.8: Adam and AdamW are one rule
        fn, extra = adam, {"decoupled_weight_decay": g["decoupled_weight_decay"]}
    (fn or adam)(
        p,
        gr,
        s["exp_avg"],
        s["exp_avg_sq"],
        s.get("max_exp_avg_sq", []),
        s["step"],
        foreach=False,
        capturable=capturable,
        amsgrad=g["amsgrad"],
        beta1=g["betas"][0],
        beta2=g["betas"][1],
        lr=g["lr"],
        weight_decay=g["weight_decay"],
        eps=g["eps"],
        maximize=g["maximize"],
        **extra,
    )


def _adamw_update(p, gr, s, g, capturable):
    from torch.optim.adamw import adamw

    _adam_update(p, gr, s, g, capturable, fn=adamw)


def _rmsprop_update(p, gr, s, g, capturable):
    from torch.optim.rmsprop import rmsprop

    rmsprop(
        p,
        gr,
        s["square_avg"],
        s.get("grad_avg", []),
        s.get("momentum_buffer", []),
        s["step"],
        foreach=False,
        maximize=g["maximize"],
        capturable=capturable,
        lr=g["lr"],
        alpha=g["alpha"],
        eps=g["eps"],
        weight_decay=g["weight_decay"],
        momentum=g["momentum"],
        centered=g["centered"],
    )


def _adagrad_update(p, gr, s, g, capturable):
    from torch.optim.adagrad import adagrad

    adagrad(
        p,
        gr,
        s["sum"],
        s["step"],
        foreach=False,
        lr=g["lr"],
        weight_decay=g["weight_decay"],
        lr_decay=g["lr_decay"],
        eps=g["eps"],
        maximize=g["maximize"],
    )


# class -> (state keys of a group, update, its eager (capturable) form works inside a CUDA graph)
_RULES: dict[type, tuple[Callable, Callable, bool]] = {
    torch.optim.SGD: (_sgd_keys, _sgd_update, True),
    torch.optim.Adam: (_adam_keys, _adam_update, True),
    torch.optim.AdamW: (_adam_keys, _adamw_update, True),
    torch.optim.RMSprop: (_rmsprop_keys, _rmsprop_update, True),
    torch.optim.Adagrad: (_adagrad_keys, _adagrad_update, False),  # reads `step` on the host
}
SUPPORTED_OPTIMIZERS = tuple(c.__name__ for c in _RULES)
"""The ``torch.optim`` classes the fused mode runs; any other optimizer runs stepwise."""

# The options of each class that its rule reads; an optimizer whose class has any other
# (a newer torch's) runs stepwise rather than silently without it.
_HANDLED = {
    torch.optim.SGD: {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"},
    torch.optim.Adam: {
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
        "maximize",
        "decoupled_weight_decay",
    },
    torch.optim.RMSprop: {"lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"},
    torch.optim.Adagrad: {
        "lr",
        "lr_decay",
        "weight_decay",
        "initial_accumulator_value",
        "eps",
        "maximize",
    },
}
_HANDLED[torch.optim.AdamW] = _HANDLED[torch.optim.Adam]

_IGNORED_GROUP_KEYS = ("params", "foreach", "fused", "capturable", "differentiable", "initial_lr")


def _hyper(group) -> dict:
    """A group's hyper-parameters as plain Python values (baked into the compiled program)."""
    out = {}
    for k, v in group.items():
        if k in _IGNORED_GROUP_KEYS:
            continue
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else tuple(v.tolist())
        elif isinstance(v, (list, tuple)):
            v = tuple(x.item() if isinstance(x, torch.Tensor) else x for x in v)
        out[k] = v
    return out


# --------------------------------------------------------------------------------------
# Optimizer state: snapshot / restore, used by the stepwise mode and after errors.


def _snapshot(opt, params) -> dict:
    snap = {}
    for p in params:
        if p in opt.state:
            snap[p] = {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                for k, v in opt.state[p].items()
            }
    return snap


def _restore(opt, params, snap) -> None:
    """Make ``opt.state`` of ``params`` equal ``snap``, in place where tensors line up."""
    for p in params:
        if p not in snap:
            if p in opt.state:
                del opt.state[p]
            continue
        cur = opt.state[p]
        for k in [k for k in cur if k not in snap[p]]:
            del cur[k]
        for k, v in snap[p].items():
            old = cur.get(k)
            if (
                isinstance(v, torch.Tensor)
                and isinstance(old, torch.Tensor)
                and old.shape == v.shape
                and old.dtype == v.dtype
                and old.device == v.device
            ):
                old.copy_(v)
            else:
                cur[k] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _needs_closure(optimizer) -> bool:
    """Whether ``optimizer.step`` must be given a closure (LBFGS re-evaluates the loss)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: call step() as usual
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _put_back(held) -> None:
    with torch.no_grad():
        for b, v in held:
            b.copy_(v)


def _host(loss: torch.Tensor) -> np.generic:
    """A loss as a NumPy scalar for the stepwise driver: float64 stays float64, any other
    float (float16 and bfloat16 too, exactly) is a float32, as in the fused trace."""
    return np.float64(loss.item()) if loss.dtype == torch.float64 else np.float32(loss.item())


def _batch_key(batch) -> tuple:
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


def _all_finite(tensors) -> bool:
    """Whether every float tensor is finite (a sparse one: its stored values)."""
    return all(
        bool(torch.isfinite(_values(t)).all())
        for t in tensors
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    )


def _values(t: torch.Tensor) -> torch.Tensor:
    if t.layout == torch.strided:
        return t
    return (
        t.coalesce().values() if t.is_sparse else t.values()
    )  # COO (nn.Embedding(sparse=True)), CSR ...


# --------------------------------------------------------------------------------------
# Finding the module(s) whose parameters the loss reads.


class _LossModule(nn.Module):
    """Holds the user's modules so `functional_call` can swap their parameters."""

    def __init__(self, loss_fn, modules: Sequence[nn.Module]):
        super().__init__()
        self.models = nn.ModuleList(modules)
        self.loss_fn = loss_fn

    def forward(self, *batch):
        return self.loss_fn(*batch)


def _find_modules(loss_fn) -> list[nn.Module]:
    """nn.Modules the loss function closes over or reads as globals."""
    found, seen = [], set()

    def add(v):
        if isinstance(v, nn.Module) and id(v) not in seen:
            seen.add(id(v))
            found.append(v)

    fn = getattr(loss_fn, "__func__", loss_fn)
    add(getattr(loss_fn, "__self__", None))
    add(loss_fn)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            add(cell.cell_contents)
        except ValueError:
            pass
    code = getattr(fn, "__code__", None)
    if code is not None:
        g = getattr(fn, "__globals__", {})
        for name in code.co_names:
            add(g.get(name))
    return found


def _interrupt_inside(error: BaseException) -> BaseException | None:
    """A KeyboardInterrupt (or other non-``Exception``) that torch wrapped, e.g. dynamo's
    ``BackendCompilerFailed`` around a Ctrl-C that landed during a compile."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if not isinstance(error, Exception):
            return error
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


def _cuda_graphs(chunk: Callable[[], None], dev, sizes: Sequence[int]) -> list:
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


class BatchError(ValueError, RuntimeError):
    """The batch does not fit ``loss_fn`` (torch's own error is its ``__cause__``).

    Raised on the first call with a new batch signature, before anything runs, when
    ``loss_fn(*batch)`` raises a ``RuntimeError`` (torch's shape / dtype / device
    errors), a ``ValueError`` (e.g. mismatched batch sizes) or an ``IndexError`` (a
    label out of range). A ``ValueError`` naming the argument, and still a
    ``RuntimeError`` so ``except RuntimeError`` around torch code keeps working.
    """


def _bad(exc, name, value, want, fix):
    raise exc(f"`{name}` must be {want}; got {value!r} ({type(value).__name__}). {fix}")


# --------------------------------------------------------------------------------------


def _make_body(wrapper, names, others, update, info, K, re, tol, P, capturable, n, i0, base, batch):
    """The loop body: ``K`` steps, each masked so a stop mid-chunk leaves the stepwise state.
    ``others``: names of the modules' parameters the optimizer does not hold, which enter
    the loss as constants (the optimizer never changes them)."""

    def loss_of(ps):
        held = {k: wrapper.get_parameter(k).detach() for k in others}
        return torch.func.functional_call(wrapper, {**held, **dict(zip(names, ps))}, tuple(batch))

    grad_and_loss = torch.func.grad_and_value(loss_of)

    def body(i, stop, applied, prev, last, losses, *carry):
        ps, ss = list(carry[:P]), list(carry[P:])
        for _ in range(K):
            active = (i < n) & (stop == 0)
            grads, loss = grad_and_loss(tuple(ps))
            loss = loss.detach()
            new_p = [p.clone() for p in ps]  # torch's update works in place: on copies
            new_s = [s.clone() for s in ss]
            j = 0
            for sl, keys, h in info:
                m = sl.stop - sl.start
                st = {}
                for k in keys:
                    st[k] = new_s[j : j + m]
                    if k == "step":
                        # Eager torch reads `step` as a Python float (double): do the
                        # bias-correction math in float64 too (the capturable rules on CUDA
                        # included; in float32 they drift ~2e-6 from eager Adam in 15 steps).
                        st[k] = [t.double() for t in st[k]]
                    j += m
                update(new_p[sl], list(grads[sl]), st, h, capturable)
                if "step" in st:
                    at = j - m * (len(keys) - list(keys).index("step"))
                    for q, t in enumerate(st["step"]):
                        new_s[at + q] = t.to(new_s[at + q].dtype)
            finite = torch.isfinite(loss)
            for t in list(grads) + new_p + [s for s in new_s if s.is_floating_point()]:
                finite = finite & torch.isfinite(t).all()
            ok = active & finite
            ps = [torch.where(ok, a, b) for a, b in zip(new_p, ps)]
            ss = [torch.where(ok, a, b) for a, b in zip(new_s, ss)]
            ic = i0 + i  # index of this step within the user's call
            rec = active & (ic % re == 0)
            slot = torch.where(rec, ic // re - base, losses.shape[0] - 1)
            losses = losses.index_copy(0, slot.reshape(1), loss.reshape(1).to(losses.dtype))
            code = torch.where(active & ~finite, 2, stop)
            if tol is not None:
                diff = (loss.double() - prev.double()).abs()
                code = torch.where(ok & (ic > 0) & (diff <= tol), 1, code)
            stop = code.to(stop.dtype)
            applied = applied + ok.to(applied.dtype)
            prev = torch.where(ok, loss.to(prev.dtype), prev)
            last = torch.where(ok, loss.to(last.dtype), last)
            i = i + 1
        return (i, stop, applied, prev, last, losses, *ps, *ss)

    return body


def _rng_states(cuda) -> list:
    """torch's random states: the CPU generator's and those of the given CUDA devices."""
    return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in cuda]


class FusedFit:
    """A fused fit: ``fit(*batch, steps=None)`` runs the optimizer steps, returns a `Trace`.

    Built by `fuse`. Parameters and ``optimizer.state`` are updated in place.

    Attributes:
      mode: ``"fused"`` or ``"stepwise"`` (the mode actually used: a fused fit that
        had to fall back reports ``"stepwise"`` and ``fallback_reason`` says why).
      compiles: how many programs were compiled so far (inductor compilations; on CUDA,
        one per build of the captured graphs). One compile serves every ``steps`` and
        every batch of the same shapes.
      step: updates applied since `fuse`.
    """

    def __init__(self, loss_fn, optimizer, opts: Options, model, chunk: int):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.opts = opts
        self.chunk = chunk
        self.step = 0
        self.compiles = 0
        self.fallback_reason: str | None = None
        self.mode = opts.mode
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._probed = set()
        self._loss_dtype = torch.float32
        self._program = None
        self._program_key = None
        self._captured: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._wrapper = None
        self._names: list[str] = []
        self._others: list[str] = []
        self._modules = [model] if model is not None else _find_modules(loss_fn)
        self._rule = _RULES.get(type(optimizer))
        self._needs_closure = _needs_closure(optimizer)
        if self.mode == "fused":
            reason = self._prepare_fused(model)
            if reason is not None:
                self._fall_back(reason)

    # -- setup ---------------------------------------------------------------------------

    def _fall_back(self, reason: str) -> None:
        self.mode, self.fallback_reason = "stepwise", reason
        warnings.warn(
            f"stepfuse.torch: running mode='stepwise' instead of 'fused': {reason}",
            RuntimeWarning,
            stacklevel=4,
        )

    def _prepare_fused(self, model) -> str | None:
        if self._rule is None:
            return (
                f"{type(self.optimizer).__name__} has no fused update rule here (supported: "
                f"{', '.join(SUPPORTED_OPTIMIZERS)})."
            )
        unhandled = sorted(
            set(self.optimizer.defaults) - _HANDLED[type(self.optimizer)] - set(_IGNORED_GROUP_KEYS)
        )
        if unhandled:
            return (
                f"the fused {type(self.optimizer).__name__} rule does not read its option(s) "
                f"{', '.join(unhandled)}."
            )
        names: dict[int, str] = {}
        wrapper = _LossModule(self.loss_fn, self._modules)
        for name, p in wrapper.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        missing = [i for i, p in enumerate(self._params) if id(p) not in names]
        if missing:
            where = (
                "do not belong to the `model` given"
                if model is not None
                else "belong to no nn.Module that `loss_fn` closes over"
            )
            return (
                f"{len(missing)} of the optimizer's parameters {where}; pass "
                "fuse(..., model=the_module) with the module that holds them all."
            )
        self._wrapper, self._names = wrapper, [names[id(p)] for p in self._params]
        held = {id(p) for p in self._params}
        self._others = [
            name
            for name, p in wrapper.named_parameters()  # one name per tensor
            if id(p) not in held and p.requires_grad
        ]
        return None

    # -- layout of the carried tensors -------------------------------------------------------

    def _layout(self):
        """[(group, slice of params, keys)] for the optimizer as it is now."""
        keys_of = self._rule[0]
        out, start = [], 0
        for g in self.optimizer.param_groups:
            n = len(g["params"])
            out.append((g, slice(start, start + n), keys_of(g)))
            start += n
        return out

    def _state_ready(self) -> bool:
        st = self.optimizer.state
        return all(
            k in st.get(p, {})
            for g, sl, keys in self._layout()
            for p in self._params[sl]
            for k in keys
        )

    def _state_tensors(self, placeholder: bool) -> list[torch.Tensor]:
        """The optimizer state flattened (group, key, param); zeros where not yet created."""
        out = []
        for _g, sl, keys in self._layout():
            for k in keys:
                for p in self._params[sl]:
                    v = self.optimizer.state[p].get(k) if p in self.optimizer.state else None
                    if v is None:
                        if not placeholder:
                            raise RuntimeError("optimizer state missing")
                        v = (
                            torch.tensor(0.0, dtype=_scalar_dtype())
                            if k == "step"
                            else torch.zeros_like(p, memory_format=torch.preserve_format)
                        )
                    out.append(v)
        return out

    def _write_back(self, params, states) -> None:
        with torch.no_grad():
            for p, v in zip(self._params, params):
                p.copy_(v)
            i = 0
            for _g, sl, keys in self._layout():
                for k in keys:
                    for p in self._params[sl]:
                        cur = self.optimizer.state[p]
                        if isinstance(cur.get(k), torch.Tensor):
                            cur[k].copy_(states[i])
                        else:
                            cur[k] = (
                                states[i].detach().to(p.device if k != "step" else "cpu").clone()
                            )
                        i += 1

    # -- compiled program (CPU and any device without CUDA graphs) -------------------------

    def _body_maker(self, capturable: bool):
        """``make(n, i0, base, batch) -> body`` over plain values (no optimizer access when traced)."""
        info = [(sl, keys, _hyper(g)) for g, sl, keys in self._layout()]
        args = (
            self._wrapper,
            tuple(self._names),
            tuple(self._others),
            self._rule[1],
            info,
            self.chunk,
            self.opts.record_every,
            self.opts.tol,
            len(self._params),
            capturable,
        )
        return lambda n, i0, base, batch: _make_body(*args, n, i0, base, batch)

    def _compile(self, fn, kind: str, inductor_options: dict[str, Any]):
        """``torch.compile`` of ``fn`` (whole graph, static shapes) with inductor, counting
        each compilation in `compiles`."""
        counter = self
        # One code object per fit, so dynamo's per-code cache never mixes fits.
        code = fn.__code__.replace(co_name=f"stepfuse_{kind}_{id(self):x}")
        fn = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)

        def backend(gm, example_inputs):
            from torch._inductor import config
            from torch._inductor.compile_fx import compile_fx

            counter.compiles += 1
            with config.patch(inductor_options):
                return compile_fx(gm, example_inputs)

        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)

    def _build_compiled(self):
        make = self._body_maker(capturable=False)

        def program(n, i0, base, prev, nslots, params, states, batch):
            from torch._higher_order_ops.while_loop import while_loop

            body = make(n, i0, base, batch)

            def zero(dtype):
                return torch.zeros((), dtype=dtype, device=prev.device)

            losses = torch.full((nslots + 1,), math.nan, dtype=prev.dtype, device=prev.device)
            carried = (
                zero(torch.int64),
                zero(torch.int32),
                zero(torch.int64),
                prev.clone(),
                prev.clone(),
                losses,
                *params,
                *states,
            )
            return while_loop(lambda i, stop, *rest: (i < n) & (stop == 0), body, carried)

        return self._compile(program, "program", _INDUCTOR_OPTIONS)

    def _run_compiled(self, n, i0, prev, params, states, batch):
        re = self.opts.record_every
        nslots = -(-self._cap // re) + 1
        dev = params[0].device
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        # Without autograd around it: parameters the optimizer does not hold may require grad,
        # and the loop must not be recorded for a backward (torch.func.grad still works inside).
        with torch.no_grad():
            return self._program(
                t(n), t(i0), t(-(-i0 // re)), prev, nslots, params, states, tuple(batch)
            )

    # -- CUDA graph (static buffers, a compiled chunk captured once, replayed) ------------

    def _build_cuda_graph(self, params, states, batch, prev):
        """Static buffers and two CUDA graphs of the chunk: one chunk, and ``_GRAPH_CHUNKS``
        chunks in a row (one replay = that many steps). The chunk is compiled by inductor
        (few fused kernels a step); where that fails, the eager chunk is captured instead
        (``fused_kernels`` says which)."""
        dev = params[0].device
        re = self.opts.record_every
        nslots = -(-self._cap // re) + 2
        i64 = lambda: torch.zeros((), dtype=torch.int64, device=dev)  # noqa: E731
        s = types.SimpleNamespace()
        s.n, s.i0, s.base = i64(), i64(), i64()
        s.batch = _pytree.tree_map(
            lambda b: b.detach().clone() if isinstance(b, torch.Tensor) else b, tuple(batch)
        )
        s.carry = [
            i64(),
            torch.zeros((), dtype=torch.int32, device=dev),
            i64(),
            prev.detach().clone(),
            prev.detach().clone(),
            torch.full((nslots,), math.nan, dtype=prev.dtype, device=dev),
            *[p.detach().clone() for p in params],
            *[v.detach().to(dev).clone() for v in states],
        ]
        s.state_cpu = [v.device.type == "cpu" for v in states]
        # torch's capturable update rules: `step` lives on the device (dynamo also refuses
        # to trace the non-capturable ones with CUDA steps).
        make = self._body_maker(capturable=True)

        def run_chunk(n, i0, base, batch, *carry):  # the chunk, updating the carry in place
            for dst, src in zip(carry, make(n, i0, base, batch)(*carry)):
                dst.copy_(src)

        args = (s.n, s.i0, s.base, s.batch, *s.carry)
        s.n.fill_(0)  # warm-up runs change nothing
        try:
            compiled = self._compile(run_chunk, "chunk", {})
            s.graphs = _cuda_graphs(lambda: compiled(*args), dev, (1, _GRAPH_CHUNKS))
            s.fused_kernels, s.compile_error = True, None
        except Exception as e:  # noqa: BLE001 - inductor cannot take this model: capture eagerly
            if _interrupt_inside(e) is not None or not self._rule[2]:
                raise
            s.graphs = _cuda_graphs(lambda: run_chunk(*args), dev, (1, _GRAPH_CHUNKS))
            s.fused_kernels, s.compile_error = False, f"{type(e).__name__}: {e}"[:2000]
            self.compiles += 1
        return s

    def _run_cuda_graph(self, n, i0, prev, params, states, batch):
        s, re = self._program, self.opts.record_every
        for dst, src in zip(
            _pytree.tree_leaves(s.batch), _pytree.tree_leaves(tuple(batch))
        ):  # nested ones too
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        P = len(params)
        for dst, src in zip(s.carry[6:], list(params) + list(states)):
            dst.copy_(src)
        s.n.fill_(n)
        s.i0.fill_(i0)
        s.base.fill_(-(-i0 // re))
        for k in (0, 1, 2):
            s.carry[k].zero_()
        s.carry[3].copy_(prev)
        s.carry[5].fill_(math.nan)
        one, many = s.graphs
        chunks = -(-n // self.chunk)
        for _ in range(chunks // _GRAPH_CHUNKS):
            many.replay()
        for _ in range(chunks % _GRAPH_CHUNKS):
            one.replay()
        out = list(s.carry)
        out[6 + P :] = [v.to("cpu") if cpu else v for v, cpu in zip(out[6 + P :], s.state_cpu)]
        return out

    # -- one call ----------------------------------------------------------------------------

    def _probe(self, batch) -> None:
        """Check ``loss_fn`` on this batch once per batch signature; changes nothing."""
        sig = tuple(
            (tuple(b.shape), b.dtype, b.device) if isinstance(b, torch.Tensor) else repr(b)
            for b in batch
        )
        if sig in self._probed:
            return
        try:
            signature = inspect.signature(self.loss_fn)
        except (TypeError, ValueError):  # builtins and some C callables have none
            signature = None
        if signature is not None:
            try:
                signature.bind(*batch)
            except TypeError as e:
                raise TypeError(
                    f"`batch` does not fit `loss_fn{signature}`: got {len(batch)} "
                    f"positional arguments ({e}). Call fit(*batch) with the arguments "
                    "of loss_fn (nothing was run or changed)."
                ) from None
        # The probe's forward must change nothing: BatchNorm's running statistics and the
        # random state (dropout) are put back as they were.
        saved = self._hold_buffers()
        cuda = sorted(
            {
                t.device.index or 0
                for t in (*self._params, *batch)
                if isinstance(t, torch.Tensor) and t.is_cuda
            }
        )
        try:
            with torch.random.fork_rng(devices=cuda):
                before = _rng_states(cuda)
                self._check_loss(batch)
                draws = any(not torch.equal(a, b) for a, b in zip(before, _rng_states(cuda)))
        finally:
            _put_back(saved)
        if draws and self.chunk > 1:
            # Each step of a chunk runs its forward pass, also the masked steps after the
            # call's last one: with random draws (dropout) those would advance the random
            # state past the plain loop's. One step a chunk draws exactly what the steps run.
            self.chunk = 1
        self._probed.add(sig)

    def _hold_buffers(self) -> list:
        """``(buffer, copy)`` for the modules' buffers (BatchNorm statistics ...), which a
        forward pass changes: the probe and a refused step put them back."""
        buffers = {id(b): b for m in self._modules for b in m.buffers()}
        return [(b, b.detach().clone()) for b in buffers.values()]

    def _check_loss(self, batch) -> None:
        """Run ``loss_fn`` on ``batch`` once and check what it returns (see `_probe`)."""
        with torch.enable_grad():
            try:
                loss = self.loss_fn(*batch)
            except (
                RuntimeError,
                ValueError,
                IndexError,
            ) as e:  # torch's shape / dtype / label errors
                shapes = ", ".join(
                    f"{tuple(b.shape)} {b.dtype}"
                    if isinstance(b, torch.Tensor)
                    else type(b).__name__
                    for b in batch
                )
                first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
                raise BatchError(
                    f"`batch` does not fit `loss_fn`: loss_fn(*batch) on arguments ({shapes}) raised "
                    f"{type(e).__name__}: {first.rstrip('.')}. Pass tensors of the shapes and dtypes the model "
                    "expects (nothing was run or changed)."
                ) from e
            fix = "Return one floating-point scalar computed from the model, e.g. F.cross_entropy(model(x), y)."
            if not isinstance(loss, torch.Tensor):
                _bad(TypeError, "loss_fn", loss, "a function returning a scalar tensor", fix)
            if loss.ndim != 0:
                _bad(
                    ValueError,
                    "loss_fn",
                    f"a tensor of shape {tuple(loss.shape)}",
                    "a function returning a scalar (0-dim) tensor",
                    fix + " Reduce it, e.g. .mean().",
                )
            if not loss.is_floating_point():
                _bad(
                    TypeError,
                    "loss_fn",
                    f"a tensor of dtype {loss.dtype}",
                    "a function returning a floating-point scalar",
                    fix,
                )
            if not loss.requires_grad:
                _bad(
                    ValueError,
                    "loss_fn",
                    "a loss that does not depend on the parameters",
                    "a function of the optimizer's parameters",
                    "Compute the loss from the model whose parameters the optimizer holds.",
                )
            grads = torch.autograd.grad(loss, self._params, allow_unused=True)
        self._loss_dtype = loss.dtype
        unused = sum(g is None for g in grads)
        if unused and self.mode == "fused":
            # The plain loop skips a parameter without a gradient (no weight decay, no
            # momentum); the fused program's gradients would be zeros, which is not the same.
            self._fall_back(
                f"loss_fn does not use {unused} of the optimizer's {len(grads)} "
                "parameters on this batch (torch.optim skips them, stepwise does too); "
                "pass mode='stepwise' to silence this warning."
            )

    def _ensure_program(self, batch) -> None:
        """Build (compile / capture) the fused program if needed; may fall back to stepwise.

        A program serves one set of hyper-parameters (they are compiled in) and one batch
        signature (shapes, dtypes, nesting): each new one builds its own program, and the
        last `_GRAPH_CACHE` of them are kept (a smaller last batch of an epoch does not
        recompile every epoch). A program of its own per signature, rather than dynamo's
        recompiles of one, never meets dynamo's recompile limit with varying shapes.
        """
        key = (self._hyper_key(), _batch_key(batch))
        if self._program is not None and self._program_key == key:
            return
        if key in self._captured:
            self._captured.move_to_end(key)
            self._program, self._program_key = self._captured[key], key
            return
        if self._program is not None and self._program_key[0] != key[0]:
            warnings.warn(
                "stepfuse.torch: the optimizer's hyper-parameters changed (an lr scheduler, a "
                "changed param_group): torch.optim's update rules read them as Python numbers, "
                "so they are compiled into the fused program, which is compiled again now. A "
                "schedule that changes them every call pays a compile every call; mode='stepwise' "
                "compiles nothing.",
                RuntimeWarning,
                stacklevel=3,
            )
        params = [p.detach() for p in self._params]
        states = self._state_tensors(placeholder=True)
        prev = torch.tensor(math.nan, dtype=self._loss_dtype, device=params[0].device)
        try:
            if self._cuda:
                self._program = self._build_cuda_graph(params, states, batch, prev)
            else:
                self._program = self._build_compiled()
                # n=0: compiles without running a step; nothing changes.
                self._run_compiled(0, 0, prev, params, states, batch)
        except Exception as e:  # noqa: BLE001 - any compile failure means: run stepwise
            self._program = None
            interrupt = _interrupt_inside(e)
            if interrupt is not None:  # Ctrl-C during the compile is the user's, not a failure
                raise interrupt from None
            inner = getattr(e, "inner_exception", None) or e
            lines = [ln for ln in str(inner).splitlines() if ln.strip()]
            self._fall_back(
                f"the fused program could not be built ({type(inner).__name__}: "
                f"{lines[0].strip() if lines else ''}); pass mode='stepwise' to "
                "silence this warning."
            )
            return
        self._program_key = key
        self._captured[key] = self._program
        while len(self._captured) > _GRAPH_CACHE:
            self._captured.popitem(last=False)

    def _hyper_key(self) -> tuple:
        """Every group's hyper-parameters (compiled into the fused program)."""
        return tuple(tuple(sorted(h.items())) for h in map(_hyper, self.optimizer.param_groups))

    @property
    def _cuda(self) -> bool:
        return torch.cuda.is_available() and self._params[0].is_cuda and self._rule is not None

    def __call__(self, *batch, steps=None) -> Trace:
        """Run ``steps`` (default: the ``steps`` given to `fuse`) updates on ``batch``.

        Args:
          *batch: the arguments of ``loss_fn`` (tensors), passed once for all steps.
          steps: updates of this call; any ``int >= 1`` reuses the same compiled program.

        Returns:
          The call's `stepfuse.Trace` (losses before each update, updates applied, stop).
        """
        n = check_call_steps(steps, self.opts, capped=False)
        self._check_params_unchanged()
        grads_before = [p.grad for p in self._params]
        snap = _snapshot(self.optimizer, self._params)
        before = [p.detach().clone() for p in self._params]
        if self.mode == "fused":
            reason = self._hooks()
            if reason is not None:
                self._fall_back(f"{reason}; pass mode='stepwise' to silence this warning.")
        self._probe(batch)
        start = self.step
        if self.mode == "fused":
            self._ensure_program(batch)
        try:
            if self.mode == "stepwise":
                trace = self._call_stepwise(batch, n, start)
            else:
                trace = self._call_fused(batch, n, start)
        except BaseException:
            if self.mode == "fused" and self.step == start:
                # nothing was applied: leave parameters and state exactly as they were
                with torch.no_grad():
                    for p, v in zip(self._params, before):
                        p.copy_(v)
                _restore(self.optimizer, self._params, snap)
            raise
        finally:
            for p, g in zip(self._params, grads_before):
                p.grad = g
        return finish(trace, self.opts, start)

    def _hooks(self) -> str | None:
        """Why the fused program would skip hooks the user registered, or None: it takes
        gradients with torch.func and calls the update rule itself, so step hooks, gradient
        hooks and module backward hooks would not run (the stepwise mode runs them)."""
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        opt = self.optimizer
        if (
            getattr(opt, "_optimizer_step_pre_hooks", None)
            or getattr(opt, "_optimizer_step_post_hooks", None)
            or getattr(optim_module, "_global_optimizer_pre_hooks", None)
            or getattr(optim_module, "_global_optimizer_post_hooks", None)
        ):
            return "the optimizer has step hooks (register_step_pre_hook / _post_hook), which only its step() runs"
        if any(
            getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)
            for p in self._params
        ):
            return (
                "a parameter has gradient hooks (register_hook / register_post_accumulate_grad_hook), "
                "which only loss.backward() runs"
            )
        if (
            getattr(nn_module, "_global_backward_hooks", None)
            or getattr(nn_module, "_global_backward_pre_hooks", None)
            or any(
                m._backward_hooks or m._backward_pre_hooks
                for top in self._modules
                for m in top.modules()
            )
        ):
            return "a module has backward hooks, which only loss.backward() runs"
        return None

    def _check_params_unchanged(self) -> None:
        """Refuse a call after the optimizer's parameters changed (``add_param_group``) or
        one was frozen (``requires_grad_(False)``) since `fuse`: the fit would still update
        the parameters it was built for."""
        now = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(now) != len(self._params) or any(a is not b for a, b in zip(now, self._params)):
            raise ValueError(
                f"`optimizer` holds other parameters than when the fit was built ({len(now)} "
                f"tensors now, {len(self._params)} then: add_param_group or a changed group?). "
                "Build a new fit with sf.fuse(loss_fn, optimizer, ...) (nothing was run or changed)."
            )
        frozen = [i for i, p in enumerate(self._params) if not p.requires_grad]
        if frozen:
            p = self._params[frozen[0]]
            raise ValueError(
                f"`optimizer` parameter {frozen[0]} (shape {tuple(p.shape)}) was set to "
                "requires_grad=False after the fit was built. Leave frozen parameters out of the "
                "optimizer and build a new fit (nothing was run or changed)."
            )

    # stepwise: the optimizer's own step(), eagerly -------------------------------------------

    def _loss_and_grads(self, batch) -> torch.Tensor:
        """The loss at the current parameters, their ``.grad`` set to its gradient."""
        with torch.enable_grad():
            for p in self._params:
                p.grad = None
            loss = self.loss_fn(*batch)
            loss.backward()
        return loss.detach()

    def _propose(self, batch):
        params, opt = self._params, self.optimizer
        held = self._hold_buffers()
        loss = self._loss_and_grads(batch)
        finite = bool(torch.isfinite(loss)) and _all_finite(p.grad for p in params)
        if not finite:  # refused: the buffers too stay as before the step
            _put_back(held)
            return _host(loss), False, None
        old_p = [p.detach().clone() for p in params]
        old_s = _snapshot(opt, params)

        def undo():  # parameters and state as before this step
            with torch.no_grad():
                for p, v in zip(params, old_p):
                    p.copy_(v)
            _restore(opt, params, old_s)

        try:
            if self._needs_closure:  # e.g. LBFGS, which re-evaluates the loss within its step
                opt.step(lambda: self._loss_and_grads(batch))
            else:
                opt.step()
        except BaseException:
            undo()
            raise
        new_p = [p.detach().clone() for p in params]
        new_s = _snapshot(opt, params)
        finite = _all_finite(new_p) and _all_finite(v for d in new_s.values() for v in d.values())
        undo()
        if not finite:
            _put_back(held)
        return _host(loss), finite, (new_p, new_s)

    def _commit(self, token) -> None:
        new_p, new_s = token
        with deferred_interrupts(), torch.no_grad():  # parameters, state and step move together
            for p, v in zip(self._params, new_p):
                p.copy_(v)
            _restore(self.optimizer, self._params, new_s)
            self.step += 1

    def _call_stepwise(self, batch, n, start) -> Trace:
        with Notifier(self.opts, start, n, "stepfuse.torch") as note:
            trace = run_stepwise(
                lambda: self._propose(batch),
                self._commit,
                n,
                self.opts,
                start,
                note if self.opts.notify else None,
            )
            note.done(trace.steps)
            return trace

    # fused: eager first step if the optimizer has no state yet, then program segments ------

    def _call_fused(self, batch, n, start) -> Trace:
        opts = self.opts
        re, every = opts.record_every, opts.every
        losses: list[np.ndarray] = []
        stop, i = Stop.STEPS, 0
        dev = self._params[0].device
        prev = torch.tensor(math.nan, dtype=self._loss_dtype, device=dev)
        with Notifier(opts, start, n, "stepfuse.torch") as note:
            notify = note if opts.notify else None
            if not self._state_ready():
                # torch creates the state lazily in step(); let it (exact init semantics).
                first = run_stepwise(
                    lambda: self._propose(batch),
                    self._commit,
                    1,
                    dataclasses.replace(opts, steps=1, tol=None, record_every=1),
                    start,
                    notify,
                )
                losses.append(first.loss)  # float64 or float32, as the stepwise driver records it
                i, stop = 1, first.stop
                if first.steps:
                    prev = torch.tensor(float(first.loss[0]), dtype=self._loss_dtype, device=dev)
            run = self._run_cuda_graph if self._cuda else self._run_compiled
            while i < n and stop == Stop.STEPS:
                seg = min(n - i, self._cap)
                if notify is not None:
                    seg = min(seg, every - self.step % every)
                params = [p.detach() for p in self._params]
                out = run(seg, i, prev, params, self._state_tensors(placeholder=False), batch)
                _, code, applied, prev, last, buf = out[:6]
                code, applied = int(code), int(applied)
                P = len(params)
                evaluated = applied + (1 if code == Stop.NONFINITE else 0)
                kept = n_recorded(i + evaluated, re) - n_recorded(i, re)
                # float64 stays float64, any other float (bfloat16 too) is recorded as float32
                wide = buf.dtype == torch.float64
                losses.append(
                    buf[:kept].detach().to("cpu", torch.float64 if wide else torch.float32).numpy()
                )
                with deferred_interrupts():  # parameters, state and step move together
                    self._write_back(out[6 : 6 + P], out[6 + P :])
                    self.step += applied
                i += evaluated
                stop = Stop(code)
                if notify is not None and applied and self.step % every == 0:
                    notify(self.step, float(last))
                    if i < n and self._program_key[0] != self._hyper_key():
                        # The callback changed a hyper-parameter (its lr ...): the rest of the
                        # call runs with it, as the stepwise loop would.
                        self._ensure_program(batch)
                        if self.mode != "fused":
                            raise RuntimeError(
                                f"stepfuse.torch: the callback set hyper-parameters the fused program "
                                f"could not be compiled with ({self.fallback_reason}); this call stopped "
                                f"after {self.step - start} applied updates (kept). Call again: the fit "
                                "now runs stepwise."
                            )
            note.done(self.step - start)
        loss = np.concatenate(losses) if losses else np.zeros(0, np.float32)
        return host_trace(loss, self.step - start, stop, re)

    @property
    def _cap(self) -> int:
        # Steps per program call: the loop carries its loss buffer, which the compiled
        # body copies each step, so longer calls run as several program calls.
        return min(self.opts.steps, _SEGMENT)

    def __repr__(self) -> str:
        return (
            f"FusedFit({type(self.optimizer).__name__}, steps={self.opts.steps}, "
            f"mode={self.mode!r}, compiles={self.compiles}, step={self.step})"
        )


def fuse(
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    model: nn.Module | None = None,
    tol: float | None = None,
    record_every: int = 1,
    callback: Callable[[int, float], Any] | None = None,
    every: int | None = None,
    progress: bool = False,
    on_nonfinite: str = "stop",
    mode: str = "fused",
    chunk: int = _DEFAULT_CHUNK,
) -> FusedFit:
    """Build a fused fit that runs ``steps`` ``torch.optim`` updates per call.

        Args:
          loss_fn: ``loss_fn(*batch) -> scalar tensor``; it uses the model (e.g. a closure).
          optimizer: a ``torch.optim.Optimizer`` over the model's parameters. The fused mode
            runs SGD, Adam, AdamW, RMSprop and Adagrad with torch's own update functions;
            others run stepwise.
          model: the ``nn.Module`` holding the parameters; found automatically when
            ``loss_fn`` closes over it (or reads it as a global).
    {opts}
          chunk: steps per iteration of the compiled loop, i.e. copies of the step in the
            compiled program (fixed, whatever ``steps`` is). Compile time grows with it and
            per-step overhead shrinks: on the seed problem on CPU, ``chunk=1`` (a single copy)
            ran at 15.1 us/step and compiled in 9.7 s, ``chunk=4`` at 9.8 us/step in 4.2 s
            (warm compile cache). On an H200, ``chunk=8`` ran the seed as fast as
            ``chunk=4`` (12.4 against 12.7 us/step), since the CUDA graphs replay many
            chunks at once. A ``loss_fn`` that draws random numbers (dropout) runs with
            ``chunk=1``: every step of a chunk runs its forward pass, so the masked steps
            after a call's last one would draw masks the plain loop never draws. Default {chunk}.

        Returns:
          A `FusedFit`; ``trace = fit(*batch, steps=None)``.

        Example:
          >>> model = torch.nn.Linear(2, 2)
          >>> def loss_fn(x, y):
          ...     return torch.nn.functional.cross_entropy(model(x), y)
          >>> fit = fuse(loss_fn, torch.optim.SGD(model.parameters(), lr=0.01), steps=3)
          >>> trace = fit(x, y)            # 3 updates, one compiled call
    """
    opts = check_options(
        steps, tol, record_every, callback, every, progress, on_nonfinite, mode, modes=_MODES
    )
    if not callable(loss_fn):
        _bad(
            TypeError,
            "loss_fn",
            loss_fn,
            "callable as loss_fn(*batch) -> scalar tensor",
            "Pass a function such as lambda x, y: F.cross_entropy(model(x), y).",
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        _bad(
            TypeError,
            "optimizer",
            optimizer,
            "a torch.optim.Optimizer",
            "Build one over the model's parameters, e.g. torch.optim.SGD(model.parameters(), lr=0.01) "
            "(optax / keras optimizers belong to stepfuse.jax / stepfuse.tf).",
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        _bad(
            ValueError,
            "optimizer",
            optimizer,
            "an optimizer with parameters",
            "Pass model.parameters() to the optimizer.",
        )
    for p in params:
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            _bad(
                TypeError,
                "optimizer",
                f"a parameter of dtype {getattr(p, 'dtype', type(p))}",
                "an optimizer over floating-point parameters",
                "Use float parameters (e.g. torch.float32); integer tensors cannot be trained.",
            )
        if not p.requires_grad:
            _bad(
                ValueError,
                "optimizer",
                f"a parameter of shape {tuple(p.shape)} with requires_grad=False",
                "an optimizer over parameters that require grad",
                "Set p.requires_grad_(True) or leave frozen parameters out of the optimizer.",
            )
    if model is not None and not isinstance(model, nn.Module):
        _bad(
            TypeError,
            "model",
            model,
            "a torch.nn.Module or None",
            "Pass the module whose parameters the optimizer holds, or omit `model`.",
        )
    chunk = check_int(chunk, "chunk", "Pass the steps per compiled loop iteration, e.g. chunk=4.")
    return FusedFit(loss_fn, optimizer, opts, model, chunk)


fuse.__doc__ = fuse.__doc__.format(
    opts=OPTIONS_DOC.replace("\n    ", "\n      ").replace("    steps", "      steps", 1),
    chunk=_DEFAULT_CHUNK,
)
