"""Probing what the fused mode can run: the loss function on a batch, the modules whose
parameters it reads, hooks only eager PyTorch runs, and why a fit falls back to stepwise.

Everything here runs before a call changes anything; a check that fails either raises an
argument error (the batch or ``loss_fn`` is wrong for any mode) or returns the reason
the fit runs stepwise instead (the fused program would not be the plain loop).
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import math
import numbers
import subprocess
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .._core import Described, fail
from ._changes import Resolved, bind, compiled_module_reason, watched
from ._rules import HANDLED, IGNORED_GROUP_KEYS, SUPPORTED_OPTIMIZERS, Rule, refusal
from ._state import Held, put_back

__all__ = [
    "BatchError",
    "batch_signature",
    "Probed",
    "Resolved",
    "Trainable",
    "check_clip",
    "check_arguments",
    "check_params_unchanged",
    "cuda_devices",
    "find_modules",
    "hold_buffers",
    "hooks_reason",
    "interrupt_inside",
    "needs_closure",
    "probe_loss",
    "resolve",
    "GENERATORS",
    "KeptGenerators",
    "UNUSED",
    "rng_states",
    "set_rng_states",
    "transient",
]


class BatchError(ValueError, RuntimeError):
    """The batch does not fit ``loss_fn`` (torch's own error is its ``__cause__``).

    Raised on the first call with a new batch signature, before anything runs, when
    ``loss_fn(*batch)`` raises a ``RuntimeError`` (torch's shape / dtype / device
    errors), a ``ValueError`` (e.g. mismatched batch sizes) or an ``IndexError`` (a
    label out of range). A ``ValueError`` naming the argument, and still a
    ``RuntimeError`` so ``except RuntimeError`` around torch code keeps working.
    """


class _LossModule(nn.Module):
    """Holds the user's modules so `functional_call` can swap their parameters."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], modules: Sequence[nn.Module]):
        super().__init__()
        self.models = nn.ModuleList(modules)
        self.loss_fn = loss_fn

    def forward(self, *batch: Any) -> torch.Tensor:
        return self.loss_fn(*batch)


def find_modules(loss_fn: Callable[..., Any]) -> list[nn.Module]:
    """nn.Modules the loss function closes over, reads as globals, takes as default
    arguments (``lambda x, y, m=model: ...``) or is a ``functools.partial`` of."""
    found: list[nn.Module] = []
    seen: set[int] = set()

    def add(v):
        if isinstance(v, nn.Module) and id(v) not in seen:
            seen.add(id(v))
            found.append(v)

    if isinstance(loss_fn, functools.partial):
        for v in (*loss_fn.args, *loss_fn.keywords.values()):
            add(v)
        for m in find_modules(loss_fn.func):
            add(m)
    fn = getattr(loss_fn, "__func__", loss_fn)
    add(getattr(loss_fn, "__self__", None))
    add(loss_fn)
    for v in (
        *(getattr(fn, "__defaults__", None) or ()),
        *(getattr(fn, "__kwdefaults__", None) or {}).values(),
    ):
        add(v)
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


def resolve(
    loss_fn: Callable[..., Any],
    optimizer: torch.optim.Optimizer,
    rule: Rule | None,
    modules: Sequence[nn.Module],
    params: Sequence[torch.Tensor],
    model_given: bool,
) -> Resolved | str:
    """What the fused program needs to run ``optimizer``, or why it cannot (a reason)."""
    if rule is None:
        return refusal(optimizer) or (
            f"{type(optimizer).__name__} has no fused update rule here (supported: "
            f"{', '.join(SUPPORTED_OPTIMIZERS)})."
        )
    if rule.cpu_only and any(p.device.type != "cpu" for p in params):
        return rule.cpu_only
    unhandled = sorted(set(optimizer.defaults) - HANDLED[type(optimizer)] - set(IGNORED_GROUP_KEYS))
    if unhandled:
        return (
            f"the fused {type(optimizer).__name__} rule does not read its option(s) "
            f"{', '.join(unhandled)}."
        )
    compiled = compiled_module_reason(modules)
    if compiled is not None:
        return compiled
    if len({id(p) for p in params}) < len(params):
        return (
            "the optimizer holds a parameter twice (a tied weight listed under both names, "
            "or a group that repeats it), which torch.optim steps twice a step and the fused "
            "program cannot carry; the stepwise loop steps it as torch does. List it once "
            "(model.parameters() does) to run fused."
        )
    got = bind(_LossModule(loss_fn, modules), params)
    if isinstance(got, list):
        if model_given:
            return (
                f"{len(got)} of the optimizer's parameters do not belong to the `model` "
                "given; pass fuse(..., model=the_module) with the module that holds them all."
            )
        return (
            f"{len(got)} of the optimizer's parameters belong to no nn.Module that `loss_fn` "
            "closes over: the fused program swaps parameters inside modules, so bare tensors "
            "are out of its reach. Hold them in a module and read them from it in loss_fn "
            "(m = torch.nn.Module(); m.w = torch.nn.Parameter(w0); loss_fn using m.w), or "
            "pass fuse(..., model=the_module) where loss_fn reaches it another way."
        )
    return got


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` must be given a closure (LBFGS re-evaluates the loss)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: call step() as usual
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def interrupt_inside(error: BaseException | None) -> BaseException | None:
    """A KeyboardInterrupt (or other non-``Exception``) that torch wrapped, e.g. dynamo's
    ``BackendCompilerFailed`` around a Ctrl-C that landed during a compile."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if not isinstance(error, Exception):
            return error
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


def hooks_reason(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    modules: Sequence[nn.Module],
) -> str | None:
    """Why the fused program would skip hooks the user registered, or None: it takes
    gradients with torch.func and calls the update rule itself, so step hooks, gradient
    hooks and module backward hooks would not run (the stepwise mode runs them)."""
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    if (
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(optim_module, "_global_optimizer_pre_hooks", None)
        or getattr(optim_module, "_global_optimizer_post_hooks", None)
    ):
        return "the optimizer has step hooks (register_step_pre_hook / _post_hook), which only its step() runs"
    if any(
        getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)
        for p in params
    ):
        return (
            "a parameter has gradient hooks (register_hook / register_post_accumulate_grad_hook), "
            "which only loss.backward() runs"
        )
    if (
        getattr(nn_module, "_global_backward_hooks", None)
        or getattr(nn_module, "_global_backward_pre_hooks", None)
        or any(m._backward_hooks or m._backward_pre_hooks for top in modules for m in top.modules())
    ):
        return "a module has backward hooks, which only loss.backward() runs"
    return None


def hold_buffers(modules: Sequence[nn.Module]) -> Held:
    """``(buffer, copy)`` for the modules' buffers (BatchNorm statistics ...), which a
    forward pass changes: the probe and a refused step put them back (`Held`)."""
    buffers = {id(b): b for m in modules for b in m.buffers()}
    held = Held((b, b.detach().clone()) for b in buffers.values())
    for sub, names in watched(modules):  # each submodule and its Python number attributes
        numbers = {k: sub.__dict__[k] for k in names}
        held.modules.append((sub, dict(sub._buffers), numbers))
    return held


def rng_states(cuda: Sequence[int]) -> list[torch.Tensor]:
    """torch's random states: the CPU generator's and those of the given CUDA devices."""
    return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in cuda]


def set_rng_states(cuda: Sequence[int], states: Sequence[torch.Tensor]) -> None:
    """Set the random states `rng_states` read."""
    torch.set_rng_state(states[0])
    for d, st in zip(cuda, states[1:]):
        torch.cuda.set_rng_state(st, d)


def cuda_devices(tensors: Sequence[Any]) -> list[int]:
    """The CUDA devices of the tensors among ``tensors``."""
    return sorted(
        {t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}
    )


# Fallback reasons a probe gives (`Probed`).
UNUSED = "loss_fn uses none of the optimizer's parameters on this batch."
GENERATORS = (
    "loss_fn draws from a torch.Generator it holds (e.g. torch.randn(..., generator=g)), "
    "which a compiled program cannot draw from (dynamo refuses Generator objects). The steps "
    "run eagerly and draw what the plain loop draws; draws from torch's own generator "
    "(torch.manual_seed) run fused."
)


class KeptGenerators(TorchFunctionMode):
    """Within it, each ``torch.Generator`` a torch function is given (``torch.randn(...,
    generator=g)``) gets its state back on exit: the fit's own eager forward passes (the
    probe, the plan's count) draw nothing from a user's generator, as they draw nothing
    from torch's own (``fork_rng``). ``found``: whether any was given. A function mode
    (not a dispatch mode): it changes no kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    @property
    def found(self) -> bool:
        return bool(self.saved)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Generator) and id(v) not in self.saved:
                self.saved[id(v)] = (v, v.get_state())
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            for g, state in self.saved.values():
                g.set_state(state)


class _RandomOps(TorchDispatchMode):
    """Records the random ops (torch's ``nondeterministic_seeded`` tag) a forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and str(func) not in self.ops:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def batch_signature(batch: tuple) -> tuple:
    """What a probe of ``loss_fn`` on ``batch`` holds for (shapes, dtypes, devices)."""
    return tuple(
        (tuple(b.shape), b.dtype, b.device) if isinstance(b, torch.Tensor) else repr(b)
        for b in batch
    )


class Probed(NamedTuple):
    """What one forward and backward of ``loss_fn`` on a batch showed."""

    dtype: torch.dtype
    """The loss's dtype."""
    unused: tuple[bool, ...]
    """Per parameter probed: whether it has no gradient on this batch."""
    draws: bool
    """Whether the forward drew random numbers (dropout)."""
    random_ops: tuple[str, ...] = ()
    """The random aten ops it ran (names, for a fallback reason)."""
    generators: bool = False
    """Whether it drew from a ``torch.Generator`` it was given (`KeptGenerators`)."""


def probe_loss(
    loss_fn: Callable[..., Any],
    params: Sequence[torch.Tensor],
    modules: Sequence[nn.Module],
    batch: tuple,
) -> Probed:
    """Run ``loss_fn(*batch)`` once and check what it returns; changes nothing.

    Raises a TypeError when ``batch`` does not fit ``loss_fn``'s signature, a
    `BatchError` when ``loss_fn`` raises torch's shape / dtype / label errors on it, and
    the argument error of ``loss_fn`` when it does not return a float scalar of the
    parameters."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some C callables have none
        signature = None
    if signature is not None:
        try:
            signature.bind(*batch)
        except TypeError as e:
            loader = any(isinstance(b, torch.utils.data.DataLoader) for b in batch)
            raise TypeError(
                f"`batch` does not fit `loss_fn{signature}`: got {len(batch)} "
                f"positional arguments ({e}). Call fit(*batch) with the arguments "
                "of loss_fn (nothing was run or changed)."
                + (
                    " For a DataLoader's batches: fit(stepfuse.Batches.from_iterable(loader, n))."
                    if loader
                    else ""
                )
            ) from None
    # The probe's forward must change nothing: BatchNorm's running statistics and the
    # random state (dropout) are put back as they were.
    saved = hold_buffers(modules)
    cuda = cuda_devices([*params, *batch])
    try:
        with torch.random.fork_rng(devices=cuda), KeptGenerators() as kept:
            before = rng_states(cuda)
            dtype, unused = _check_loss(loss_fn, params, batch)
            draws = any(not torch.equal(a, b) for a, b in zip(before, rng_states(cuda)))
        ops: tuple[str, ...] = ()
        if draws:  # again, to name the random ops (a dispatch mode can change kernels)
            put_back(saved)
            with torch.random.fork_rng(devices=cuda), KeptGenerators(), _RandomOps() as rec:
                _check_loss(loss_fn, params, batch)
            ops = tuple(rec.ops)
    finally:
        put_back(saved)
    return Probed(dtype, unused, draws, ops, kept.found)


def _check_loss(
    loss_fn: Callable[..., Any], params: Sequence[torch.Tensor], batch: tuple
) -> tuple[torch.dtype, tuple[bool, ...]]:
    """``(loss dtype, per parameter: no gradient)`` of one forward and backward."""
    with torch.enable_grad():
        try:
            loss = loss_fn(*batch)
        except (
            RuntimeError,
            ValueError,
            IndexError,
        ) as e:  # torch's shape / dtype / label errors
            shapes = ", ".join(
                f"{tuple(b.shape)} {b.dtype}" if isinstance(b, torch.Tensor) else type(b).__name__
                for b in batch
            )
            # torch's whole message: its cause is often on a later line
            first = " / ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
            raise BatchError(
                f"`batch` does not fit `loss_fn`: loss_fn(*batch) on arguments ({shapes}) raised "
                f"{type(e).__name__}: {first.rstrip('.')}. Pass tensors of the shapes and dtypes the model "
                "expects (nothing was run or changed)."
            ) from e
        except TypeError as e:  # e.g. a NumPy array or a list where torch wants a tensor
            foreign = [
                f"{k} ({type(b).__module__}.{type(b).__name__})"
                for k, b in enumerate(batch)
                if isinstance(b, (list, tuple)) or type(b).__module__.split(".")[0] == "numpy"
            ]
            if not foreign:
                raise
            first = " / ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
            raise TypeError(
                f"`batch` does not fit `loss_fn`: loss_fn(*batch) raised TypeError: "
                f"{first.rstrip('.')}. Argument(s) {', '.join(foreign)} are no torch tensors: "
                "pass torch.as_tensor(...) on the model's device (nothing was run or changed)."
            ) from e
        fix = "Return one floating-point scalar computed from the model, e.g. F.cross_entropy(model(x), y)."
        if not isinstance(loss, torch.Tensor):
            fail(TypeError, "loss_fn", loss, "a function returning a scalar tensor", fix)
        if loss.ndim != 0:
            fail(
                ValueError,
                "loss_fn",
                Described(f"a loss of shape {tuple(loss.shape)}", loss),
                "a function returning a scalar (0-dim) tensor",
                fix + " Reduce it, e.g. .mean().",
            )
        if not loss.is_floating_point():
            fail(
                TypeError,
                "loss_fn",
                Described(f"a loss of dtype {loss.dtype}", loss),
                "a function returning a floating-point scalar",
                fix,
            )
        if not loss.requires_grad:
            fail(
                ValueError,
                "loss_fn",
                Described("a loss that does not depend on the parameters", loss),
                "a function of the optimizer's parameters",
                "Compute the loss from the model whose parameters the optimizer holds.",
            )
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.dtype, tuple(g is None for g in grads)


def transient(error: BaseException | None) -> bool:
    """Whether a failed build failed for a reason outside the model, which a second try
    may not meet: an OS error in the chain (inductor's cache lock timing out while other
    processes compile, a full disk, a broken pipe to a compile worker), a compile worker
    pool that broke, a compiler killed by a signal, memory."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (OSError, MemoryError, concurrent.futures.BrokenExecutor)):
            return True
        if isinstance(error, subprocess.CalledProcessError) and error.returncode < 0:
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False


class Trainable:
    """The optimizer as the fused program updates it: each group with only its parameters
    that require grad and are not in ``unused`` (ids of those the batch's loss leaves
    without a gradient). torch.optim skips a parameter without a gradient (no update, no
    state, no weight decay); the program leaves it out (a constant of the loss)."""

    def __init__(self, optimizer: torch.optim.Optimizer, unused: frozenset[int] = frozenset()):
        self.optimizer, self.unused = optimizer, unused

    def __getattr__(self, name: str) -> Any:  # anything else: the optimizer's own
        return getattr(self.optimizer, name)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [
            {
                **g,
                "params": [p for p in g["params"] if p.requires_grad and id(p) not in self.unused],
            }
            for g in self.optimizer.param_groups
        ]


def check_arguments(loss_fn: Any, optimizer: Any, model: Any) -> None:
    """`fuse`'s checks of ``loss_fn``, ``model`` and ``optimizer``: a torch optimizer over
    float parameters, some of which require grad (frozen ones are skipped as torch.optim
    skips them)."""
    if not callable(loss_fn):
        fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "callable as loss_fn(*batch) -> scalar tensor",
            "Pass a function such as lambda x, y: F.cross_entropy(model(x), y).",
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        fail(
            TypeError,
            "optimizer",
            optimizer,
            "a torch.optim.Optimizer",
            "Build one over the model's parameters, e.g. torch.optim.SGD(model.parameters(), lr=0.01) "
            "(optax / keras optimizers belong to stepfuse.jax / stepfuse.tf).",
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        fail(
            ValueError,
            "optimizer",
            optimizer,
            "an optimizer with parameters",
            "Pass model.parameters() to the optimizer.",
        )
    for p in params:
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            fail(
                TypeError,
                "optimizer",
                Described(
                    f"one with a parameter of dtype {getattr(p, 'dtype', type(p))}", optimizer
                ),
                "an optimizer over floating-point parameters",
                "Use float parameters (e.g. torch.float32); integer tensors cannot be trained.",
            )
    if not any(p.requires_grad for p in params):
        fail(
            ValueError,
            "optimizer",
            Described(
                f"one whose {len(params)} parameters all have requires_grad=False", optimizer
            ),
            "an optimizer over at least one parameter that requires grad",
            "Unfreeze the parameters to train (p.requires_grad_(True)).",
        )
    if model is not None and not isinstance(model, nn.Module):
        fail(
            TypeError,
            "model",
            model,
            "a torch.nn.Module or None",
            "Pass the module whose parameters the optimizer holds, or omit `model`.",
        )


def check_clip(value: Any, name: str) -> float | None:
    """``clip_grad_norm`` / ``clip_grad_value``: a float > 0 or None."""
    if value is None:
        return None
    fix = f"Pass a positive number such as {name}=1.0, or {name}=None not to clip."
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        fail(TypeError, name, value, "a float > 0 or None", fix)
    if not (math.isfinite(float(value)) and float(value) > 0):
        fail(ValueError, name, value, "a finite float > 0 or None", fix)
    return float(value)


def check_params_unchanged(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> None:
    """Refuse a call after the optimizer's parameters changed (``add_param_group``) since
    `fuse`: the fit would still update the parameters it was built for. Freezing or
    unfreezing one is no change: each call reads which require grad."""
    now = [p for g in optimizer.param_groups for p in g["params"]]
    if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
        raise ValueError(
            f"`optimizer` holds other parameters than when the fit was built ({len(now)} "
            f"tensors now, {len(params)} then: add_param_group or a changed group?). "
            "Build a new fit with sf.fuse(loss_fn, optimizer, ...) (nothing was run or changed)."
        )
    if not any(p.requires_grad for p in params):
        raise ValueError(
            "`optimizer` has no parameter that requires grad any more (all were set to "
            "requires_grad=False after the fit was built); unfreeze some to train "
            "(nothing was run or changed)."
        )
