"""The ranks of a process group agreeing on a fit's call before it runs anything.

Every step of a fit over several ranks runs collectives (`stepfuse.torch._dist.Sync`),
so every rank must run the same program the same number of times: the same ``steps``,
batch shapes, chunks, segments (callbacks), mode, and the same parameters to start
from. A call's ranks agree in up to three exchanges through the process group's store
(`Exchange`: each rank writes what it found, reads the others', with the store's timeout,
so a rank that never comes is an error, not a hang):

1. `agree_setup`, after the loss is probed and before anything is built: the call's
   settings (a difference is a ``ValueError`` naming it, raised on every rank), the
   parameters the batch's loss leaves unused (a parameter is left out only where every
   rank leaves it unused), whether the loss draws random numbers, and on the fit's first
   call a digest of each parameter.
2. `agree_mode`, after the program is built: a rank that had to fall back to stepwise
   makes every rank fall back (saying which rank and why).
3. `agree_eager`, for a loss that draws random numbers: whether the program drew as the
   plain loop draws, on every rank.

An exception on one rank before its steps start (a bad argument, a failed check) is
written to the exchanges the others wait on: they raise a `RankError` naming the rank
and its error, and nothing runs anywhere. The decorator `collective` wraps `Fit.__call__`
for this, and has the DDP modules call their ``module`` during the call
(`stepfuse.torch._dist.unwrapped`).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import json
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._dist import Sync, ddp_modules, group_of, unwrapped
from ._probe import batch_signature

__all__ = ["Exchange", "RankError", "agree_eager", "agree_mode", "agree_setup", "collective"]

_PHASES = (1, 2, 3)
_SEQ: dict[str, itertools.count] = {}  # calls per process group, the same on every rank
_SYNCS: weakref.WeakKeyDictionary[Any, Sync] = weakref.WeakKeyDictionary()
_DDPS: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], list]] = weakref.WeakKeyDictionary()


class RankError(RuntimeError):
    """Another rank of the process group failed before the call's steps (its error is
    in the message); nothing ran on this rank either."""


class Exchange:
    """One call's exchanges between the ranks of ``group``, through its store.

    ``share(phase, info)`` writes this rank's ``info`` (JSON) and returns every rank's,
    in rank order, raising a `RankError` where another rank wrote an error instead;
    ``fail(error)`` writes ``error`` to every exchange of the call not shared yet."""

    def __init__(self, group: Any, rank: int, world: int):
        import torch.distributed as dist

        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = rank, world
        name = group.group_name
        self.seq = next(_SEQ.setdefault(name, itertools.count()))
        self.prefix = f"stepfuse/{name}"
        self.shared: set[int] = set()
        timeout = getattr(self.store, "timeout", None)
        self.timeout = (
            timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(minutes=30)
        )

    def _key(self, seq: int, phase: int, rank: int) -> str:
        return f"{self.prefix}/{seq}/{phase}/{rank}"

    def share(self, phase: int, info: dict[str, Any]) -> list[dict[str, Any]]:
        self.shared.add(phase)
        self.store.set(self._key(self.seq, phase, self.rank), json.dumps(info))
        keys = [self._key(self.seq, phase, r) for r in range(self.world)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception as e:  # noqa: BLE001 - the store's timeout, whatever its class
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise RankError(
                f"stepfuse.torch: rank(s) {missing} of the process group did not reach "
                f"this call of the fit within {self.timeout} (rank {self.rank} waited; "
                f"{type(e).__name__}: {e}). Every rank must call the fit at the same point "
                "(nothing was run or changed on this rank)."
            ) from None
        got = [json.loads(v) for v in self.store.multi_get(keys)]
        for r, g in enumerate(got):
            if "error" in g and r != self.rank:
                raise RankError(
                    f"stepfuse.torch: rank {r} of the process group failed before this "
                    f"call's steps, so this rank stops too (nothing was run or changed): "
                    f"{g['error']}"
                )
        return got

    def fail(self, error: BaseException) -> None:
        """Tell the other ranks (those waiting in an exchange of this call) about ``error``."""
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        for phase in _PHASES:
            if phase not in self.shared:
                try:
                    self.store.set(
                        self._key(self.seq, phase, self.rank), json.dumps({"error": text})
                    )
                except Exception:  # noqa: BLE001 - the store is gone: nothing to tell
                    return

    def close(self) -> None:
        """Delete this rank's keys of two calls ago: by now every rank has read them
        (each rank wrote the last call's keys after reading those)."""
        if self.seq < 2:
            return
        for phase in _PHASES:
            try:
                self.store.delete_key(self._key(self.seq - 2, phase, self.rank))
            except Exception:  # noqa: BLE001 - a store without delete: keys stay
                return


def collective(call: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `Fit.__call__`: over several ranks, set ``fit._sync`` for the call (with a
    new `Exchange`) and tell the other ranks about an error raised before the steps; in
    any case, have the DDP modules call their ``module`` for the call's length."""

    @functools.wraps(call)
    def wrapper(fit: Any, *batch: Any, **options: Any) -> Any:
        ddps = _ddps_of(fit)
        if any(not d.require_backward_grad_sync for d in ddps):
            raise ValueError(
                "stepfuse.torch: the fit is called inside DistributedDataParallel.no_sync(), "
                "where a plain loop averages no gradients (each rank steps on its own), and "
                "the fit averages them at every step, as DDP does outside it. Call the fit "
                "outside no_sync() (nothing was run or changed); to accumulate gradients over "
                "micro-batches, call no_sync() inside loss_fn, as the plain loop would."
            )
        group = group_of(ddps)
        if group is None or torch.distributed.get_world_size(group) == 1:
            fit._sync = None
            if not ddps:
                return call(fit, *batch, **options)
            with unwrapped(ddps):
                return call(fit, *batch, **options)
        import torch.distributed as dist

        exchange = Exchange(group, dist.get_rank(group), dist.get_world_size(group))
        try:
            sync = _SYNCS.get(fit)
            if sync is None or sync.group is not group:
                sync = Sync(group, fit._modules, ddps)
                _SYNCS[fit] = sync
            if fit._resolved is not None:
                sync.bind(fit._resolved.wrapper, fit._params[0].device)
            sync.exchange = exchange
            fit._sync = sync
            with unwrapped(ddps):
                return call(fit, *batch, **options)
        except BaseException as e:
            exchange.fail(e)
            raise
        finally:
            exchange.close()

    return wrapper


def _ddps_of(fit: Any) -> list:
    """The DDP modules of the fit's modules (found once per set of modules)."""
    ids = tuple(id(m) for m in fit._modules)
    held = _DDPS.get(fit)
    if held is None or held[0] != ids:
        held = (ids, ddp_modules(fit._modules))
        _DDPS[fit] = held
    return held[1]


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data, devices by type only (each rank has its own GPU)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.device):
        return value.type
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _digest(t: torch.Tensor) -> str:
    data = t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


# field -> how to fix a difference between ranks
_FIXES = {
    "steps": "Pass the same steps on every rank: the gradients are averaged at every step.",
    "batch": (
        "Give every rank a shard of the same shapes and dtypes (e.g. equal shards, as "
        "DistributedSampler(drop_last=True) gives them)."
    ),
    "fit.step": (
        "Every rank's fit must have applied the same number of updates (resume every "
        "rank from the same checkpoint)."
    ),
    "parameters": "Build the same model and optimizer on every rank.",
    "hyper-parameters": "Give every rank's optimizer the same hyper-parameters.",
    "optimizer state": "Every rank's optimizer must have taken the same steps.",
    "chunk": "Pass the same chunk to fuse on every rank.",
    "fuse steps": "Pass the same steps to fuse on every rank.",
    "callback every": "Give every rank the same callback / every / progress settings.",
    "mode": "Pass the same mode to fuse on every rank.",
}


def _differs(got: Sequence[dict[str, Any]], field: str) -> None:
    values = [g[field] for g in got]
    if all(v == values[0] for v in values):
        return
    shown = ", ".join(f"rank {r}: {json.dumps(v)}"[:200] for r, v in enumerate(values))
    raise ValueError(
        f"`{field}` differs between the ranks of the process group ({shown}). "
        f"{_FIXES[field]} (Nothing was run or changed on any rank.)"
    )


def agree_setup(fit: Any, n: int) -> None:
    """The call's first exchange (see the module's doc); nothing without several ranks."""
    sync: Sync | None = fit._sync
    if sync is None:
        return
    opts = fit.opts
    if opts.tol is not None:
        raise ValueError(
            f"`tol` must be None for a fit over {sync.world} ranks; got {opts.tol!r} "
            "(float). Each rank's loss is its own shard's, so a test of it would stop the "
            "ranks at different steps while every step averages the gradients over all of "
            "them. Pass tol=None (nothing was run or changed)."
        )
    if fit._needs_closure:
        raise ValueError(
            f"`optimizer` {type(fit.optimizer).__name__} re-evaluates the loss a number "
            "of times that each rank decides from its own loss, so the ranks would average "
            "different numbers of gradients; a fit over several ranks cannot run it. Use "
            "another optimizer (nothing was run or changed)."
        )
    batch = fit._fed.at(0)
    sig = batch_signature(batch)
    unused = [id(p) in fit._unused for p in fit._params]
    info = {
        "steps": n,
        "batch": _plain(fit._fed.key),
        "fit.step": fit.step,
        "parameters": [[list(p.shape), str(p.dtype)] for p in fit._params],
        "hyper-parameters": _plain(fit._hyper_key()),
        "optimizer state": fit._state.ready(),
        "chunk": fit.chunk,
        "fuse steps": opts.steps,
        "callback every": [opts.notify, opts.every],
        "mode": opts.mode,
        "unused": unused,
        "draws": fit._random_ops is not None,
        "digest": None if sync.checked else [_digest(p) for p in fit._params],
    }
    got = sync.exchange.share(1, info)
    if any(g["draws"] for g in got):  # every rank's program runs one step per iteration
        fit.chunk = 1
        if fit._random_ops is None:
            fit._random_ops = ()
    for field in _FIXES:
        if field != "chunk" or all(g["draws"] == got[0]["draws"] for g in got):
            _differs(got, field)
    if not sync.checked:
        _check_digests(fit, got)
        sync.checked = True
    _agree_unused(fit, sync, got, sig)
    if fit.mode == "fused" and fit._params[0].is_cuda:
        fit._fall_back(
            f"a fit over {sync.world} ranks on CUDA runs its steps eagerly: the fused "
            "CUDA-graph program has no gradient average over ranks yet (the fused CPU "
            "program has)"
        )


def _check_digests(fit: Any, got: Sequence[dict[str, Any]]) -> None:
    names = fit._resolved.names if fit._resolved is not None else None
    for i, p in enumerate(fit._params):
        ranks = [r for r, g in enumerate(got) if g["digest"][i] != got[0]["digest"][i]]
        if ranks:
            what = f"`{names[i]}`" if names else f"parameter {i} (shape {tuple(p.shape)})"
            raise ValueError(
                f"the parameters differ between the ranks of the process group: {what} of "
                f"rank(s) {ranks} differs from rank 0's. Every rank must start from the same "
                "values, as the gradients are averaged: seed every rank alike, load the "
                "same checkpoint, or wrap the model in DistributedDataParallel, which "
                "copies rank 0's at construction (nothing was run or changed)."
            )


def _agree_unused(fit: Any, sync: Sync, got: Sequence[dict[str, Any]], sig: tuple) -> None:
    """Leave a parameter out of the program only where every rank's loss leaves it
    unused; refuse, as DDP would, one that some rank leaves unused in a DDP without
    ``find_unused_parameters``."""
    unused = [all(g["unused"][i] for g in got) for i in range(len(fit._params))]
    somewhere = [any(g["unused"][i] for g in got) for i in range(len(fit._params))]
    names = fit._resolved.names if fit._resolved is not None else None
    strict = [
        (names[i] if names else f"parameter {i}")
        for i, p in enumerate(fit._params)
        if somewhere[i] and p.requires_grad and not sync.find_unused.get(id(p), True)
    ]
    if strict:
        ranks = sorted({r for r, g in enumerate(got) for i in range(len(unused)) if g["unused"][i]})
        raise ValueError(
            f"the loss leaves {', '.join(strict[:5])} without a gradient on rank(s) {ranks}, "
            "and the model's DistributedDataParallel was built with "
            "find_unused_parameters=False, with which DDP itself fails at the next step. "
            "Pass find_unused_parameters=True to DDP (nothing was run or changed)."
        )
    agreed = frozenset(id(p) for p, u in zip(fit._params, unused) if u)
    if agreed != fit._unused:
        fit._probed[sig] = agreed
        fit._unused = agreed
        fit._read_trainable()


def agree_mode(fit: Any) -> None:
    """The call's second exchange: every rank runs stepwise if one has to."""
    sync: Sync | None = fit._sync
    if sync is None:
        return
    got = sync.exchange.share(2, {"mode": fit.mode, "reason": fit.fallback_reason})
    _follow(fit, got)


def agree_eager(fit: Any, eager: bool) -> bool:
    """The third exchange, for a loss that draws random numbers: whether every rank runs
    this call's steps on the program (`stepfuse.torch._draws.check_draws`)."""
    sync: Sync | None = fit._sync
    if sync is None or fit._random_ops is None:
        return eager
    got = sync.exchange.share(3, {"eager": eager, "mode": fit.mode, "reason": fit.fallback_reason})
    _follow(fit, got)
    return fit.mode == "stepwise" or any(g["eager"] for g in got)


def _follow(fit: Any, got: Sequence[dict[str, Any]]) -> None:
    if fit.mode != "fused":
        return
    for r, g in enumerate(got):
        if g["mode"] != "fused":
            fit._fall_back(f"rank {r} of the process group runs stepwise ({g['reason']})")
            return
