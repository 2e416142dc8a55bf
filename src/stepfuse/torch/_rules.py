"""The optimizers' own update rules (``torch.optim``'s functional, single-tensor form).

The fused program calls these on copies of the parameters and state: each rule is the
function ``torch.optim`` itself runs in ``step()``, with a group's hyper-parameters as
Python values (`hyper`), so the fused mode updates exactly as the optimizer does. SGD,
Adam, AdamW, RMSprop and Adagrad are here; ASGD, Adadelta, Adamax, NAdam, RAdam and
Rprop and Muon in `stepfuse.torch._optimizers`; Adafactor, whose update the program calls
eagerly through a custom op, in `stepfuse.torch._adafactor`. `refusal` says why the others
(LBFGS, SparseAdam) run stepwise, and `check_group` refuses, before anything is compiled,
the options whose ``step()`` raises in the plain loop too. Muon's rule (`MUON_RULE`)
equals eager torch only under extra inductor options (`Rule.inductor`), which the compiled
program applies over its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from . import _adafactor, _optimizers

__all__ = [
    "HANDLED",
    "IGNORED_GROUP_KEYS",
    "MUON_RULE",
    "NOT_FUSED",
    "RULES",
    "Rule",
    "SUPPORTED_OPTIMIZERS",
    "check_group",
    "held",
    "hyper",
    "hyper_key",
    "placeholder",
    "rates",
    "refusal",
]


def scalar_dtype() -> torch.dtype:
    """The dtype torch.optim gives a fresh ``step`` tensor."""
    from torch.optim.optimizer import _get_scalar_dtype

    return _get_scalar_dtype()


def _sgd_keys(g):
    return ("momentum_buffer",) if g["momentum"] != 0 else ()


def _adam_keys(g):
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g["amsgrad"] else ())


def _rmsprop_keys(g):
    keys: tuple[str, ...] = ("step", "square_avg")
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


class Rule(NamedTuple):
    """How the fused mode runs one ``torch.optim`` class."""

    keys: Callable[[dict], tuple[str, ...]]
    """The state keys of a param group, in the order the update takes them."""
    update: Callable[..., None]
    """``update(params, grads, state, hyper, capturable)``, in place on its arguments."""
    capturable: bool
    """Whether its eager (capturable) form works inside a CUDA graph."""
    inductor: Mapping[str, Any] = MappingProxyType({})
    """Inductor options the fused program needs on top of its own for this rule to equal
    eager torch (Muon's: `stepfuse.torch._optimizers.MUON_INDUCTOR`)."""
    cpu_only: str | None = None
    """Why the rule runs fused on the CPU only, or None: the fallback reason for
    parameters on another device."""


RULES: dict[type, Rule] = {
    torch.optim.SGD: Rule(_sgd_keys, _sgd_update, True),
    torch.optim.Adam: Rule(_adam_keys, _adam_update, True),
    torch.optim.AdamW: Rule(_adam_keys, _adamw_update, True),
    torch.optim.RMSprop: Rule(_rmsprop_keys, _rmsprop_update, True),
    torch.optim.Adagrad: Rule(_adagrad_keys, _adagrad_update, False),  # reads `step` on the host
}
# NAdam keeps `mu_product` on the CPU unless the group is capturable: no eager capture.
_EAGER_CAPTURABLE: dict[type, bool] = {torch.optim.NAdam: False}


def _fixed_keys(keys: tuple[str, ...]) -> Callable[[dict], tuple[str, ...]]:
    return lambda g: keys


for _cls, _keys in _optimizers.KEYS.items():
    RULES[_cls] = Rule(
        _fixed_keys(_keys), _optimizers.UPDATES[_cls], _EAGER_CAPTURABLE.get(_cls, True)
    )

MUON_RULE = Rule(
    _fixed_keys(_optimizers.MUON_KEYS),
    _optimizers.muon,
    True,
    MappingProxyType(_optimizers.MUON_INDUCTOR),
)
"""Muon's rule: it equals eager torch only under its `Rule.inductor` options."""
RULES[torch.optim.Muon] = MUON_RULE
RULES[torch.optim.Adafactor] = Rule(
    _fixed_keys(_adafactor.KEYS),
    _adafactor.update,
    False,
    cpu_only=(
        "Adafactor's update reads the step count and norms on the host at every step; the "
        "fused program calls torch's own update eagerly from inside the loop, which a CUDA "
        "graph cannot capture, so on a GPU it runs stepwise."
    ),
)
SUPPORTED_OPTIMIZERS = tuple(c.__name__ for c in RULES)
"""The ``torch.optim`` classes the fused mode runs; any other optimizer runs stepwise."""

# The options of each class that its rule reads; an optimizer whose class has any other
# (a newer torch's) runs stepwise rather than silently without it.
HANDLED: dict[type, set[str]] = {
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
    torch.optim.ASGD: {"lr", "lambd", "alpha", "t0", "weight_decay", "maximize"},
    torch.optim.Adadelta: {"lr", "rho", "eps", "weight_decay", "maximize"},
    torch.optim.Adamax: {"lr", "betas", "eps", "weight_decay", "maximize"},
    torch.optim.Muon: {
        "lr",
        "weight_decay",
        "momentum",
        "nesterov",
        "ns_coefficients",
        "eps",
        "ns_steps",
        "adjust_lr_fn",
    },
    torch.optim.NAdam: {
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "momentum_decay",
        "decoupled_weight_decay",
        "maximize",
    },
    torch.optim.RAdam: {"lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "maximize"},
    # `lr` only sets the first `step_size`, which torch's first step creates.
    torch.optim.Rprop: {"lr", "etas", "step_sizes", "maximize"},
}
HANDLED[torch.optim.AdamW] = HANDLED[torch.optim.Adam]
HANDLED[torch.optim.Adafactor] = {"lr", "beta2_decay", "eps", "d", "weight_decay", "maximize"}

IGNORED_GROUP_KEYS = ("params", "foreach", "fused", "capturable", "differentiable", "initial_lr")
_PASSED_KEYS = ("foreach",)  # not an option a rule must read, but passed (Adafactor reads it)


def hyper(group: dict) -> dict[str, Any]:
    """A group's hyper-parameters as plain Python values (baked into the compiled program);
    raises for a group the plain loop cannot step either (`check_group`)."""
    check_group(group)
    out = {}
    for k, v in group.items():
        if k in IGNORED_GROUP_KEYS and k not in _PASSED_KEYS:
            continue
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else tuple(v.tolist())
        elif isinstance(v, (list, tuple)):
            v = tuple(x.item() if isinstance(x, torch.Tensor) else x for x in v)
        out[k] = v
    return out


def hyper_key(groups: Sequence[dict], without_lr: bool) -> tuple:
    """Each group's `hyper` as a sorted tuple of items (``lr`` left out ``without_lr``:
    the fused program's input, `rates`), for a program's key."""
    return tuple(
        tuple(sorted((k, v) for k, v in hyper(g).items() if not (without_lr and k == "lr")))
        for g in groups
    )


def rates(groups: Sequence[dict]) -> list[float]:
    """Each group's ``lr`` as it is now (an input of the fused program on the CPU:
    `stepfuse.torch._program.Body.rates`; a tensor ``lr``: its value)."""
    return [float(g["lr"]) for g in groups]


NOT_FUSED: dict[type, str] = {
    torch.optim.LBFGS: (
        "LBFGS's step(closure) evaluates the loss and gradients a data-dependent number of "
        "times per step (up to max_iter / max_eval, stopping on tolerance_grad and "
        "tolerance_change tests read on the host, and a strong-Wolfe line search if asked) "
        "and keeps Python state (its history lists, n_iter, the previous loss and "
        "direction); a compiled loop of fixed steps cannot run that exactly, so it runs "
        "stepwise, calling step(closure) as torch's own closure loop does."
    ),
    torch.optim.SparseAdam: (
        "SparseAdam updates only the rows its sparse gradients hold; the fused program "
        "takes dense gradients (torch.func), so it runs stepwise."
    ),
}
"""Why each ``torch.optim`` class without a rule runs stepwise."""


def refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s class has no fused rule (a whole sentence), or None if it has
    one or is not a class this module knows."""
    cls = type(optimizer)
    if cls in RULES:
        return None
    for known, reason in NOT_FUSED.items():
        if issubclass(cls, known):
            return reason
    return None


def check_group(group: dict) -> None:
    """Raise, before anything is compiled or run, for the options whose ``step()`` raises
    in the plain loop too: torch's error class, and how to fix it.

    ``differentiable=True`` runs the update with autograd on, and its in-place update of
    leaf parameters that require grad raises; ``capturable=True`` on a device that CUDA
    graphs (or the like) cannot capture fails torch's device assertion."""
    if group.get("differentiable", False):
        raise RuntimeError(
            "stepfuse.torch: the optimizer has differentiable=True, under which its step() "
            "updates the parameters in place with autograd on and raises torch's RuntimeError "
            "'a leaf Variable that requires grad is being used in an in-place operation' (the "
            "plain zero_grad / backward / step loop fails the same way). Build the optimizer "
            "with differentiable=False (nothing was run or changed)."
        )
    if group.get("capturable", False):
        from torch.optim.optimizer import _get_capturable_supported_devices

        supported = _get_capturable_supported_devices()
        bad = sorted({p.device.type for p in group["params"]} - set(supported))
        if bad:
            raise AssertionError(
                f"stepfuse.torch: the optimizer has capturable=True with parameters on "
                f"{', '.join(bad)}; torch.optim's step() then asserts 'If capturable=True, "
                f"params and state_steps must be on supported devices: {supported}.' (the plain "
                "loop fails the same way). Build the optimizer with capturable=False on this "
                "device (nothing was run or changed)."
            )


def placeholder(optimizer: Any, key: str, p: torch.Tensor, group: dict) -> torch.Tensor:
    """A stand-in for ``optimizer``'s state ``key`` of ``p`` before torch created it, shaped,
    typed and placed as torch's first step will create it (for a program compiled first).
    ``optimizer`` may also be a view of one that holds it as ``.optimizer``."""
    real = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    cls = type(real)
    if cls is torch.optim.Adafactor:
        return _adafactor.placeholder(key, p)
    if cls in _optimizers.KEYS:
        return _optimizers.placeholder(cls, key, p, group)
    if key == "step":
        on_device = group.get("capturable", False) or group.get("fused", False)
        return torch.zeros((), dtype=scalar_dtype(), device=p.device if on_device else "cpu")
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def held(optimizer: Any, key: str, p: torch.Tensor) -> bool:
    """Whether ``optimizer``'s class keeps state ``key`` for parameter ``p``: every key of
    its rule but Adafactor's factored ones (`stepfuse.torch._adafactor.held`). A key a
    parameter has not is carried as an empty tensor and never written back."""
    real = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    return type(real) is not torch.optim.Adafactor or _adafactor.held(key, p)
