"""Adafactor in the fused program: torch's own update, run eagerly at every step.

``torch.optim.Adafactor``'s update (its single-tensor and foreach forms alike; it has no
capturable form) reads values on the host at every step: the step count and, per
parameter, the norms of the parameter and of its update (``.item()``), which set its
step sizes through Python's ``min`` / ``max`` in double precision. Compiled, those reads
become data-dependent scalars: inductor then cannot lower the ``lerp_`` whose weight is
``step ** beta2_decay`` (it picks one of two formulas by ``weight >= 0.5``, a guard on
a data-dependent value), and traced with ``capture_scalar_outputs`` the Python arithmetic
on them would be float32 tensor arithmetic, not eager's double.

So the fused program does not trace the update: it calls ``stepfuse::adafactor``, a
custom op (`torch.library.custom_op`) whose kernel runs torch's own functional
``torch.optim._adafactor.adafactor`` eagerly, on copies of its inputs, with the group's
``foreach`` as ``step()`` passes it. The compiled loop calls the kernel at every step
(an extern call of inductor's program); the update is computed by the code ``step()``
runs, on the same values, so it equals eager Adafactor's bit for bit for the same
gradients. Only the op's shapes are traced (its fake kernel).

Adafactor's state differs by parameter: a matrix (``dim() > 1``) keeps the row and column
factors ``row_var`` / ``col_var``, a vector or scalar its ``variance``. The fused program
carries one list per key over every parameter; where a parameter has no such key it
carries an empty tensor, which is never written back (`held`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["KEYS", "held", "placeholder", "update"]

KEYS = ("step", "row_var", "col_var", "variance")
"""Adafactor's state keys, in the order the fused program carries them."""

_SCHEMA = (
    "(Tensor[] params, Tensor[] grads, Tensor[] row_vars, Tensor[] col_vars, "
    "Tensor[] variances, Tensor[] steps, bool? foreach, float d, Tensor lr, "
    "float beta2_decay, float weight_decay, float? eps1, float eps2, bool maximize) "
    "-> Tensor[]"
)


def held(key: str, p: torch.Tensor) -> bool:
    """Whether torch keeps state ``key`` for parameter ``p`` (its ``_init_group``)."""
    if key in ("row_var", "col_var"):
        return p.dim() > 1
    if key == "variance":
        return p.dim() <= 1
    return True


def placeholder(key: str, p: torch.Tensor) -> torch.Tensor:
    """A stand-in for state ``key`` of ``p`` as torch's ``_init_group`` creates it (its
    value is never used: torch's first step is eager); empty where ``p`` has no ``key``."""
    from torch.optim.optimizer import _get_scalar_dtype

    if key == "step":  # on the CPU whatever the parameter's device, as torch keeps it
        return torch.zeros((), dtype=_get_scalar_dtype())
    if not held(key, p):
        return torch.zeros(0, dtype=p.dtype, device=p.device)
    if key == "variance":
        return torch.zeros_like(p, memory_format=torch.preserve_format)
    shape = list(p.shape)
    shape[-1 if key == "row_var" else -2] = 1
    return p.new_zeros(shape)


def _kernel(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    row_vars: Sequence[torch.Tensor],
    col_vars: Sequence[torch.Tensor],
    variances: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    foreach: bool | None,
    d: float,
    lr: torch.Tensor,
    beta2_decay: float,
    weight_decay: float,
    eps1: float | None,
    eps2: float,
    maximize: bool,
) -> list[torch.Tensor]:
    """torch's Adafactor update of copies of the inputs; returns them updated (params,
    row_vars, col_vars, variances, steps). A key a parameter has not (`held`) is an empty
    stand-in, passed to torch as None."""
    from torch.optim._adafactor import adafactor
    from torch.optim.optimizer import _get_scalar_dtype

    copy = lambda ts: [t.detach().clone() for t in ts]  # noqa: E731
    new_p, rows, cols, variance = copy(params), copy(row_vars), copy(col_vars), copy(variances)
    # `step` as torch keeps it (the program may carry it wider): the same increments
    new_steps = [s.detach().to(_get_scalar_dtype(), copy=True) for s in steps]

    def present(key: str, ts: list[torch.Tensor]) -> list[torch.Tensor | None]:
        return [t if held(key, q) else None for t, q in zip(ts, params)]

    with torch.no_grad():
        adafactor(
            new_p,
            [g.detach() for g in grads],
            present("row_var", rows),
            present("col_var", cols),
            present("variance", variance),
            new_steps,
            foreach=foreach,
            d=d,
            lr=lr.item(),  # a Python float, as the plain loop's (float64: the same value)
            beta2_decay=beta2_decay,
            weight_decay=weight_decay,
            eps1=eps1,  # type: ignore[arg-type]  # torch reads None as its dtype's eps
            eps2=eps2,
            maximize=maximize,
        )
    steps_out = [n.to(s.dtype) for n, s in zip(new_steps, steps)]
    return [*new_p, *rows, *cols, *variance, *steps_out]


def _fake(params, grads, row_vars, col_vars, variances, steps, *args):
    return [torch.empty_like(t) for t in (*params, *row_vars, *col_vars, *variances, *steps)]


# Registered at import: dynamo cannot trace a registration inside the program.
_OP = torch.library.custom_op("stepfuse::adafactor", _kernel, mutates_args=(), schema=_SCHEMA)
_OP.register_fake(_fake)


def update(
    p: list[torch.Tensor],
    gr: list[torch.Tensor],
    s: dict[str, list[torch.Tensor]],
    g: dict[str, Any],
    capturable: bool,
) -> None:
    """The rule's update (`stepfuse.torch._rules.Rule.update`): one call of the op for
    the group, its results copied into the program's copies ``p`` and ``s``."""
    eps1, eps2 = g["eps"]
    out = _OP(
        p,
        gr,
        s["row_var"],
        s["col_var"],
        s["variance"],
        s["step"],
        g.get("foreach"),
        float(g["d"]),
        torch.as_tensor(g["lr"], dtype=torch.float64),  # (an input of the program: `Body.rates`)
        float(g["beta2_decay"]),
        float(g["weight_decay"]),
        None if eps1 is None else float(eps1),
        float(eps2),
        bool(g["maximize"]),
    )
    for dst, src in zip([*p, *s["row_var"], *s["col_var"], *s["variance"], *s["step"]], out):
        dst.copy_(src)
