"""The contexts the fused program is traced and run under (`traceable`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["traceable"]


@contextlib.contextmanager
def traceable(rnn: bool) -> Iterator[None]:
    """Tracing and running the fused program: autograd's saved-tensor hooks as they were
    however it ends (`_saved_tensor_hooks_kept`), and with ``rnn`` recurrent layers made
    traceable (`_rnn_traceable`)."""
    with _saved_tensor_hooks_kept(), _rnn_traceable() if rnn else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _saved_tensor_hooks_kept() -> Iterator[None]:
    """Autograd's saved-tensor hooks as they were, however tracing ends: tracing
    ``torch.func.grad`` turns them off (as torch.func does while it runs), and a trace that
    fails (``torch.utils.checkpoint`` in the loss) left them off for the whole process,
    every later ``backward()`` of a checkpointed model included."""
    hooks: Any = torch._C._autograd  # (its stubs leave out `_saved_tensors_hooks_is_enabled`)
    enabled = hooks._saved_tensors_hooks_is_enabled()
    try:
        yield
    finally:
        if enabled and not hooks._saved_tensors_hooks_is_enabled():
            hooks._saved_tensors_hooks_enable()


def _rnn_flat_weights(self: nn.RNNBase) -> list[torch.Tensor | None]:
    return [getattr(self, n, None) for n in self._flat_weights_names]


@contextlib.contextmanager
def _rnn_traceable() -> Iterator[None]:
    """Recurrent layers (``nn.RNN``, ``LSTM``, ``GRU``) made traceable, as torch runs them
    eagerly on CPU.

    Their forward caches the current weights on the module (``_flat_weights``, refreshed
    when `functional_call` swaps them), a mutation dynamo refuses inside ``while_loop``:
    here the list is read from the module's parameters at each forward instead, which is
    what the cache holds. Dynamo traces RNNs only with ``allow_rnn``; torch's LSTM
    decomposition picks oneDNN's kernel when its input needs no gradient, whose backward
    cannot be traced under ``torch.func.grad``, so oneDNN is off here: the decomposition's
    composite cell is what eager CPU training runs."""
    base = nn.RNNBase
    saved = {k: base.__dict__[k] for k in ("_update_flat_weights", "__setattr__")}
    patch = {
        "_flat_weights": property(_rnn_flat_weights, lambda self, value: None),
        "_update_flat_weights": lambda self: None,
        "__setattr__": nn.Module.__setattr__,
    }
    for k, v in patch.items():
        setattr(base, k, v)
    try:
        with torch._dynamo.config.patch(allow_rnn=True), torch.backends.mkldnn.flags(enabled=False):
            yield
    finally:
        delattr(base, "_flat_weights")
        for k, v in saved.items():
            setattr(base, k, v)
