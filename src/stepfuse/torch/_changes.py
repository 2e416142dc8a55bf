"""What a user changes while a torch fit lives: between calls (a parameter or a submodule
replaced in its module) and during one (a callback that switches a module to eval mode, freezes a
parameter or sets a hyper-parameter), and what the fit does about each."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from .._core import user_stacklevel

__all__ = [
    "Resolved",
    "bind",
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


class Resolved(NamedTuple):
    """The module wrapper the fused program calls, and the names of its parameters:
    ``names`` of the optimizer's, ``others`` those it does not hold (constants)."""

    wrapper: nn.Module
    names: list[str]
    others: list[str]
    buffers: tuple[str, ...] = ()
    """Names of the modules' buffers (carried through the fused loop)."""
    rnn: bool = False
    """Whether the modules hold recurrent layers (`stepfuse.torch._program.traceable`)."""
    tree: tuple[tuple[str, nn.Module], ...] = ()
    """Every submodule under ``wrapper`` with its name, as the names were read: a program
    is traced through these modules (`check_modules_unchanged`)."""
    kids: tuple[tuple[nn.Module, tuple], ...] = ()
    """Each of those modules with its children then (a cheap check that none changed)."""


def bind(wrapper: nn.Module, params: Sequence[torch.Tensor]) -> Resolved | list[int]:
    """The names under ``wrapper`` of the optimizer's ``params``, of the other parameters
    needing a gradient and of the buffers, as the modules are now; or the indices of the
    ``params`` no module under ``wrapper`` holds."""
    names: dict[int, str] = {}
    for name, p in wrapper.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        return missing
    held = {id(p) for p in params}
    others = [n for n, p in wrapper.named_parameters() if id(p) not in held and p.requires_grad]
    buffers = tuple(n for n, _ in wrapper.named_buffers())
    rnn = any(isinstance(m, nn.RNNBase) for m in wrapper.modules())
    tree = tuple(wrapper.named_modules())
    kids = tuple((m, tuple(m._modules.values())) for _, m in tree)
    return Resolved(wrapper, [names[id(p)] for p in params], others, buffers, rnn, tree, kids)


def _owners(resolved: Any, params: Any) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(module, attribute, tensor)`` of each parameter the optimizer holds, found once
    per `Resolved`."""
    owners = resolved.wrapper.__dict__.get("_stepfuse_owners")
    if owners is None or owners[0] is not resolved:
        found = []
        for name, p in zip(resolved.names, params):
            prefix, _, leaf = name.rpartition(".")
            found.append((resolved.wrapper.get_submodule(prefix), leaf, p))
        owners = resolved.wrapper.__dict__["_stepfuse_owners"] = (resolved, found)
    return owners[1]


def _where(name: str) -> str:
    """A module's name under the wrapper as the user wrote it (``models.0.fc`` -> ``fc``)."""
    parts = name.split(".")[2:]
    return ".".join(parts) or "the model"


def _rearranged(before: tuple, now: tuple) -> list[str]:
    """Where two `Resolved.tree` readings differ (``"1: Tanh -> ReLU"``, ``"head: Linear added"``)."""
    old, new = dict(before), dict(now)
    said = [
        f"{_where(n)}: {type(m).__name__} -> " + (type(new[n]).__name__ if n in new else "removed")
        for n, m in before
        if new.get(n) is not m
    ]
    return said + [f"{_where(n)}: {type(m).__name__} added" for n, m in now if n not in old]


def _follow(fit: Any) -> None:
    """A fused fit whose modules were rearranged after its names were read (a submodule
    replaced, added or removed: ``model.act = nn.ReLU()``): the plain loop runs the
    modules as they are now, so the fit reads them again and builds programs for them; an
    optimizer's parameter no module holds any more is refused (`check_modules_unchanged`)."""
    r = fit._resolved
    if all(tuple(m._modules.values()) == kids for m, kids in r.kids):  # (by identity)
        return
    got = bind(r.wrapper, fit._params)
    if isinstance(got, list):
        i = got[0]
        raise ValueError(
            f"`model`'s parameter {_where(r.names[i])} "
            f"{tuple(fit._params[i].shape)} is in no module any more (its module was "
            "replaced after the fit was built), and the optimizer still holds it: a plain "
            "loop would never train the new module's parameters. Build a new optimizer over "
            "the model's parameters and a new fit. Nothing was run or changed."
        )
    changed, built = _rearranged(r.tree, got.tree), bool(fit._captured)
    fit._resolved, fit._rnn, fit._submodules = got, got.rnn, None
    fit._program = fit._program_key = fit._random_ops = None
    for cache in (fit._captured, fit._probed, fit._verified):
        cache.clear()
    if fit._evals is not None:
        fit._evals = type(fit._evals)(fit.opts, fit._modules)
    reason = compiled_module_reason(fit._modules)
    if reason is not None:
        fit._fall_back(reason)
    elif built:
        warnings.warn(
            f"stepfuse.torch: the modules changed since the fused program was built "
            f"({'; '.join(changed[:4])}): it is compiled again for them now, as the plain "
            "loop runs them as they are.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


def check_modules_unchanged(fit: Any) -> None:
    """Before a fused call: follow a rearrangement of the modules (`_follow`), and refuse
    one where a module's parameter is no longer the tensor the optimizer holds
    (``model.fc = nn.Linear(...)``, ``model.fc.weight = nn.Parameter(...)`` after `fuse`):
    the program would run the old tensor, where the plain loop runs the new one (and, its
    optimizer holding the old, never trains it)."""
    if fit.mode != "fused" or fit._resolved is None:
        return
    _follow(fit)
    for module, leaf, p in _owners(fit._resolved, fit._params):
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
