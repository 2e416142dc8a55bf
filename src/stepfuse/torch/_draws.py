"""Random draws in the fused program: dropout drawing the masks of eager torch's training
step, and the check of each new program's first step against an eager one.

The plain loop (``loss.backward()``) runs a CPU dropout as ATen's composite
``_dropout_impl``: ``noise = empty_like(input)``, ``noise.bernoulli_(1 - p)``,
``noise.div_(1 - p)``, ``input * noise``. Its ``bernoulli_`` fills ``noise`` in memory
order, and ``empty_like`` gives ``noise`` the strides of ``input``: for an input that is
not contiguous (the output of ``nn.MultiheadAttention`` with ``batch_first=True`` is a
transposed view) the mask depends on the input's layout. The fused program takes
gradients with ``torch.func.grad_and_value``, under which torch replaces dropout by
functorch's own form, drawing a mask laid out contiguously
(``at::empty({}).expand(sizes)`` then ``bernoulli``): the same random numbers, put in
other places. Compiled, inductor also lays out the buffer a ``bernoulli_`` fills as it
likes; only ``aten.native_dropout`` is kept at the strides its input has in eager torch
(inductor's layout constraint under ``fallback_random``).

`eager_dropout` is what the program runs instead of ``torch.nn.functional.dropout`` (and
so ``nn.Dropout``) on CPU in training: its mask is ``native_dropout``'s, which draws
``bernoulli_(1 - p)`` over ``empty_like(input)`` exactly as ``_dropout_impl`` does, and
the values are ``_dropout_impl``'s: ``input * (mask / (1 - p))`` (``native_dropout``'s own
output scales by ``1 / (1 - p)`` rounded once, which differs in the last bit for some
``p``).

``scaled_dot_product_attention`` with ``dropout_p > 0`` runs on CPU as ATen's math
kernel (the fused CPU kernels take no dropout); `eager_attention` is that kernel's
sequence of operations (the boolean or causal mask made additive, both factors scaled by
the square root of the scale, ``matmul``, the mask added, ``_safe_softmax``, the dropout
above, ``matmul``), so the program draws its mask as eager torch does too.

`exact_draws` installs both in ``torch.nn.functional`` while the fused program is traced
and called: ``nn.Dropout``, ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``
look them up there. Everything else (CUDA tensors, evaluation, ``p`` of 0 or 1, tensor
subclasses, arguments the kernels above do not take) goes to torch's own function. Run
eagerly, both equal torch's functions bit for bit (values, gradients, random state), so
eager code that another thread runs meanwhile is not changed either.

`check_draws` runs each new program's first step against an eager step from the same
state: a random op that the program still draws otherwise (another operation, another
layout) makes the fit fall back, naming the op.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import has_torch_function

from ._probe import cuda_devices, hold_buffers, rng_states, set_rng_states
from ._state import put_back, restore, snapshot

__all__ = [
    "check_draws",
    "draws_verified",
    "draws_mismatch",
    "eager_attention",
    "eager_dropout",
    "exact_draws",
]

_DROPOUT = F.dropout
_ATTENTION = F.scaled_dot_product_attention
_FLOATS = (torch.float32, torch.float64)


def _composite(*tensors: Any) -> bool:
    """Whether eager torch runs the composite CPU kernels above on ``tensors``."""
    present = [t for t in tensors if t is not None]
    return not has_torch_function(present) and all(
        t.device.type == "cpu" and t.layout == torch.strided and not t.is_nested for t in present
    )


def eager_dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``torch.nn.functional.dropout`` drawing and computing as eager CPU training does."""
    if (
        not training
        or not isinstance(p, float)
        or not 0.0 < p < 1.0
        or not _composite(input)
        or input.dtype not in _FLOATS
    ):
        return _DROPOUT(input, p, training, inplace)
    mask = torch.ops.aten.native_dropout(input.detach(), p, True)[1]
    noise = mask.to(input.dtype).div_(1.0 - p)
    return input.mul_(noise) if inplace else input * noise


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as eager CPU torch runs it with dropout (its math
    kernel), with the dropout of `eager_dropout`; anything else is torch's own call."""
    if (
        not isinstance(dropout_p, float)
        or not 0.0 < dropout_p < 1.0
        or enable_gqa
        or (is_causal and attn_mask is not None)
        or not _composite(query, key, value, attn_mask)
        or query.dtype not in _FLOATS
        or key.dtype != query.dtype
        or value.dtype != query.dtype
        or query.dim() < 2
        or (attn_mask is not None and attn_mask.dtype not in (torch.bool, query.dtype))
    ):
        return _ATTENTION(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    dtype = query.dtype
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = _additive(attn_mask, dtype)
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.size(-1)))
    q = query * factor
    if is_causal:
        length, source = query.size(-2), key.size(-2)
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        attn_mask = _additive(causal, dtype)
    k = key.transpose(-2, -1) * factor
    attn = torch.matmul(q, k)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = torch.ops.aten._safe_softmax(attn, -1)
    return torch.matmul(eager_dropout(attn, dropout_p), value)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as torch makes it additive: 0 where True, -inf elsewhere."""
    minus = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, minus)


@contextlib.contextmanager
def exact_draws() -> Iterator[None]:
    """`eager_dropout` and `eager_attention` in ``torch.nn.functional`` while inside."""
    saved = {"dropout": F.dropout, "scaled_dot_product_attention": F.scaled_dot_product_attention}
    F.dropout = eager_dropout
    F.scaled_dot_product_attention = eager_attention
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(F, name, fn)


def draws_mismatch(
    eager: tuple[float, Sequence[torch.Tensor]],
    fused: tuple[float, Sequence[torch.Tensor]],
    rng_eager: Sequence[torch.Tensor],
    rng_fused: Sequence[torch.Tensor],
    ops: Sequence[str],
) -> str | None:
    """Why the fused program's first step does not draw what the plain loop's draws, or
    None: ``eager`` and ``fused`` are the step's ``(loss, new buffers)``, and the random
    states after them must be bitwise equal (the same draws from the same generator).

    The loss and the buffers (BatchNorm statistics) are what the forward's draws decide:
    other masks change them far beyond rounding (by percents on a small transformer), the
    same masks by rounding only. The updated parameters are not compared: an update can
    magnify rounding alone far beyond any tolerance (Adam divides a gradient that is
    rounding noise, e.g. of attention's key bias, by its own size)."""
    what = ", ".join(ops) or "random ops"
    head = (
        f"loss_fn draws random numbers ({what}) and the fused program's first step did not "
        "draw what the plain loop draws"
    )
    tail = (
        "; a random op the compiled program runs otherwise than eager torch (another "
        "operation, or another layout of the tensor it fills) draws other numbers or puts "
        "them in other places. Pass mode='stepwise' to silence this warning."
    )
    if any(not torch.equal(a, b) for a, b in zip(rng_eager, rng_fused)):
        return f"{head} (the random state after it differs){tail}"
    pairs = [(torch.tensor(eager[0]), torch.tensor(fused[0]))]
    pairs += list(zip(eager[1], fused[1]))
    for a, b in pairs:
        a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-6, equal_nan=True):
            return f"{head} (the random state after it is the same, the loss or buffers not){tail}"
    return None


