"""When a fused program fails: why it could not be built, in full, with what to change
where dynamo's words say what the model does (`build_failure`); the one step a new
program runs before it is kept (`prove`); a minibatch's index out of range found by the
program's bounds check, and what the call had applied before it (`index_error`)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch

from ._probe import BatchError

__all__ = ["build_failure", "error_text", "index_error", "prove"]


def prove(run: Callable[[], Any]) -> None:
    """``run()``: one step (and an evaluation) of a program just compiled, on the fit's
    inputs, its results dropped (the program returns them; nothing is written back), the
    random generators' states put back. A program that compiles but fails when it runs
    (inductor's own checks in its generated code: a channels-last convolution inside
    ``torch.cond`` failed its stride check, torch 2.13) fails in the build, where the fit
    falls back saying why, rather than in every call."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else []):
        run()


def build_failure(error: Exception) -> str:
    """The fallback reason for a fused program that could not be built: the whole error,
    its chain of causes included (torch wraps inductor's in dynamo's), never just its
    first line, so a failure that is not the model's (a full disk, a compiler killed by
    the OS) can be told from one that is."""
    text = error_text(error)
    hints = [hint for marks, hint in _BUILD_HINTS if any(m in text for m in marks)]
    return (
        f"the fused program could not be built: {text}\n"
        + "".join(f"What to change: {hint}\n" for hint in hints)
        + "(pass mode='stepwise' to silence this warning)"
    )


# Dynamo's words for what a user's model does, and what to do about it (`build_failure`).
_BUILD_HINTS = (
    (
        ("Attempted to mutate", "Unsafe side effect"),
        "forward assigns to a module attribute or buffer from Python (`self.count += 1` on "
        "a buffer rebinds it; spectral_norm's power iteration does the same). Update "
        "buffers in place (`self.count.add_(1)`, `self.ema.mul_(0.9).add_(...)`), as "
        "BatchNorm does; those run fused.",
    ),
    (
        ("might be modifying the input",),
        "an op writes into a parameter in place during forward (e.g. nn.Embedding with "
        "max_norm renormalises its weight). Drop the in-place write (clip in the loss, or "
        "use a parametrization) to fuse.",
    ),
    (
        ("Data-dependent branching", "Could not guard on data-dependent expression"),
        "forward branches or loops on a tensor's value (`if x.sum() > 0`, `while h.norm() > "
        "1`, a Python number from `.item()`; BatchNorm with momentum=None divides by the "
        "batches counted). Use torch.where, a fixed number of iterations, or a BatchNorm "
        "momentum, to fuse.",
    ),
    (
        ("Attempted to wrap sparse Tensor",),
        "the model makes sparse gradients (nn.Embedding(sparse=True)), which the fused "
        "program cannot take. Use sparse=False to fuse.",
    ),
)


def error_text(error: BaseException) -> str:
    """An error's whole text with its chain of causes: ``__cause__`` and also a context
    torch re-raised ``from None`` (dynamo's "RuntimeError when making fake tensor call"
    keeps torch's own error, the real cause, only there)."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    seen = {id(error)}
    cause = _cause_of(error)
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        inner = "".join(traceback.format_exception_only(type(cause), cause)).strip()
        if inner not in text:
            text += f"\n  caused by {inner}"
        cause = _cause_of(cause)
    return text


def _cause_of(error: BaseException) -> BaseException | None:
    return getattr(error, "inner_exception", None) or error.__cause__ or error.__context__


def index_error(e: RuntimeError, i0: int, n: int) -> BatchError:
    """A compiled kernel's bounds check as a `BatchError`: the probe checks a batch
    signature's first batch only, so a later batch's label out of range fails inside the
    program (inductor's "index out of bounds" in its generated code). The program's results
    are written back after it returns, so this program call (the call's steps ``i0`` ..
    ``i0 + n - 1``) changed nothing; the call's steps before ``i0`` were applied."""
    text = " ".join(str(e).split())
    cause = text[text.index("index out of bounds") :][:200]
    done = (
        f"The call's first {i0} step(s) were applied (fit.step counts them), as a plain loop "
        f"would have before failing; its steps {i0} to {i0 + n - 1}, where a minibatch "
        "failed, changed nothing."
        if i0
        else "Nothing was changed (the parameters, the optimizer and fit.step are as before "
        "the call)."
    )
    return BatchError(
        "`batch` holds an index out of range: the fused program's bounds check failed "
        f"({cause}). A class label >= the number of classes or a token id >= an "
        "embedding's size does this (eager torch raises IndexError there); check the "
        f"batch, e.g. assert int(y.max()) < classes. {done}"
    )
