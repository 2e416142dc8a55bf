"""The update rules of ASGD, Adadelta, Adamax, NAdam, RAdam and Rprop (and Muon's).

Each calls ``torch.optim``'s own functional update (``foreach=False``: its single-tensor
form), with a group's hyper-parameters as Python values, like the rules in
`stepfuse.torch._rules`. Three of them run torch's tensor form (``capturable=True``),
which torch itself picks for CUDA graphs, because their plain form reads a value on the
host inside the update, which a compiled loop cannot do:

- ASGD tests ``mu.item() != 1`` to copy the parameter into ``ax`` instead of averaging;
  the tensor form averages with ``mu`` (1 while ``step <= t0``), the same values;
- RAdam branches on ``rho_t > 5`` in Python; the tensor form selects with
  ``torch.where``;
- Rprop sets the sign's entries by boolean indexing; the tensor form uses
  ``torch.where``, the same values.

Outside a compile torch refuses ``capturable=True`` on CPU tensors (an assertion); inside
one (`torch.compiler.is_compiling`) it leaves device checks to the compiler, so the fused
program runs these forms on CPU too. The state each reads is torch's: ASGD's ``eta`` and
``mu`` and NAdam's ``mu_product`` are 0-dim float tensors beside the per-parameter ones,
and `placeholder` builds each key as torch's ``_init_group`` would, for a program compiled
before the first step.

Muon's rule (`MUON_KEYS`, `muon`) orthogonalizes each update with Newton-Schulz
iterations in bfloat16. Inductor by default computes a chain of bfloat16 operations in
float32 and rounds once at the end, where eager torch rounds each result to bfloat16:
the fused parameters then drift from the plain loop's (by up to 9e-3 within 8 steps of
a small MLP). `MUON_INDUCTOR` (``emulate_precision_casts``) has inductor round each
intermediate as eager does, which makes the fused program equal the plain loop (within
1e-7 on the same MLP and every ``optim_db`` configuration of Muon).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KEYS", "MUON_INDUCTOR", "MUON_KEYS", "UPDATES", "muon", "placeholder"]


def _scalar_dtype() -> torch.dtype:
    from torch.optim.optimizer import _get_scalar_dtype

    return _get_scalar_dtype()


def _asgd(p, gr, s, g, capturable):
    from torch.optim.asgd import asgd

    asgd(
        p,
        gr,
        s["ax"],
        s["mu"],
        s["eta"],
        s["step"],
        foreach=False,
        maximize=g["maximize"],
        capturable=True,  # the plain form reads mu on the host (see the module's doc)
        lambd=g["lambd"],
        lr=g["lr"],
        t0=g["t0"],
        alpha=g["alpha"],
        weight_decay=g["weight_decay"],
    )


def _adadelta(p, gr, s, g, capturable):
    from torch.optim.adadelta import adadelta

    adadelta(
        p,
        gr,
        s["square_avg"],
        s["acc_delta"],
        s["step"],
        capturable=capturable,
        foreach=False,
        lr=g["lr"],
        rho=g["rho"],
        eps=g["eps"],
        weight_decay=g["weight_decay"],
        maximize=g["maximize"],
    )


def _adamax(p, gr, s, g, capturable):
    from torch.optim.adamax import adamax

    adamax(
        p,
        gr,
        s["exp_avg"],
        s["exp_inf"],
        s["step"],
        foreach=False,
        maximize=g["maximize"],
        capturable=capturable,
        eps=g["eps"],
        beta1=g["betas"][0],
        beta2=g["betas"][1],
        lr=g["lr"],
        weight_decay=g["weight_decay"],
    )


def _nadam(p, gr, s, g, capturable):
    from torch.optim.nadam import nadam

    nadam(
        p,
        gr,
        s["exp_avg"],
        s["exp_avg_sq"],
        s["mu_product"],
        s["step"],
        decoupled_weight_decay=g["decoupled_weight_decay"],
        foreach=False,
        capturable=capturable,
        maximize=g["maximize"],
        beta1=g["betas"][0],
        beta2=g["betas"][1],
        lr=g["lr"],
        weight_decay=g["weight_decay"],
        momentum_decay=g["momentum_decay"],
        eps=g["eps"],
    )


def _radam(p, gr, s, g, capturable):
    from torch.optim.radam import radam

    radam(
        p,
        gr,
        s["exp_avg"],
        s["exp_avg_sq"],
        s["step"],
        decoupled_weight_decay=g["decoupled_weight_decay"],
        foreach=False,
        capturable=True,  # the plain form branches on rho_t in Python (see the module's doc)
        maximize=g["maximize"],
        beta1=g["betas"][0],
        beta2=g["betas"][1],
        lr=g["lr"],
        weight_decay=g["weight_decay"],
        eps=g["eps"],
    )


def _rprop(p, gr, s, g, capturable):
    from torch.optim.rprop import rprop

    etaminus, etaplus = g["etas"]
    step_size_min, step_size_max = g["step_sizes"]
    rprop(
        p,
        gr,
        s["prev"],
        s["step_size"],
        s["step"],
        foreach=False,
        capturable=True,  # the plain form sets entries by boolean indexing (the module's doc)
        maximize=g["maximize"],
        step_size_min=step_size_min,
        step_size_max=step_size_max,
        etaminus=etaminus,
        etaplus=etaplus,
    )


def muon(p, gr, s, g, capturable):
    """Muon's update: torch's own functional form (parameters are 2-D: `Muon` checks)."""
    from torch.optim._muon import muon as torch_muon

    torch_muon(
        p,
        gr,
        s["momentum_buffer"],
        foreach=False,
        lr=g["lr"],
        weight_decay=g["weight_decay"],
        momentum=g["momentum"],
        nesterov=g["nesterov"],
        ns_coefficients=g["ns_coefficients"],
        eps=g["eps"],
        ns_steps=g["ns_steps"],
        adjust_lr_fn=g["adjust_lr_fn"],
        has_complex=False,  # Muon's _init_group raises for complex parameters
    )


MUON_KEYS = ("momentum_buffer",)
"""Muon's state keys."""

