"""PyTorch backend: many ``torch.optim`` steps inside one compiled program.

``fuse(loss_fn, optimizer, steps=...)`` returns a `Fit`; ``fit(*batch)`` runs the steps
and updates the model's parameters and ``optimizer.state`` in place, so the model and
optimizer carry on with ordinary PyTorch afterwards.

The fused mode (CPU) is one ``torch.compile`` (inductor, C++ wrapper) of a ``while_loop``
whose body is a fixed chunk of ``chunk`` masked steps (`stepfuse.torch._program`); on
CUDA the chunk is captured in CUDA graphs (`stepfuse.torch._cuda`). ``mode="stepwise"``
runs the identical semantics with eager ``loss.backward(); optimizer.step()`` through
`stepfuse._core.run_stepwise` (the reference); it is also the fallback, with a warning
naming the reason (`stepfuse.torch._probe`), when the fused path cannot handle a model or
optimizer.

The modules by job: docs/internals/torch.md; here: `Fit` (setup, fallback policy, the
host driver of a call); `fuse` builds it (`stepfuse.torch._fuse`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from .._core import (
    Notifier,
    Options,
    Stop,
    Trace,
    check_call_steps,
    deferred_interrupts,
    exclusive,
    finish,
    host_trace,
    n_recorded,
    named_evals,
    next_multiple,
    run_stepwise,
)
from . import _changes, _cuda, _data, _eager, _eval, _plan, _program, _ranks
from ._draws import draws_verified
from ._failure import build_failure, prove
from ._probe import (
    GENERATORS,
    UNUSED,
    BatchError,
    Resolved,
    Trainable,
    batch_signature,
    check_params_unchanged,
    find_modules,
    hooks_reason,
    interrupt_inside,
    needs_closure,
    probe_loss,
    resolve,
    transient,
)
from ._rules import RULES, SUPPORTED_OPTIMIZERS, hyper, hyper_key, rates
from ._schedule import Schedule
from ._state import StateLayout, grads_kept, host_losses, put_back, restore

__all__ = ["Fit", "FusedFit", "BatchError", "SUPPORTED_OPTIMIZERS"]

_SEGMENT = 512  # at most this many steps per program call (see Fit._cap)
_GRAPH_CACHE = 4  # programs kept (per batch signature and hyper-parameters)
_BUILD_TRIES = 2  # a build that failed for a reason outside the model is tried again once


class Fit:
    """A fused fit: ``fit(*batch, steps=None)`` runs the optimizer steps, returns a `Trace`.

    Built by `fuse`. Parameters and ``optimizer.state`` are updated in place.

    Attributes:
      mode: ``"fused"`` or ``"stepwise"`` (the mode actually used: a fused fit that
        had to fall back reports ``"stepwise"`` and ``fallback_reason`` says why).
      compiles: how many programs were compiled so far (inductor compilations; on CUDA,
        one per build of the captured graphs). One compile serves every ``steps`` and
        every batch of the same shapes.
      step: updates applied since `fuse`.
    """

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer,
        opts: Options,
        model: nn.Module | None,
        chunk: int | None,
        clip: tuple[float | None, float | None] = (None, None),
        lr_scheduler: Any = None,
    ):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.opts = opts
        self._chunk = chunk  # as given to fuse (None: `_plan.choose` picks it)
        self.chunk = chunk if chunk is not None else 1
        self._plan: _plan.Plan | None = None
        self.step = 0
        self.compiles = 0
        self.fallback_reason: str | None = None
        self.mode = opts.mode
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._clip = clip
        self._random_ops: tuple[str, ...] | None = None  # set when loss_fn draws (dropout)
        self._verified: set[tuple] = set()  # programs whose first step drew as eagerly
        self._probed: dict[tuple, frozenset[int]] = {}  # batch signature -> unused parameters
        self._unused: frozenset[int] = frozenset()  # ids of those the call's loss leaves unused
        self._loss_dtype = torch.float32
        self._program: Any = None
        self._nans: dict[tuple, torch.Tensor] = {}
        self._submodules: list | None = None  # `_training`
        self._program_key: tuple | None = None
        self._captured: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._fed = _data.Fed((), torch.device("cpu"), 0, 0)  # the call's arguments (`__call__`)
        self._resolved: Resolved | None = None
        self._modules = [model] if model is not None else find_modules(loss_fn)
        self._rule = RULES.get(type(optimizer))
        self._train = self._params  # those that require grad (`_read_trainable`)
        self._mask = tuple(True for _ in self._params)
        self._state = self._layout()
        self._needs_closure = needs_closure(optimizer)
        self._sync: Any = None  # the average over ranks of a call (`_ranks.collective`)
        self._schedule = None if lr_scheduler is None else Schedule(lr_scheduler, optimizer)
        self._rows, self._row0 = np.zeros((0, 0)), 0  # `_ahead`
        if self.mode == "fused":
            got = resolve(
                loss_fn, optimizer, self._rule, self._modules, self._params, model is not None
            )
            if isinstance(got, str):
                self._fall_back(got)
            else:
                self._resolved = got
        self._rnn = self._resolved is not None and self._resolved.rnn
        self._evals = _eval.Evaluations(opts, self._modules) if opts.eval_fn else None
        if self._evals is not None and self.mode == "fused" and self._cuda:
            self._fall_back("eval_fn does not run inside the CUDA graphs yet.")
        if self._schedule is not None and self.mode == "fused" and self._cuda:
            self._fall_back("lr_scheduler: the CUDA graphs hold the lr as a constant.")

    def _layout(self) -> StateLayout:
        """The state layout of the parameters updated (torch skips the others)."""
        keys = self._rule.keys if self._rule else lambda g: ()
        return StateLayout(Trainable(self.optimizer, self._unused), self._train, keys)

    def _read_trainable(self) -> None:
        """The parameters updated now (requiring grad, with a gradient): a program for each set."""
        mask = tuple(p.requires_grad and id(p) not in self._unused for p in self._params)
        if mask != self._mask:
            self._mask = mask
            self._train = [p for p, m in zip(self._params, mask) if m]
            self._state = self._layout()

    def _buffers(self) -> list[torch.Tensor]:
        """The modules' buffers the fused program carries (`_program.Body.buffers`)."""
        assert self._resolved is not None
        return [self._resolved.wrapper.get_buffer(n) for n in self._resolved.buffers]

    def _fall_back(self, reason: str) -> None:
        self.mode, self.fallback_reason = "stepwise", reason
        text = f"stepfuse.torch: running mode='stepwise' instead of 'fused': {reason}"
        warnings.warn(text, RuntimeWarning, stacklevel=4)

    # -- building the fused program -------------------------------------------------------

    def _body(self, capturable: bool) -> _program.Body:
        """The loop body's plain values, read from the optimizer as it is now."""
        assert self._resolved is not None and self._rule is not None
        r = self._resolved
        return _program.Body(
            r.wrapper,
            tuple(n for n, m in zip(r.names, self._mask) if m),
            (*r.others, *(n for n, p in zip(r.names, self._params) if id(p) in self._unused)),
            self._rule.update,
            [(sl, keys, hyper(g)) for g, sl, keys in self._state.groups()],
            self.chunk,
            self.opts.record_every,
            self.opts.tol,
            len(self._train),
            capturable,
            _program.met_of(self.opts.tol, self._loss_dtype),
            r.buffers,
            *self._clip,
            self._rnn,
            self._fed.pick,
            sync=self._sync,
            evaluate=None if self._evals is None else self._evals.spec(self._cap),
            rates=0 if capturable else self._cap + self.chunk if self._schedule else 1,
        )

    def _compile(
        self,
        fn: Callable,
        kind: str,
        inductor_options: dict[str, Any],
        sink: list | None = None,
    ) -> Callable:
        """``torch.compile`` of ``fn`` with inductor, counting each compilation in `compiles`
        (``sink``: `_program.compile_fn`'s)."""

        def count() -> None:
            self.compiles += 1

        options = {**inductor_options, **(self._rule.inductor if self._rule else {})}  # Muon's
        return _program.compile_fn(fn, f"stepfuse_{kind}_{id(self):x}", options, count, sink)

    def _build(
        self,
        params: list[torch.Tensor],
        states: list[torch.Tensor],
        batch: tuple,
        prev: torch.Tensor,
    ) -> Any:
        """Build (compile / capture) the program for this batch and hyper-parameters."""
        buffers = [b.detach() for b in self._buffers()]
        if self._cuda:
            assert self._rule is not None
            s = _cuda.build_graphs(
                self._body(capturable=True),
                self._compile,
                self._rule.capturable,
                self._cap,
                params,
                states,
                buffers,
                batch,
                prev,
            )
            if not s.fused_kernels:
                self.compiles += 1  # the eager capture is this build's program
            return s
        cap, re, rnn, dev = self._cap, self.opts.record_every, self._rnn, prev.device
        program, run = _program.Program(self._body(False), self._compile, dev), _program.run_program
        # n=0: compiles without running a step; nothing changes. Then one step (and an
        # evaluation: due after it) whose results are dropped (`_failure.prove`).
        lrs = rates(self.optimizer.param_groups)
        run(program, cap, re, 0, 0, prev, params, states, buffers, tuple(batch), rnn, lrs)
        due = _eval.inputs(self._evals, self._fed.inputs(0), (self.opts.eval_every or 1) - 1, dev)
        prove(lambda: run(program, cap, re, 1, 0, prev, params, states, buffers, due, rnn, lrs))
        return program

    def _ensure_program(self) -> None:
        """Build (compile / capture) the fused program if needed; may fall back to stepwise.

        A program serves one set of hyper-parameters (they are compiled in) and one batch
        signature (shapes, dtypes, nesting, the streams' layout: `_data.Fed.key`); each new
        one builds its own program, the last `_GRAPH_CACHE` of them are kept (never dynamo's
        recompiles of one, which meet its recompile limit). A build that fails for a reason
        outside the model (`_probe.transient`) is tried again before the fit falls back; a
        fallback's reason holds the whole error.
        """
        sync = self._sync and self._sync.key
        hk = self._hyper_key(compiled=True)
        key: tuple = (hk, self._fed.key, self._mask, self._training(), sync)
        if self._evals is not None:  # a program per eval_batch signature too
            key = (*key, self._evals.key)
        if self._program is not None and self._program_key == key:
            return
        if key in self._captured:
            self._captured.move_to_end(key)
            self._program, self._program_key = self._captured[key], key
            return
        if self._program_key is not None and self._program_key[3] != key[3]:
            _changes.numbers_changed(self._submodules, self._program_key[3], key[3])
        if self._program_key is not None and self._program_key[0] != key[0]:
            _changes.hypers_changed(self._program_key[0], key[0])
        params = [p.detach() for p in self._train]
        states = self._state.tensors(placeholder=True)
        prev = torch.tensor(math.nan, dtype=self._loss_dtype, device=params[0].device)
        self._program = None
        for attempt in range(_BUILD_TRIES):
            try:
                self._program = self._build(params, states, self._inputs(0), prev)
                break
            except Exception as e:  # noqa: BLE001 - any compile failure means: run stepwise
                if isinstance(e, BatchError):  # (a minibatch's labels: the user's to fix)
                    raise
                interrupt = interrupt_inside(e)
                if interrupt is not None:  # Ctrl-C during the compile is the user's, not a failure
                    raise interrupt from None
                if attempt + 1 < _BUILD_TRIES and transient(e):
                    continue
                self._fall_back(build_failure(e))
                return
        self._program_key = key
        self._captured[key] = self._program
        while len(self._captured) > _GRAPH_CACHE:
            self._captured.popitem(last=False)

    def _training(self) -> tuple:
        """The modules' training flags and other Python numbers (a program is traced with
        them: dropout, BatchNorm, Dropout's ``p``; `_changes.module_numbers`)."""
        if self._submodules is None:  # the modules as the first program was built for
            self._submodules = _changes.watched(self._modules)
        return _changes.module_numbers(self._submodules)

    def _hyper_key(self, compiled: bool = False) -> tuple:
        """Every group's hyper-parameters; ``compiled``: those compiled into the fused
        program (on the CPU, all but ``lr``: an input, `_rules.rates`)."""
        return hyper_key(self.optimizer.param_groups, compiled and not self._cuda)

    @property
    def _cuda(self) -> bool:
        return torch.cuda.is_available() and self._params[0].is_cuda and self._rule is not None

    @property
    def _cap(self) -> int:
        # Steps per program call: the loop carries its loss buffer, which the compiled
        # body copies each step, so longer calls run as several program calls.
        return min(self.opts.steps, _SEGMENT)

    # -- one call ----------------------------------------------------------------------------

    @_ranks.collective
    def __call__(self, *batch: Any, steps: int | None = None, eval_batch: Any = None) -> Trace:
        """Run ``steps`` (default: the ``steps`` given to `fuse`) updates on ``batch``.

        Args:
          *batch: the arguments of ``loss_fn`` (tensors, `stepfuse.Batches`, `Epochs`), fed once.
          steps: updates of this call; any ``int >= 1`` reuses the same compiled program.
          eval_batch: with ``eval_fn``, its arguments (a tuple is the arguments, any other
            value one argument); new values of the same shapes reuse the compiled program.

        Returns:
          The call's `stepfuse.Trace` (losses before each update, updates applied, stop;
          ``trace.eval``: the evaluations, with ``eval_fn``).
        """
        with exclusive(self):  # one call at a time
            n = check_call_steps(steps, self.opts, capped=False)
            check_params_unchanged(self.optimizer, self._params)
            _changes.check_modules_unchanged(self)  # (fused: modules rearranged since)
            _eval.check_call(self._evals, eval_batch)  # eval_fn runs once per eval_batch signature
            self._fed = _data.Fed(batch, self._params[0].device, self.step, n, self.optimizer)
            self._read_trainable()
            r = self._resolved if self.mode == "fused" else None  # (stepwise: walk modules)
            with grads_kept(self._params, r and r.outside, self._modules):
                if self.mode == "fused":
                    reason = hooks_reason(self.optimizer, self._params, self._modules)
                    if reason is not None:
                        self._fall_back(f"{reason}; pass mode='stepwise' to silence this warning.")
                self._probe(self._fed.at(0))  # a step's own arguments (the first minibatch)
                _ranks.agree_setup(self, n)  # several ranks: the same call on each (`_ranks`)
                start = self.step
                self._ahead(n, 0, start)  # (with lr_scheduler: may run stepwise, then no compile)
                if self.mode == "fused":
                    self._ensure_program()
                _ranks.agree_mode(self)
                # A fit whose loss draws runs a call fused once its program drew as eagerly.
                eager = self.mode == "stepwise" or not draws_verified(self, self._fed.at(0))
                eager = _ranks.agree_eager(self, eager)
                # No snapshot to restore after an error: params, state and `step` change together
                # (`_commit`, after a program call); a failed step is undone where it ran.
                try:
                    trace = self._call_stepwise(n, start) if eager else self._call_fused(n, start)
                finally:
                    if self.step > start:  # what optimizer.step() tells an lr scheduler watching it
                        self.optimizer._opt_called = True  # type: ignore[attr-defined]
            return finish(trace, self.opts, start)

    def _probe(self, batch: tuple) -> None:
        """Check ``loss_fn`` on this batch once per batch signature (changes nothing); the
        parameters it leaves without a gradient are left out of the program."""
        sig = batch_signature(batch)
        if sig not in self._probed:
            self._probed[sig] = self._probe_new(batch)
        self._unused = self._probed[sig]
        self._read_trainable()

    def _probe_new(self, batch: tuple) -> frozenset[int]:
        """`_probe` on a new batch signature: the ids of the parameters it leaves unused."""
        grad = [p for p in self._params if p.requires_grad]
        got = probe_loss(self.loss_fn, grad, self._modules, batch)
        self._loss_dtype = got.dtype
        if self.mode == "fused" and (got.generators or all(got.unused)):
            self._fall_back(GENERATORS if got.generators else UNUSED)  # (`_probe`'s reasons)
        if (self._plan is None and self.mode == "fused") or (got.draws and self.chunk > 1):
            # With random draws (dropout) one step a chunk: see `_plan.choose`.
            self._plan = _plan.choose(
                self._chunk, self.loss_fn, self._modules, batch, self._rnn, got.draws, self._cuda
            )
            self.chunk = self._plan.chunk
        if got.draws:
            self._random_ops = (*(self._random_ops or ()), *got.random_ops)
        return frozenset(id(p) for p, u in zip(grad, got.unused) if u)

    @property
    def plan(self) -> dict[str, Any]:
        """How the fused program runs (`_plan.describe`): ``chunk`` and why, the step's size
        it was chosen from, whether calls run the compiled code directly, steps a call."""
        program = self._program
        direct = isinstance(program, _program.Program) and program.direct is not None
        return _plan.describe(self._plan, self.chunk, direct, self._cap)

    # stepwise: the optimizer's own step(), eagerly -------------------------------------------

    def _propose(self, batch: tuple) -> tuple[np.generic, bool, Any]:
        """One eager step proposed and undone: ``(loss, finite, token for _commit)``."""
        fit = (self.loss_fn, self.optimizer, self._params, self._modules, self._clip)
        return _eager.propose(*fit, self._needs_closure, batch, self._sync)

    def _commit(self, token: Any, scheduled: bool = True) -> None:
        """Apply a proposed step (``scheduled``: and step the ``lr_scheduler`` after it)."""
        new_p, new_s = token
        with deferred_interrupts(), torch.no_grad():  # parameters, state and step move together
            for p, v in zip(self._params, new_p):
                p.copy_(v)
            restore(self.optimizer, self._params, new_s)
            self.step += 1
            if self._schedule is not None and scheduled:  # optimizer.step(); scheduler.step()
                self._schedule.advance(1)

    def _call_stepwise(self, n: int, start: int) -> Trace:
        with Notifier(self.opts, start, n, "stepfuse.torch") as note:
            trace = run_stepwise(
                lambda: self._propose(self._fed.at(self.step - start)),  # the step's arguments
                self._commit,
                n,
                self.opts,
                start,
                note if self.opts.notify else None,
                None if self._evals is None else self._evals.evaluate,
            )
            note.done(trace.steps)
            return trace if self._evals is None else named_evals(trace, self._evals.empty())

    # fused: eager first step if the optimizer has no state yet, then program segments ------

    def _segment(self, n: int, i0: int, prev: torch.Tensor) -> _program.Result:
        """Up to ``n`` steps on the program, from step ``i0`` of the call (`_data.Fed`)."""
        params = [p.detach() for p in self._train]
        states = self._state.tensors(placeholder=False)
        buffers = [b.detach() for b in self._buffers()]
        re, b = self.opts.record_every, self._inputs(i0)
        if self._cuda:
            return _cuda.run_graphs(
                self._program, self.chunk, re, n, i0, prev, params, states, buffers, b
            )
        lrs = self._lrs(i0, n)  # each group's lr, or a row of them a step (`_ahead`)
        return _program.run_program(
            self._program, self._cap, re, n, i0, prev, params, states, buffers, b, self._rnn, lrs
        )

    def _ahead(self, m: int, i0: int, start: int) -> None:
        """With ``lr_scheduler``: the lr of each of the call's steps ``i0 .. i0 + m``, read
        now (`_schedule.Schedule.ahead`); a schedule that changes more than lr runs
        stepwise (mid-call: the call stops, its updates kept, as `_changes` does)."""
        if self._schedule is None or self.mode != "fused":
            return
        rows = self._schedule.ahead(m)
        if not isinstance(rows, str):
            self._rows, self._row0 = rows, i0
            return
        self._fall_back(rows)
        if i0:
            raise RuntimeError(
                f"stepfuse.torch: this call stopped after {self.step - start} applied updates "
                "(kept): the lr_scheduler runs stepwise from here (the warning says why). "
                "Call again: the next call runs it stepwise."
            )

    def _lrs(self, i: int, m: int) -> Any:
        """The lr of each group for the call's steps ``i .. i + m``: a row for the call, or
        with ``lr_scheduler`` a row a step (`_ahead`)."""
        if self._schedule is None:
            return rates(self.optimizer.param_groups)
        return self._rows[i - self._row0 : i - self._row0 + m]

    def _inputs(self, i0: int) -> tuple:
        """The program's batch from the call's step ``i0`` (and the evaluation's inputs)."""
        return _eval.inputs(self._evals, self._fed.inputs(i0), self.step, self._params[0].device)

    def _nan(self) -> torch.Tensor:
        """A NaN of the loss dtype on the device: the previous loss at a call's start (one
        tensor, kept: programs only read it)."""
        key = (self._loss_dtype, self._params[0].device)
        if self._nans.get(key) is None:
            self._nans[key] = torch.tensor(math.nan, dtype=key[0], device=key[1])
        return self._nans[key]

    def _call_fused(self, n: int, start: int) -> Trace:
        opts = self.opts
        re, every = opts.record_every, opts.every or 1
        losses: list[np.ndarray] = []
        evals: list[Any] = []  # each program call's (and the eager step's) evaluations
        stop, i = Stop.STEPS, 0
        dev = self._params[0].device
        prev = self._nan()
        with Notifier(opts, start, n, "stepfuse.torch") as note:
            notify = note if opts.notify else None
            if not self._state.ready():
                # torch creates the state lazily in step(); let it (exact init semantics).
                first = run_stepwise(
                    lambda: self._propose(self._fed.at(0)),
                    self._commit,
                    1,
                    dataclasses.replace(opts, steps=1, tol=None, record_every=1),
                    start,
                    notify,
                    None if self._evals is None else self._evals.evaluate,
                )
                evals.append(first.eval)
                losses.append(first.loss)  # float64 or float32, as the stepwise driver records it
                i, stop = 1, first.stop
                if first.steps:
                    prev = torch.tensor(float(first.loss[0]), dtype=self._loss_dtype, device=dev)
            while i < n and stop == Stop.STEPS:
                seg = min(n - i, self._cap, self._fed.room(i))  # one epoch's order a segment
                if notify is not None:  # end the segment where the next notification is due
                    seg = min(seg, next_multiple(self.step, every) - self.step)
                out = self._segment(seg, i, prev)
                stop, applied = Stop(int(out.code)), int(out.applied)
                flow = out.carry.flow
                evaluated = applied + (1 if stop == Stop.NONFINITE else 0)
                kept = n_recorded(i + evaluated, re) - n_recorded(i, re)
                losses.append(host_losses(out.carry.losses, kept))
                if self._evals is not None:
                    evals.append(self._evals.read(out.carry.evals))
                with deferred_interrupts():  # parameters, state and step move together
                    self._state.write_back(out.carry.params, out.carry.states)
                    if out.carry.buffers:
                        put_back(zip(self._buffers(), out.carry.buffers))
                    self.step += applied
                    if self._schedule is not None:
                        self._schedule.advance(applied)
                i += evaluated
                prev = flow.last
                if notify is not None and applied and self.step % every == 0:
                    notify(self.step, float(flow.last))
                    if i < n:  # the rest of the call runs what the callback changed
                        _changes.rekey_after_callback(self, start)
                        self._ahead(n - i, i, start)  # (lr set by hand: the scheduler reads it)
            note.done(self.step - start)
        loss = (
            losses[0] if len(losses) == 1 else np.concatenate(losses or [np.zeros(0, np.float32)])
        )
        ev = None if self._evals is None else self._evals.join(evals)
        return host_trace(loss, self.step - start, stop, re, ev)  # a copy of what it keeps

    def __repr__(self) -> str:
        return (
            f"Fit({type(self.optimizer).__name__}, steps={self.opts.steps}, "
            f"mode={self.mode!r}, compiles={self.compiles}, step={self.step})"
        )


FusedFit = Fit
"""The old name of `Fit`."""
