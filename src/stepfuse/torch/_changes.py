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
    "hypers_changed",
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


def hypers_changed(before: tuple, now: tuple) -> None:
    """Warn where a program is compiled again because a group's hyper-parameter other than
    ``lr`` changed (``before`` / ``now``: `stepfuse.torch.Fit._hyper_key` with rates)."""
    changed = [
        f"group {i} {k}: {dict(b).get(k)!r} -> {v!r}"
        for i, (b, n) in enumerate(zip(before, now))
        for k, v in n
        if dict(b).get(k) != v
    ]
    if len(before) != len(now):
        changed.append(f"{len(before)} -> {len(now)} param_groups")
    warnings.warn(
        "stepfuse.torch: the optimizer's hyper-parameters other than lr changed "
        f"({'; '.join(changed[:4])}): the fused program holds them as constants, so it is "
        "compiled again now. A schedule that changes them every call pays a compile every "
        "call (the last programs are kept: values seen before reuse theirs): OneCycleLR and "
        "CyclicLR cycle momentum / betas unless given cycle_momentum=False. lr is an input "
        "of the program (an lr scheduler alone compiles nothing); mode='stepwise' compiles "
        "nothing.",
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
    owners: tuple[tuple[nn.Module, str], ...] = ()
    """``(module, attribute)`` holding each of the optimizer's parameters then."""
    outside: tuple[torch.Tensor, ...] = ()
    """The modules' parameters the optimizer does not hold (their ``.grad`` is put back
    after a call: `stepfuse.torch._state.grads_kept`)."""


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
    rest = [(n, p) for n, p in wrapper.named_parameters() if id(p) not in held]
    others = [n for n, p in rest if p.requires_grad]
    buffers = tuple(n for n, _ in wrapper.named_buffers())
    rnn = any(isinstance(m, nn.RNNBase) for m in wrapper.modules())
    tree = tuple(wrapper.named_modules())
    kids = tuple((m, tuple(m._modules.values())) for _, m in tree)
    named = [names[id(p)] for p in params]
    owners = tuple(
        (wrapper.get_submodule(prefix), leaf)
        for prefix, _, leaf in (n.rpartition(".") for n in named)
    )
    outside = tuple(p for _, p in rest)
    return Resolved(wrapper, named, others, buffers, rnn, tree, kids, owners, outside)


def _where(name: str, wrapper: nn.Module) -> str:
    """A module's or parameter's name under the wrapper as the user wrote it (``models.0.fc``
    -> ``fc``; with several models, which one: ``Critic.fc``, ``Critic[1].fc`` where two
    are of one class)."""
    parts = name.split(".")
    rest = ".".join(parts[2:])
    models = wrapper.__dict__["_modules"].get("models")
    if models is None or len(models) < 2 or len(parts) < 2:
        return rest or "the model"
    kinds = [type(m).__name__ for m in models]
    i = int(parts[1])
    top = kinds[i] if kinds.count(kinds[i]) == 1 else f"{kinds[i]}[{i}]"
    return f"{top}.{rest}" if rest else top


def _rearranged(before: Resolved, now: Resolved) -> list[str]:
    """Where two `Resolved` readings differ (``"1: Tanh -> ReLU"``, ``"head: Linear added"``,
    ``"parameter 0.weight -> 0.weight_orig"``: held under another name)."""
    w = now.wrapper
    old, new = dict(before.tree), dict(now.tree)
    said = [
        f"{_where(n, w)}: {type(m).__name__} -> "
        + (type(new[n]).__name__ if n in new else "removed")
        for n, m in before.tree
        if new.get(n) is not m
    ]
    said += [f"{_where(n, w)}: {type(m).__name__} added" for n, m in now.tree if n not in old]
    return said + [
        f"parameter {_where(a, w)} -> {_where(b, w)}"
        for a, b in zip(before.names, now.names)
        if a != b
    ]


def _follow(fit: Any) -> None:
    """A fused fit whose modules were rearranged after its names were read (a submodule
    replaced, added or removed: ``model.act = nn.ReLU()``; a parameter moved to another name
    in its module: ``torch.nn.utils.spectral_norm``): the plain loop runs the modules as
    they are now, so the fit reads them again and builds programs for them. An optimizer's
    parameter that no module holds any more is refused: the plain loop would run the
    module's new tensor, and never train it."""
    r = fit._resolved
    same = all(tuple(m._modules.values()) == kids for m, kids in r.kids)  # (by identity)
    if same and all(m._parameters.get(k) is p for (m, k), p in zip(r.owners, fit._params)):
        return
    got = bind(r.wrapper, fit._params)
    if isinstance(got, list):
        i = got[0]
        where, shape = _where(r.names[i], r.wrapper), tuple(fit._params[i].shape)
        owner = r.owners[i][0]
        how = (
            "was replaced after the fit was built (module.weight = nn.Parameter(...))"
            if any(m is owner for m in r.wrapper.modules())
            else "is in no module any more (its module was replaced after the fit was built)"
        )
        raise ValueError(
            f"`model`'s parameter {where} {shape} {how}, and the optimizer still holds the "
            "old tensor: a plain loop would run the module's new tensor and never train it. "
            "Build a new optimizer over the model's parameters and a new fit (or write new "
            "values into the old tensor: with torch.no_grad(): old.copy_(new)). Nothing was "
            "run or changed."
        )
    changed, built = _rearranged(r, got), bool(fit._captured)
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
    """Before a fused call: follow a rearrangement of the modules, or refuse a parameter
    replaced in its module (`_follow`)."""
    if fit.mode == "fused" and fit._resolved is not None:
        _follow(fit)


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
