"""The optimizers' own update rules (``torch.optim``'s functional, single-tensor form).

The fused program calls these on copies of the parameters and state: each rule is the
function ``torch.optim`` itself runs in ``step()``, with a group's hyper-parameters as
Python values (`hyper`), so the fused mode updates exactly as the optimizer does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["SUPPORTED_OPTIMIZERS", "Rule", "RULES", "HANDLED", "IGNORED_GROUP_KEYS", "hyper"]


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


RULES: dict[type, Rule] = {
    torch.optim.SGD: Rule(_sgd_keys, _sgd_update, True),
    torch.optim.Adam: Rule(_adam_keys, _adam_update, True),
    torch.optim.AdamW: Rule(_adam_keys, _adamw_update, True),
    torch.optim.RMSprop: Rule(_rmsprop_keys, _rmsprop_update, True),
    torch.optim.Adagrad: Rule(_adagrad_keys, _adagrad_update, False),  # reads `step` on the host
}
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
}
HANDLED[torch.optim.AdamW] = HANDLED[torch.optim.Adam]

IGNORED_GROUP_KEYS = ("params", "foreach", "fused", "capturable", "differentiable", "initial_lr")


def hyper(group: dict) -> dict[str, Any]:
    """A group's hyper-parameters as plain Python values (baked into the compiled program)."""
    out = {}
    for k, v in group.items():
        if k in IGNORED_GROUP_KEYS:
            continue
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else tuple(v.tolist())
        elif isinstance(v, (list, tuple)):
            v = tuple(x.item() if isinstance(x, torch.Tensor) else x for x in v)
        out[k] = v
    return out