def check_draws(fit: Any, batch: tuple) -> bool | str:
    """Whether a `stepfuse.torch.Fit`'s program draws what the plain loop draws, for a
    ``loss_fn`` that draws random numbers (dropout): True, a fallback reason, or False
    where it cannot be checked on this call (a non-finite step: the call runs stepwise).

    The program's first step runs against an eager step from the same parameters, state,
    buffers and random state (after one eager step where torch has no optimizer state
    yet); the random states after them must be bitwise equal, their losses and buffers
    close (`draws_mismatch`). Everything is put back."""
    params = fit._params
    values, snap = [p.detach().clone() for p in params], snapshot(fit.optimizer, params)
    held = hold_buffers(fit._modules)
    cuda = cuda_devices([*params, *batch])
    try:
        with torch.random.fork_rng(devices=cuda):
            if not fit._state.ready():  # torch creates the state: one eager step first
                _, finite, token = fit._propose(batch)
                if not finite:
                    return False
                fit._commit(token, scheduled=False)  # (undone below: no lr_scheduler step)
                fit.step -= 1
            start = rng_states(cuda)
            at = hold_buffers(fit._modules)
            loss, finite, _ = fit._propose(batch)
            eager_rng = rng_states(cuda)
            eager_b = [b.detach().clone() for b in fit._buffers()]
            put_back(at)
            if not finite:
                return False
            set_rng_states(cuda, start)
            nan = torch.tensor(math.nan, dtype=fit._loss_dtype, device=params[0].device)
            out = fit._segment(1, 0, nan)
            fused_rng = rng_states(cuda)
    finally:
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
        restore(fit.optimizer, params, snap)
        put_back(held)
    eager = (float(loss), eager_b)
    fused = (float(out.carry.flow.last), list(out.carry.buffers))
    return draws_mismatch(eager, fused, eager_rng, fused_rng, fit._random_ops) or True


def draws_verified(fit: Any, batch: tuple) -> bool:
    """Whether a `stepfuse.torch.Fit`'s fused program may run this call: always for a
    ``loss_fn`` that draws nothing; else once `check_draws` found its program drawing as
    the plain loop does (a fallback where it does not)."""
    if fit.mode != "fused" or fit._random_ops is None:
        return True
    if fit._program_key in fit._verified:
        return True
    got = check_draws(fit, batch)
    if isinstance(got, str):
        fit._fall_back(got)
        return False
    if got:
        assert fit._program_key is not None
        fit._verified.add(fit._program_key)
    return got
