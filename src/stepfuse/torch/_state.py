"""The optimizer state's layout: snapshots, and the flat tensors the fused program carries.

``torch.optim`` keeps a dict of tensors per parameter, created lazily by the first
``step()``. The fused program carries them flattened in the order (group, key,
parameter), which `StateLayout` defines once: `StateLayout.tensors` reads them in that
order and `StateLayout.write_back` puts a program's results back in place, so the
optimizer carries on with ordinary PyTorch afterwards.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ._rules import held as _held
from ._rules import placeholder as _placeholder

__all__ = [
    "Held",
    "StateLayout",
    "all_finite",
    "grads_kept",
    "host_loss",
    "host_losses",
    "put_back",
    "restore",
    "snapshot",
]

Snapshot = dict[torch.Tensor, dict[str, Any]]


def snapshot(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> Snapshot:
    """A copy of ``opt.state`` of ``params`` (the stepwise mode and after errors)."""
    snap = {}
    for p in params:
        if p in opt.state:
            snap[p] = {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                for k, v in opt.state[p].items()
            }
    return snap


def restore(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], snap: Snapshot) -> None:
    """Make ``opt.state`` of ``params`` equal ``snap``, in place where tensors line up."""
    for p in params:
        if p not in snap:
            if p in opt.state:
                del opt.state[p]
            continue
        cur = opt.state[p]
        for k in [k for k in cur if k not in snap[p]]:
            del cur[k]
        for k, v in snap[p].items():
            old = cur.get(k)
            if (
                isinstance(v, torch.Tensor)
                and isinstance(old, torch.Tensor)
                and old.shape == v.shape
                and old.dtype == v.dtype
                and old.device == v.device
            ):
                old.copy_(v)
            else:
                cur[k] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


class Held(list):
    """``(buffer, copy)`` pairs (`stepfuse.torch._probe.hold_buffers`), and per module its
    buffer objects and its attributes that are Python numbers: a forward pass that
    assigns a new tensor to a buffer (``self.ema = 0.9 * self.ema + ...``) or counts in a
    Python attribute (``self.calls += 1``) is undone by `put_back` too."""

    def __init__(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()):
        super().__init__(pairs)
        self.modules: list[tuple[Any, dict, dict]] = []


@contextlib.contextmanager
def grads_kept(
    params: Sequence[torch.Tensor], outside: Sequence[torch.Tensor] | None, modules: Any
) -> Iterator[None]:
    """Inside: the ``.grad`` of the optimizer's ``params`` and of the modules' other
    parameters (``outside``, found once per module tree; ``None``: walk ``modules``) set
    to ``None``; after, however it ends, each put back, the very tensor it was. A call's
    eager steps and checks run ``backward``, which would add their gradients into a
    parameter the optimizer does not hold (a GAN discriminator's under the generator's
    fit), into the tensor the user's ``.grad`` is."""
    if outside is None:
        outside = [p for m in modules for p in m.parameters()]
    unique = {id(p): p for p in (*params, *outside)}.values()  # (each once: a tied weight)
    kept = [(p, p.grad) for p in unique]
    for p, g in kept:
        if g is not None:
            p.grad = None
    try:
        yield
    finally:
        for p, g in kept:
            p.grad = g


