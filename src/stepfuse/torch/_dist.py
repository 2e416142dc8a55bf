"""Several ranks: the gradients averaged over a ``torch.distributed`` process group at
every step, inside the fused program and in the eager steps, as
``DistributedDataParallel`` averages them.

With ``torch.distributed`` initialised and more than one rank in the group (the default
group, or the ``process_group`` of a ``DistributedDataParallel`` the loss calls), a fit
holds a `Sync`:

- `Sync.grads` runs inside the compiled loop body after each step's gradients: the
  gradients of each dtype, each multiplied by ``1 / world_size`` and concatenated with the
  step's loss (likewise scaled), go through one ``all_reduce`` (sum) of torch's functional
  collectives, which dynamo and inductor trace into the program. That is DDP's average
  (its reducer multiplies each gradient by ``1 / world_size`` into a bucket and
  all-reduces the bucket). The summed loss is the mean of the ranks' losses: where it is
  NaN/inf (some rank's loss was), the averaged gradients are made NaN, so every rank
  refuses the step (`stepfuse.Stop.NONFINITE`) at the same step.
- `Sync.buffers` runs before each step's forward where a DDP broadcasts its buffers
  (``broadcast_buffers`` / ``forward_sync_buffers``, the default): the buffers, viewed as
  bytes, go through one ``all_reduce`` (sum) to which only the group's rank 0 contributes
  its bytes and the others zeros, which is rank 0's bytes exactly (a broadcast; the
  functional ``broadcast`` cannot be called from inductor's C++ wrapper, ``all_reduce``
  can).
- `Sync.broadcast_eagerly` and `Sync.average_eagerly` do the same around the eager
  steps (``mode="stepwise"``, a fused call's first step), with ``dist.broadcast`` and
  ``dist.all_reduce``.

A DDP module is never run as DDP by the fit: its hooks do not compose with
``torch.func``, so `unwrapped` has the DDP call its ``module`` directly during a call,
and the `Sync` reproduces what DDP would do around it (the average, the buffers' broadcast,
``find_unused_parameters``, the parameters and buffers DDP is told to ignore). DDP's own
communication options that change the average (a comm hook, ``mixed_precision``, a
buffer comm hook) are refused with an error (`check_ddp`). Before anything runs, the ranks
agree on the call (`stepfuse.torch._ranks`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["Sync", "check_ddp", "ddp_modules", "group_of", "unwrapped"]


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _ddp_class() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch built without distributed support
        return None
    return DistributedDataParallel


def ddp_modules(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The ``DistributedDataParallel`` modules among ``modules`` and their submodules."""
    cls = _ddp_class()
    if cls is None:
        return []
    seen: dict[int, nn.Module] = {}
    for top in modules:
        for m in top.modules():
            if isinstance(m, cls):
                seen.setdefault(id(m), m)
    return list(seen.values())


def group_of(ddps: Sequence[nn.Module]) -> Any:
    """The process group whose ranks average the gradients: the DDP modules' group, or
    the default group; None when ``torch.distributed`` is not initialised."""
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        return None
    groups = {id(d.process_group): d.process_group for d in ddps}
    if len(groups) > 1:
        raise ValueError(
            f"the loss calls {len(ddps)} DistributedDataParallel modules over "
            f"{len(groups)} different process groups; a fit averages its gradients over "
            "one group. Wrap the model in one DistributedDataParallel, or build them over "
            "the same process_group (nothing was run or changed)."
        )
    if groups:
        return next(iter(groups.values()))
    return dist.distributed_c10d._get_default_group()


def check_ddp(ddp: Any) -> None:
    """Refuse DDP options that make its average something else than ``all_reduce`` sum /
    world size of the gradients (the fit computes that average itself)."""
    why = None
    if getattr(ddp, "_comm_hooks", None):
        why = "a communication hook (register_comm_hook) that replaces its all-reduce"
    elif getattr(ddp, "mixed_precision", None) is not None:
        why = "mixed_precision, which casts the gradients it reduces"
    elif hasattr(ddp, "buffer_hook"):
        why = "a buffer communication hook (_register_buffer_comm_hook)"
    if why is not None:
        raise ValueError(
            f"the model's DistributedDataParallel has {why}; a fused fit averages the "
            "gradients itself, as DDP does by default (all-reduce sum / world size at "
            "every step), so it would not run that hook. Build the DDP without it, or "
            "train with a plain loop (nothing was run or changed)."
        )


