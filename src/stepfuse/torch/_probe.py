"""Probing what the fused mode can run: the loss function on a batch, the modules whose
parameters it reads, hooks only eager PyTorch runs, and why a fit falls back to stepwise.

Everything here runs before a call changes anything; a check that fails either raises an
argument error (the batch or ``loss_fn`` is wrong for any mode) or returns the reason
the fit runs stepwise instead (the fused program would not be the plain loop).
"""

from __future__ import annotations

import concurrent.futures
import inspect
import subprocess
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from .._core import fail
from ._rules import HANDLED, IGNORED_GROUP_KEYS, SUPPORTED_OPTIMIZERS, Rule
from ._state import put_back

__all__ = [
    "BatchError",
    "Probed",
    "Resolved",
    "build_failure",
    "find_modules",
    "hold_buffers",
    "hooks_reason",
    "interrupt_inside",
    "needs_closure",
    "probe_loss",
    "resolve",
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
    """nn.Modules the loss function closes over or reads as globals."""
    found: list[nn.Module] = []
    seen: set[int] = set()

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


class Resolved(NamedTuple):
    """The module wrapper the fused program calls, and the names of its parameters:
    ``names`` of the optimizer's, ``others`` those it does not hold (constants)."""

    wrapper: nn.Module
    names: list[str]
    others: list[str]


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
        return (
            f"{type(optimizer).__name__} has no fused update rule here (supported: "
            f"{', '.join(SUPPORTED_OPTIMIZERS)})."
        )
    unhandled = sorted(set(optimizer.defaults) - HANDLED[type(optimizer)] - set(IGNORED_GROUP_KEYS))
    if unhandled:
        return (
            f"the fused {type(optimizer).__name__} rule does not read its option(s) "
            f"{', '.join(unhandled)}."
        )
    names: dict[int, str] = {}
    wrapper = _LossModule(loss_fn, modules)
    for name, p in wrapper.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        where = (
            "do not belong to the `model` given"
            if model_given
            else "belong to no nn.Module that `loss_fn` closes over"
        )
        return (
            f"{len(missing)} of the optimizer's parameters {where}; pass "
            "fuse(..., model=the_module) with the module that holds them all."
        )
    held = {id(p) for p in params}
    others = [
        name
        for name, p in wrapper.named_parameters()  # one name per tensor
        if id(p) not in held and p.requires_grad
    ]
    return Resolved(wrapper, [names[id(p)] for p in params], others)


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


def build_failure(error: Exception) -> str:
    """The fallback reason for a fused program that could not be built: the whole error,
    its chain of causes included (torch wraps inductor's in dynamo's), never just its
    first line, so a failure that is not the model's (a full disk, a compiler killed by
    the OS) can be told from one that is."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    cause = getattr(error, "inner_exception", None) or error.__cause__
    seen = {id(error)}
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        inner = "".join(traceback.format_exception_only(type(cause), cause)).strip()
        if inner not in text:
            text += f"\n  caused by {inner}"
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    return f"the fused program could not be built: {text}\n(pass mode='stepwise' to silence this warning)"


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


def hold_buffers(modules: Sequence[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(buffer, copy)`` for the modules' buffers (BatchNorm statistics ...), which a
    forward pass changes: the probe and a refused step put them back."""
    buffers = {id(b): b for m in modules for b in m.buffers()}
    return [(b, b.detach().clone()) for b in buffers.values()]


def _rng_states(cuda: Sequence[int]) -> list[torch.Tensor]:
    """torch's random states: the CPU generator's and those of the given CUDA devices."""
    return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in cuda]


class Probed(NamedTuple):
    """What one forward and backward of ``loss_fn`` on a batch showed."""

    dtype: torch.dtype
    """The loss's dtype."""
    unused: int
    """Optimizer parameters without a gradient on this batch."""
    draws: bool
    """Whether the forward drew random numbers (dropout)."""


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
            raise TypeError(
                f"`batch` does not fit `loss_fn{signature}`: got {len(batch)} "
                f"positional arguments ({e}). Call fit(*batch) with the arguments "
                "of loss_fn (nothing was run or changed)."
            ) from None
    # The probe's forward must change nothing: BatchNorm's running statistics and the
    # random state (dropout) are put back as they were.
    saved = hold_buffers(modules)
    cuda = sorted(
        {
            t.device.index or 0
            for t in (*params, *batch)
            if isinstance(t, torch.Tensor) and t.is_cuda
        }
    )
    try:
        with torch.random.fork_rng(devices=cuda):
            before = _rng_states(cuda)
            dtype, unused = _check_loss(loss_fn, params, batch)
            draws = any(not torch.equal(a, b) for a, b in zip(before, _rng_states(cuda)))
    finally:
        put_back(saved)
    return Probed(dtype, unused, draws)


def _check_loss(
    loss_fn: Callable[..., Any], params: Sequence[torch.Tensor], batch: tuple
) -> tuple[torch.dtype, int]:
    """``(loss dtype, parameters without a gradient)`` of one forward and backward."""
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
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
            raise BatchError(
                f"`batch` does not fit `loss_fn`: loss_fn(*batch) on arguments ({shapes}) raised "
                f"{type(e).__name__}: {first.rstrip('.')}. Pass tensors of the shapes and dtypes the model "
                "expects (nothing was run or changed)."
            ) from e
        fix = "Return one floating-point scalar computed from the model, e.g. F.cross_entropy(model(x), y)."
        if not isinstance(loss, torch.Tensor):
            fail(TypeError, "loss_fn", loss, "a function returning a scalar tensor", fix)
        if loss.ndim != 0:
            fail(
                ValueError,
                "loss_fn",
                f"a tensor of shape {tuple(loss.shape)}",
                "a function returning a scalar (0-dim) tensor",
                fix + " Reduce it, e.g. .mean().",
            )
        if not loss.is_floating_point():
            fail(
                TypeError,
                "loss_fn",
                f"a tensor of dtype {loss.dtype}",
                "a function returning a floating-point scalar",
                fix,
            )
        if not loss.requires_grad:
            fail(
                ValueError,
                "loss_fn",
                "a loss that does not depend on the parameters",
                "a function of the optimizer's parameters",
                "Compute the loss from the model whose parameters the optimizer holds.",
            )
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.dtype, sum(g is None for g in grads)


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