def put_back(held: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(tensor, saved)`` pair's saved value back into the tensor (and with a
    `Held`, each module's buffer objects and number attributes as they were)."""
    for module, buffers, plain in getattr(held, "modules", ()):
        for name, b in buffers.items():
            if module._buffers.get(name) is not b:
                module._buffers[name] = b
        for name, v in plain.items():
            if module.__dict__.get(name, v) is not v:
                module.__dict__[name] = v
    with torch.no_grad():
        for b, v in held:
            b.copy_(v)


def host_loss(loss: torch.Tensor) -> np.generic:
    """A loss as a NumPy scalar for the stepwise driver: float64 stays float64, any other
    float (float16 and bfloat16 too, exactly) is a float32, as in the fused trace."""
    return np.float64(loss.item()) if loss.dtype == torch.float64 else np.float32(loss.item())


def all_finite(tensors: Iterable[Any]) -> bool:
    """Whether every float tensor is finite (a sparse one: its stored values)."""
    return all(
        bool(torch.isfinite(_values(t)).all())
        for t in tensors
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    )


def _values(t: torch.Tensor) -> torch.Tensor:
    if t.layout == torch.strided:
        return t
    return (
        t.coalesce().values() if t.is_sparse else t.values()
    )  # COO (nn.Embedding(sparse=True)), CSR ...


class StateLayout:
    """The optimizer state of ``params`` flattened in the order (group, key, parameter).

    ``keys_of(group)`` names the state keys of a group (the update rule's, `Rule.keys`).
    Read from the optimizer as it is now at every call, so a changed group is seen;
    ``optimizer`` may be a view of one (`stepfuse.torch._probe.Trainable`).
    """

    def __init__(
        self,
        optimizer: Any,
        params: Sequence[torch.Tensor],
        keys_of: Callable[[dict], tuple[str, ...]],
    ):
        self.optimizer, self.params, self.keys_of = optimizer, params, keys_of

    def groups(self) -> list[tuple[dict, slice, tuple[str, ...]]]:
        """[(group, slice of params, keys)] for the optimizer as it is now (each group as
        torch.optim holds it: its hyper-parameters; ``params[slice]`` are its parameters
        that require grad)."""
        out, start = [], 0
        for g in self.optimizer.param_groups:
            n = sum(1 for p in g["params"] if p.requires_grad)
            out.append((g, slice(start, start + n), self.keys_of(g)))
            start += n
        return out

    def ready(self) -> bool:
        """Whether torch has created every state tensor the layout names (its first step ran)."""
        st = self.optimizer.state
        return all(
            k in st.get(p, {})
            for _g, sl, keys in self.groups()
            for p in self.params[sl]
            for k in keys
            if _held(self.optimizer, k, p)
        )

    def tensors(self, placeholder: bool) -> list[torch.Tensor]:
        """The optimizer state flattened (group, key, param); zeros where not yet created
        if ``placeholder`` (a program built before the first step), else an error."""
        out = []
        for g, sl, keys in self.groups():
            for k in keys:
                for p in self.params[sl]:
                    v = self.optimizer.state[p].get(k) if p in self.optimizer.state else None
                    if not _held(self.optimizer, k, p):  # a key this parameter never has
                        v = _placeholder(self.optimizer, k, p, g)  # (empty: Adafactor's)
                    elif v is None:
                        if not placeholder:
                            raise RuntimeError("optimizer state missing")
                        # shaped, typed and placed as torch creates it (0-dim `step`, ASGD's
                        # `eta` / `mu`, NAdam's `mu_product`; the rest like the parameter),
                        # so the program compiled now serves the state torch creates next
                        v = _placeholder(self.optimizer, k, p, g)
                    out.append(v)
        return out

    def write_back(self, params: Sequence[torch.Tensor], states: Sequence[torch.Tensor]) -> None:
        """Copy a program's parameters and flat state into the model and optimizer, in place."""
        with torch.no_grad():
            for p, v in zip(self.params, params):
                p.copy_(v)
            i = 0
            for g, sl, keys in self.groups():
                for k in keys:
                    for p in self.params[sl]:
                        cur = self.optimizer.state[p]
                        if not _held(self.optimizer, k, p):
                            pass
                        elif isinstance(cur.get(k), torch.Tensor):
                            cur[k].copy_(states[i])
                        else:
                            like = _placeholder(self.optimizer, k, p, g)
                            cur[k] = states[i].detach().to(like.device).clone()
                        i += 1


def host_losses(buf: torch.Tensor, kept: int) -> np.ndarray:
    """The first ``kept`` losses of a program's loss buffer on the host: float64 stays,
    any other float (bfloat16 too) as float32 (a CPU buffer of either is read in place:
    `stepfuse._core.host_trace` copies what it keeps)."""
    if buf.device.type == "cpu" and buf.dtype in (torch.float32, torch.float64):
        return buf.numpy()[:kept]
    wide = buf.dtype == torch.float64
    return buf[:kept].detach().to("cpu", torch.float64 if wide else torch.float32).numpy()