MUON_INDUCTOR: dict[str, Any] = {"emulate_precision_casts": True}
"""The inductor options under which the fused Muon equals eager torch's (module doc)."""

KEYS: dict[type, tuple[str, ...]] = {
    torch.optim.ASGD: ("step", "eta", "mu", "ax"),
    torch.optim.Adadelta: ("step", "square_avg", "acc_delta"),
    torch.optim.Adamax: ("step", "exp_avg", "exp_inf"),
    torch.optim.NAdam: ("step", "mu_product", "exp_avg", "exp_avg_sq"),
    torch.optim.RAdam: ("step", "exp_avg", "exp_avg_sq"),
    torch.optim.Rprop: ("step", "prev", "step_size"),
}
"""The state keys of each class, in the order its update takes them."""

UPDATES = {
    torch.optim.ASGD: _asgd,
    torch.optim.Adadelta: _adadelta,
    torch.optim.Adamax: _adamax,
    torch.optim.NAdam: _nadam,
    torch.optim.RAdam: _radam,
    torch.optim.Rprop: _rprop,
}


def placeholder(cls: type, key: str, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """A stand-in for state ``key`` of parameter ``p`` shaped, typed and placed as
    torch's ``_init_group`` creates it (its value is never used: the first step is
    torch's own)."""
    dt = _scalar_dtype()
    on_device = cls is torch.optim.ASGD or group.get("capturable", False)
    if key in ("step", "eta", "mu", "mu_product"):
        return torch.zeros((), dtype=dt, device=p.device if on_device else "cpu")
    return torch.zeros_like(p, memory_format=torch.preserve_format)
