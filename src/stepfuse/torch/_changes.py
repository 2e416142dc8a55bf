"""What a user changes while a torch fit lives: between calls (a parameter replaced in its
module) and during one (a callback that switches a module to eval mode, freezes a
parameter or sets a hyper-parameter), and what the fit does about each."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .._core import user_stacklevel

__all__ = [
    "check_modules_unchanged",
    "compiled_module_reason",
    "module_numbers",
    "numbers_changed",
    "rekey_after_callback",
    "watched",
]

_NUMBERS = (int, float, bool)


def watched(modules: Any) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """Each submodule of ``modules`` with the names of its attributes that are Python
    numbers (``training``, Dropout's ``p``, BatchNorm's ``momentum`` ...), found once:
    a program is traced with their values (`module_numbers`)."""
    subs = {id(m): m for top in modules for m in top.modules()}.values()
    return [(m, tuple(k for k, v in vars(m).items() if type(v) in _NUMBERS)) for m in subs]


def module_numbers(subs: Any) -> tuple:
    """The values of the `watched` attributes now: part of a program's key, so a change
    (``model.eval()``, ``dropout.p = 0.5``) builds the program for it."""
    return tuple(tuple(m.__dict__.get(k) for k in names) for m, names in subs)


def changes(subs: Any, before: tuple, now: tuple, skip: tuple[str, ...] = ()) -> list[str]:
    """The `watched` attributes whose values differ between two `module_numbers` readings
    (``"Dropout.p: 0.1 -> 0.5"``), those named in ``skip`` left out."""
    return [
        f"{type(m).__name__}.{k}: {a!r} -> {b!r}"
        for (m, names), old, new in zip(subs, before, now)
        for k, a, b in zip(names, old, new)
        if a != b and k not in skip
    ]


def numbers_changed(subs: Any, before: tuple, now: tuple) -> None:
    """Warn where a program is compiled again because a module's number attribute other
    than ``training`` changed (a train/eval switch is expected to)."""
    changed = changes(subs, before, now, skip=("training",))
    if changed:
        warnings.warn(
            f"stepfuse.torch: module attributes that are Python numbers changed "
            f"({'; '.join(changed[:4])}): forward reads them as constants, so they are "
            "compiled into the fused program, which is compiled again now. One that "
            "changes every call pays a compile every call (keep it in a buffer, or use "
            "mode='stepwise').",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


def compiled_module_reason(modules: Any) -> str | None:
    """Why the fused program cannot call ``modules``: one is a ``torch.compile``'d module
    (an ``OptimizedModule``), which the loop's own compile cannot trace into."""
    for m in modules:
        for sub in m.modules():
            if hasattr(sub, "_orig_mod") and type(sub).__name__ == "OptimizedModule":
                return (
                    "loss_fn calls a torch.compile'd module (OptimizedModule), which the fused "
                    "program, compiled as a whole, cannot trace into. Use the module itself "
                    "where you call torch.compile(model): the fused loop compiles it, once for "
                    "all steps."
                )
    return None


def _owners(resolved: Any, params: Any) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(module, attribute, tensor)`` of each parameter the optimizer holds, found once."""
    owners = resolved.wrapper.__dict__.get("_stepfuse_owners")
    if owners is None:
        owners = []
        for name, p in zip(resolved.names, params):
            prefix, _, leaf = name.rpartition(".")
            owners.append((resolved.wrapper.get_submodule(prefix), leaf, p))
        resolved.wrapper.__dict__["_stepfuse_owners"] = owners
    return owners


def check_modules_unchanged(resolved: Any, params: Any) -> None:
    """Refuse a fused call where a module's parameter is no longer the tensor the optimizer
    holds (``model.fc = nn.Linear(...)``, ``model.fc.weight = nn.Parameter(...)`` after
    `fuse`): the program would run the old tensor, where the plain loop runs the new one
    (and, its optimizer holding the old, never trains it)."""
    if resolved is None:
        return
    for module, leaf, p in _owners(resolved, params):
        now = module._parameters.get(leaf)
        if now is not p:
            raise ValueError(
                f"`model`'s parameter {type(module).__name__}.{leaf} {tuple(p.shape)} was "
                "replaced after the fit was built, and the optimizer still holds the old "
                "tensor: a plain loop would run the new one and never train it. Build a new "
                "optimizer over the model's parameters and a new fit (or write the new values "
                "into the old tensor: with torch.no_grad(): old.copy_(new)). Nothing was run "
                "or changed."
            )


def rekey_after_callback(fit: Any, start: int) -> None:
    """After a callback mid-call: what it changed (a hyper-parameter, a module's training
    flag, which parameters require grad) holds for the rest of the call, as in the
    stepwise loop: the program for it is built (or found) now. Where the fit cannot go on
    fused (a fallback, a parameter unfrozen without optimizer state yet), the call stops
    with the updates applied so far kept."""
    fit._read_trainable()
    if fit._state.ready():
        fit._ensure_program()
        if fit.mode == "fused":
            return
        why = f"could not be compiled ({fit.fallback_reason})"
    else:
        why = "has no optimizer state for a parameter it unfroze (torch makes it at a step)"
    raise RuntimeError(
        f"stepfuse.torch: the fit as the callback left it {why}; this call stopped after "
        f"{fit.step - start} applied updates (kept). Call again: the next call runs it "
        "as it is now."
    )