def _sync_buffers(ddp: Any) -> bool:
    """Whether DDP broadcasts its buffers from rank 0 before each forward."""
    return bool(getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True)))


@contextlib.contextmanager
def unwrapped(ddps: Sequence[Any]) -> Iterator[None]:
    """Have each DDP module's forward call its ``module`` directly (no reducer, no
    broadcast, no hooks of DDP's own) for as long as the context lasts."""
    if not ddps:
        yield
        return
    saved = [(d, d.__dict__.get("forward")) for d in ddps]
    for d in ddps:
        d.__dict__["forward"] = d.module.__call__
    try:
        yield
    finally:
        for d, old in saved:
            if old is None:
                d.__dict__.pop("forward", None)
            else:
                d.__dict__["forward"] = old


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return torch.zeros_like(p) if g is None else g


def _flat_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])


def _from_bytes(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut back into tensors shaped as ``like`` (`_flat_bytes` inverted)."""
    out, at = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(flat[at : at + n].clone().view(t.dtype).reshape(t.shape))
        at += n
    return out


class Sync:
    """The average over a process group's ranks, for one fit (see the module's doc).

    Attributes:
      group: the process group; ``world``: its size; ``rank``: this process's rank in it.
      key: what a compiled program holding this `Sync` is specialised to.
      exchange: the current call's agreement (`stepfuse.torch._ranks.Exchange`).
      checked: whether the ranks' parameters were found equal (the fit's first call).
    """

    def __init__(self, group: Any, modules: Sequence[nn.Module], ddps: Sequence[nn.Module]):
        dist = _dist()
        for d in ddps:
            check_ddp(d)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.src = dist.get_global_rank(group, 0)  # DDP's authoritative rank
        self.scale = 1.0 / self.world
        self.key = (group.group_name, self.world)
        self.exchange: Any = None
        self.checked = False
        self._ddps: list[Any] = list(ddps)
        self._modules = list(modules)
        self.ignored = {id(p) for p in self._ignored_params()}
        self.find_unused = {
            id(p): bool(d.find_unused_parameters or d.static_graph)
            for d in self._ddps
            for p in d.module.parameters()
        }
        self.ignored_names: frozenset[str] = frozenset()
        self.bcast_names: frozenset[str] = frozenset()

    def _ignored_params(self) -> list[torch.Tensor]:
        return [
            p
            for d in self._ddps
            for n, p in d.module.named_parameters()
            if n in d.parameters_to_ignore
        ]

    def _bcast_buffers(self) -> list[torch.Tensor]:
        """The buffers DDP broadcasts before a forward (read afresh: they may be reassigned)."""
        return [
            b
            for d in self._ddps
            if _sync_buffers(d)
            for n, b in d.module.named_buffers()
            if n not in d.parameters_to_ignore
        ]

    def bind(self, wrapper: nn.Module, device: torch.device) -> None:
        """Name what the program averages and broadcasts, by the names ``wrapper`` (the
        module the program calls) gives the tensors; before any tracing."""
        ignored = self.ignored
        self.ignored_names = frozenset(
            n for n, p in wrapper.named_parameters(remove_duplicate=False) if id(p) in ignored
        )
        bcast = {id(b) for b in self._bcast_buffers()}
        self.bcast_names = frozenset(
            n for n, b in wrapper.named_buffers(remove_duplicate=False) if id(b) in bcast
        )

    # -- inside the compiled program (traced) -----------------------------------------------

    def buffers(self, body: Any, bs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``bs`` (the carried buffers, named ``body.buffers``) with those DDP broadcasts
        replaced by rank 0's: what each rank's forward starts from."""
        import torch.distributed._functional_collectives as fc

        idx = [i for i, n in enumerate(body.buffers) if n in self.bcast_names]
        if not idx:
            return list(bs)
        idx.sort(key=lambda i: -bs[i].element_size())  # each piece stays aligned
        flat = _flat_bytes([bs[i] for i in idx])
        if self.rank != 0:  # each rank compiles its own program: a constant in it
            flat = torch.zeros_like(flat)
        flat = fc.all_reduce(flat, "sum", self.group)
        out = list(bs)
        for i, t in zip(idx, _from_bytes(flat, [bs[i] for i in idx])):
            out[i] = t
        return out

    def grads(
        self, body: Any, grads: Sequence[torch.Tensor], loss: torch.Tensor
    ) -> list[torch.Tensor]:
        """The gradients (of the parameters named ``body.names``) averaged over the ranks,
        NaN wherever some rank's loss is NaN/inf (that step is refused on every rank)."""
        import torch.distributed._functional_collectives as fc

        buckets: dict[torch.dtype, list[int]] = {}
        for i, n in enumerate(body.names):
            if n not in self.ignored_names:
                buckets.setdefault(grads[i].dtype, []).append(i)
        mean_loss = None
        reduced = []
        for dtype, idx in buckets.items():
            parts = [grads[i].reshape(-1) * self.scale for i in idx]
            with_loss = mean_loss is None and dtype == loss.dtype
            if with_loss:
                parts.append(loss.reshape(1) * self.scale)
            flat = fc.all_reduce(torch.cat(parts), "sum", self.group)
            if with_loss:
                mean_loss = flat[-1]
            reduced.append((idx, flat))
        if mean_loss is None:
            mean_loss = fc.all_reduce(loss.reshape(1) * self.scale, "sum", self.group)[0]
        ok = torch.isfinite(mean_loss)
        out = list(grads)
        for idx, flat in reduced:
            flat = torch.where(ok, flat, math.nan)
            at = 0
            for i in idx:
                n = grads[i].numel()
                out[i] = flat[at : at + n].reshape(grads[i].shape)
                at += n
        return out

    # -- around the eager steps -----------------------------------------------------------

    def broadcast_eagerly(self) -> None:
        """Before an eager forward: DDP's broadcast of its buffers from rank 0."""
        bufs = sorted(self._bcast_buffers(), key=lambda b: -b.element_size())
        if not bufs:
            return
        flat = _flat_bytes(bufs).clone()
        _dist().broadcast(flat, src=self.src, group=self.group)
        with torch.no_grad():
            for b, v in zip(bufs, _from_bytes(flat, bufs)):
                b.copy_(v)

    def average_eagerly(self, params: Sequence[torch.Tensor], loss: torch.Tensor) -> None:
        """After an eager backward: every ``p.grad`` averaged over the ranks (a parameter
        without a gradient on any rank keeps none, as DDP with ``find_unused_parameters``
        leaves it), all NaN wherever some rank's loss is NaN/inf."""
        dist = _dist()
        avg = [p for p in params if p.requires_grad and id(p) not in self.ignored]
        if not avg:
            return
        for p in avg:
            if p.grad is not None and p.grad.layout != torch.strided:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} has a {p.grad.layout} gradient; "
                    "a fit over several ranks averages dense gradients only. Use a dense "
                    "layer (e.g. nn.Embedding(sparse=False)) (nothing was applied)."
                )
        dev = avg[0].device
        meta = torch.tensor(
            [float(p.grad is not None) for p in avg] + [0.0], dtype=torch.float64, device=dev
        )
        meta[-1] = loss.detach().to(torch.float64) * self.scale
        buckets: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(avg):
            buckets.setdefault(p.dtype, []).append(i)
        flats = []
        for idx in buckets.values():
            parts = [_grad_or_zeros(avg[i]).reshape(-1) * self.scale for i in idx]
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=self.group)
            flats.append((idx, flat))
        dist.all_reduce(meta, group=self.group)
        ok = bool(torch.isfinite(meta[-1]))
        for idx, flat in flats:
            if not ok:
                flat.fill_(math.nan)
            at = 0
            for i in idx:
                p, n = avg[i], avg[i].numel()
                p.grad = flat[at : at + n].view_as(p) if meta[i] > 0 else None
                at += n
