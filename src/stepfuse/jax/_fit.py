"""`Fit`, what `fuse` returns: a call's host side around the fused program (`_program`)
or the stepwise reference, and the notifications the loop sends the host."""

from __future__ import annotations

import contextlib
import struct
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._core import (
    CallbackErrors,
    Notifier,
    Options,
    Stop,
    Trace,
    check_call_steps,
    check_eval_batch,
    fail,
    finish,
    host_trace,
    named_evals,
    paced_every,
    run_stepwise,
    with_state,
)
from . import _data, _host, _program
from ._checks import (
    Loss,
    check_lookahead,
    check_model_state,
    check_opt_state,
    check_params,
    loss_params,
)
from ._eval import Evaluation, host_eval_trace, traced_eval_trace
from ._state import FitState, replicated_like
from ._step import Proposal, plan, propose
from ._transforms import inside_a_trace, spans_devices, wants_reverse_mode

__all__ = ["Fit", "FitState"]

# A progress bar alone is drawn about ten times a second, so the loop need not reach the
# host at every multiple of `every`: it does so at a multiple of `every` about this far
# apart, judged by the previous call's speed (each host call, and the split of the loop
# it makes, costs time; see docs/internals/jax.md).
_DRAW_SECONDS = 0.1


class Fit:
    """A fused fit built by `fuse`: ``init(params)`` (``init(params, model_state)`` with
    ``has_state=True``) then ``state, trace = fit(state, *batch)``.

    Attributes:
      mode: ``"fused"`` or ``"stepwise"``, the mode the fit runs in (JAX has no fallback:
        the ``mode`` given to `fuse`).
      compiles: how many times the fit has traced (and so compiled) its program: the
        fused program, or in the stepwise mode its one step (and its evaluation, with
        ``eval_fn``). One serves every ``steps=n`` up to the built ``steps`` and every
        batch and ``eval_batch`` of the same shapes.
      opts: the validated shared options.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        opts: Options,
        has_aux: bool,
        differentiable: bool,
        compiler_options: dict[str, Any] | None = None,
        has_state: bool = False,
    ):
        self.loss_fn, self.optimizer, self.opts = loss_fn, optimizer, opts
        self.has_aux, self.differentiable, self.has_state = has_aux, differentiable, has_state
        self.mode: str = opts.mode
        self.compiles = 0
        self.compiler_options = dict(compiler_options or {})
        # (no `compiler_options` argument at all without options: older jax.jit has none)
        jit_options: dict[str, Any] = (
            {"compiler_options": self.compiler_options} if self.compiler_options else {}
        )
        self._notifier: Notifier | None = None
        self._errors = CallbackErrors()  # a notification's exception, re-raised by `__call__`
        self._ints: dict[int, jax.Array] = {}  # see `_int32`
        self._flags: dict[bool, jax.Array] = {}  # see `_flag`
        self._fused = jax.jit(
            self._run, static_argnames=("scan_steps", "host_id", "pack", "rebuild"), **jit_options
        )
        self._muted = False  # while `_rebuild` runs: its notifications are the first run's again
        self._seconds_per_step: float | None = None  # the last notifying call's speed
        self._host_id = _host.register(self._from_host) if opts.notify else None
        self._step = jax.jit(self._one_step, **jit_options)
        self._evaluate = jax.jit(self._one_evaluation, **jit_options)

    # -- public ---------------------------------------------------------------------
    def init(self, params: Any, model_state: Any = None) -> FitState:
        """The starting `FitState` for ``params`` (the optimizer state from
        ``optimizer.init``) and, with ``has_state=True``, the model's ``model_state``
        (flax ``variables["batch_stats"]``, the non-parameter state of ``nnx.split``)."""
        check_params(params)
        if self.has_state and model_state is None:
            fail(
                TypeError,
                "model_state",
                model_state,
                "the model's state (has_state=True)",
                "Pass it: fit.init(params, model_state), e.g. variables['batch_stats'], or "
                "build with has_state=False for a loss_fn(params, *batch).",
            )
        if not self.has_state and model_state is not None:
            raise TypeError(
                "`model_state` must be None for a fit built with has_state=False; got a "
                f"{type(model_state).__name__}. Build with fuse(..., has_state=True) and a "
                "loss_fn(params, model_state, *batch) -> (loss, new_model_state) to carry a "
                "model state."
            )
        check_model_state(model_state)
        # (strong dtypes, as below: a Python float leaf would compile the program twice)
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.result_type(x)), params)
        check_lookahead(self.optimizer, params)
        # Strong dtypes: a call returns the states the loop carried, strongly typed; a
        # weakly typed leaf in the first call's state (optax's line searches start their
        # `info` so) would make the second call compile the program again.
        model_state, opt_state = jax.tree_util.tree_map(
            lambda x: jnp.asarray(x, jnp.result_type(x)), (model_state, self.optimizer.init(params))
        )
        opt_state, step = replicated_like(params, (opt_state, jnp.zeros((), jnp.int32)))
        return FitState(params, opt_state, step, model_state)

    def __call__(
        self, state: FitState, *batch: Any, steps: int | None = None, eval_batch: Any = None
    ) -> tuple:
        """Run ``steps`` updates (default: the ``steps`` given to `fuse`) in one call.

        Args:
          state: a `FitState` from ``init`` or from a previous call.
          *batch: the arguments after ``params`` of ``loss_fn``; passed once per call.
          steps: updates for this call; any value up to the built ``steps`` reuses the
            compiled program.
          eval_batch: with ``eval_fn``, its arguments after ``params`` (after
            ``model_state`` with ``has_state``): a tuple is the arguments, any other
            value one argument, None none. New values of the same shapes reuse the
            compiled program.

        Returns:
          ``(state, trace)``: the new `FitState` and a `stepfuse.Trace` (its ``eval`` the
          evaluations run, with ``eval_fn``). With ``has_aux=True``, ``(state, trace,
          aux)`` where ``aux`` is that of the last evaluated step.
        """
        if not isinstance(state, FitState):
            raise TypeError(
                f"`state` must be a stepfuse.jax.FitState; got {type(state).__name__}. "
                "Make one with fit.init(params) and pass the state each call returns."
            )
        n = check_call_steps(steps, self.opts, capped=True)  # both modes: one contract
        eval_args = check_eval_batch(eval_batch, self.opts.eval_fn)
        batch = _data.prepare(batch, n)  # data streams checked, a dataset on the device
        if self.opts.mode == "stepwise":
            if inside_a_trace():
                raise TypeError(
                    "stepfuse.jax: mode='stepwise' cannot run inside jax.jit / jax.vmap / jax.grad: "
                    "it is a Python loop that reads every step's loss on the host to decide "
                    "whether to go on. Call the stepwise fit outside the transform (one call "
                    "per model), or use mode='fused' (the default), which composes with them."
                )
            return self._run_stepwise(state, batch, n, eval_args)
        leaves = jax.tree_util.tree_leaves((state, batch))
        # Inside a user's transform (also a jax.jit that closes over every input, so that no
        # argument is a tracer): its callbacks go through JAX, which re-raises their errors.
        traced = inside_a_trace()
        # Reverse-differentiable: a scan of the built `steps`, those past `n` masked, so every
        # `steps=n` runs the same program.
        scan_steps = (
            self.opts.steps
            if (self.differentiable or (traced and wants_reverse_mode(leaves)))
            else None
        )
        notify = self.opts.notify and not traced
        if traced and self.opts.on_nonfinite == "raise":
            warnings.warn(
                "stepfuse.jax: on_nonfinite='raise' cannot raise inside jax.jit / jax.vmap "
                "(the trace stays on the device there); check trace.stop == Stop.NONFINITE.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._errors.clear()
        with self._notify(int(state.step) if notify else None, n):
            # Outside any user transform the loop reaches the host through stepfuse's own
            # FFI target, much cheaper a callback than jax.debug.callback on XLA:CPU; inside
            # one, jax.debug.callback. (stepfuse's target has no sharding: inputs over
            # several devices use JAX's callback.)
            host_id = self._host_id if notify and not spans_devices(leaves) else None
            t0 = time.perf_counter()
            m: Any = np.int32(n)
            period: Any = self._period(notify)
            if not traced:
                m, period = self._int32(m), self._int32(period)
            start = state
            state, out, aux, evals = self._fused(
                state,
                batch,
                eval_args,
                m,
                period,
                self._flag(False, traced),
                scan_steps=scan_steps,
                host_id=host_id,
                pack=not traced,
                rebuild=traced,
            )
            buf, applied, stop, again = _program.unpack(out)
            seconds = time.perf_counter() - t0
            if not traced and again and self._errors.error is None:
                # A value the loop checks lazily went NaN/inf (`_probe.Plan`): the same
                # program runs the call again checking every step, to find the first bad
                # one (a notification's error is raised first, as the call stands).
                state, out, aux, evals = self._checked(start, batch, eval_args, m, period, host_id)
                buf, applied, stop, again = _program.unpack(out)
            if notify and not traced:  # the host calls happen during the program: wait for it
                done = int(applied)
                assert self._notifier is not None
                kept = -(-done // self.opts.record_every)  # the last applied step's record
                self._notifier.done(done, float(buf[kept - 1]) if kept else None)
                self._seconds_per_step = seconds / max(done, 1)
        if self._errors.error is not None:  # a callback's: the state at its step with it
            error, at = self._errors.error, self._errors.step
            self._errors.clear()
            # (the device loop ran on past it; `again`: check every step, as `_checked`)
            reached, _, _, _ = self._rerun(
                start,
                batch,
                eval_args,
                self._int32(at - int(start.step)),
                period,
                host_id,
                exact=bool(again),
            )
            raise with_state(error, reached, at)
        if not traced and scan_steps is None and int(stop) == Stop.NONFINITE:
            state = self._rebuild(start, batch, eval_args, int(applied), period, host_id)
        k = self.opts.record_every
        if traced or np.ndim(buf) != 1:
            ev = None if evals is None else traced_eval_trace(evals)
            loss = buf[..., : self.opts.capacity]  # float64 kept, any other as float32
            loss = loss if loss.dtype == jnp.float64 else loss.astype(jnp.float32)
            trace = Trace(loss, applied, stop, k, ev)
        else:
            ev = None if evals is None else host_eval_trace(evals)
            trace = host_trace(np.asarray(buf), applied, stop, k, ev)
            if trace.stop == Stop.NONFINITE:  # raise, or say that nothing was applied
                # error.state: the new one
                trace = finish(trace, self.opts, int(state.step) - trace.steps, state)
        return (state, trace, aux) if self.has_aux else (state, trace)

    # -- the fused program ----------------------------------------------------------
    def _run(
        self,
        state: FitState,
        batch: tuple,
        eval_batch: tuple,
        n: jax.Array,
        period: jax.Array,
        exact: Any = False,
        *,
        scan_steps: int | None = None,
        host_id: int | None = None,
        pack: bool = False,
        rebuild: bool = True,
    ) -> tuple[FitState, Any, Any, Any]:
        """The fused program (`_program.run`), traced by ``self._fused``."""
        self.compiles += 1  # Python runs here only while jax.jit traces a new program
        self._check_model_state(state)
        loss = Loss(
            self.loss_fn,
            self.has_aux,
            loss_params(state.params),
            _data.Streams(batch).sample(batch),  # one step's arguments
            self.has_state,
            state.model_state,
        )
        evaluation = self._evaluation(state.params, state.model_state, eval_batch)
        return _program.run(
            self.opts,
            self.optimizer,
            loss,
            self._dispatch,
            state,
            batch,
            n,
            period,
            scan_steps=scan_steps,
            host_id=host_id,
            pack=pack,
            rebuild=rebuild,
            evaluation=evaluation,
            eval_batch=eval_batch,
            exact=exact,
        )

    def _evaluation(self, params: Any, model_state: Any, eval_batch: tuple) -> Evaluation | None:
        """``eval_fn`` traced and checked for this call (None without one)."""
        if self.opts.eval_fn is None:
            return None
        return Evaluation(
            self.opts.eval_fn, self.has_state, loss_params(params), model_state, eval_batch
        )

    def _rebuild(
        self,
        state: FitState,
        batch: tuple,
        eval_batch: tuple,
        good: int,
        period: Any,
        host_id: int | None,
    ) -> FitState:
        """The state after the first ``good`` updates of a call from ``state``: after a
        refused update, the state before it.

        The fused loop applies every update and stops after a refused one (see
        `_program`). This runs the call's finite steps again through the same compiled
        program, its notifications muted: a step is one function of the loop's carry,
        wherever chunks and notifications split the loop, so it gives the first run's
        state bit for bit (tested). It costs those steps once more, in a call that stops
        on NONFINITE only (and with ``eval_fn``, their evaluations once more).
        """
        new, _, _, _ = self._rerun(state, batch, eval_batch, self._int32(good), period, host_id)
        return new

    def _checked(
        self,
        state: FitState,
        batch: tuple,
        eval_batch: tuple,
        n: Any,
        period: Any,
        host_id: int | None,
    ) -> tuple:
        """The call from ``state`` run again with every step's values all checked
        (``exact``), its notifications muted (the first run sent them up to the last
        step it had checked): what `_program.run` returns. The same compiled program, so
        the same values bit for bit, up to the first non-finite step, where it stops."""
        return self._rerun(state, batch, eval_batch, n, period, host_id, exact=True)

    def _rerun(
        self,
        state: FitState,
        batch: tuple,
        eval_batch: tuple,
        n: Any,
        period: Any,
        host_id: int | None,
        exact: bool = False,
    ) -> tuple:
        """``n`` steps from ``state`` through the fused program again, notifications muted
        (`_rebuild`, `_checked`): what `_program.run` returns, once it has run."""
        self._muted = True
        try:
            out = self._fused(
                state,
                batch,
                eval_batch,
                n,
                period,
                self._flag(exact),
                scan_steps=None,
                host_id=host_id,
                pack=True,
                rebuild=False,
            )
            return jax.block_until_ready(out)  # its host calls happen while it runs
        finally:
            self._muted = False

    def _compiled_text(
        self, state: FitState, *batch: Any, steps: int | None = None, eval_batch: Any = None
    ) -> str:
        """The HLO text of the program a plain call of ``steps`` runs, as XLA compiled it
        (for inspection: `benchmarks/jax_kernels.py`, the tests)."""
        n = np.int32(self.opts.steps if steps is None else steps)
        text = (
            self._fused.lower(
                state,
                batch,
                check_eval_batch(eval_batch, self.opts.eval_fn),
                n,
                self._period(False),
                self._flag(False),
                scan_steps=None,
                host_id=None,
                pack=True,
                rebuild=False,
            )
            .compile()
            .as_text()
        )
        assert text is not None  # XLA:CPU and GPU give the text
        return text

    def _int32(self, value: Any) -> jax.Array:
        """``value`` as an int32 array already on the device, kept per value: a NumPy
        scalar argument is transferred at every call, a sizeable part of a short call.
        Made concrete even while a user's ``jax.jit`` is tracing the call (a kept tracer
        would escape its trace)."""
        value = int(value)
        array = self._ints.get(value)
        if array is None:
            if len(self._ints) >= 64:
                self._ints.clear()
            with jax.ensure_compile_time_eval():
                array = self._ints[value] = jnp.asarray(value, jnp.int32)
        return array

    def _flag(self, value: bool, traced: bool = False) -> Any:
        """A bool argument of the program, on the device and kept (as `_int32`); a NumPy
        one where the call is traced."""
        if traced:
            return np.bool_(value)
        flag = self._flags.get(value)
        if flag is None:
            with jax.ensure_compile_time_eval():
                flag = self._flags[value] = jnp.asarray(value, jnp.bool_)
        return flag

    def _period(self, notify: bool) -> np.int32:
        """Steps between the loop's host calls: `every`, or for a bar alone a multiple of
        it about ``_DRAW_SECONDS`` long at the previous call's speed."""
        every = self.opts.every or 1
        if not notify or self.opts.callback is not None:
            return np.int32(every)
        return np.int32(paced_every(every, self._seconds_per_step, _DRAW_SECONDS))

    # -- notifications from inside the loop ------------------------------------------
    def _notify(self, start: int | None, n: int) -> contextlib.AbstractContextManager:
        if not self.opts.notify or start is None:
            self._notifier = None
            return contextlib.nullcontext()
        self._notifier = Notifier(self.opts, start, n, label="stepfuse.jax")
        return self._notifier

    def _dispatch(self, packed: Any) -> None:
        """The host side of the in-loop callback through ``jax.debug.callback``: an int32
        array of (step, hit, the loss's bits: one int for a float32 loss, two for float64),
        one row per model under vmap."""
        if self._muted:
            return
        packed = np.asarray(packed, np.int32)
        packed = packed.reshape(-1, packed.shape[-1])
        losses = np.ascontiguousarray(packed[:, 2:]).view(
            np.float32 if packed.shape[1] == 3 else np.float64
        )
        for s, h, l in zip(packed[:, 0], packed[:, 1], losses[:, 0]):
            if self._errors.error is not None:
                return
            if h:
                self._deliver(s, l)

    def _from_host(self, values: tuple[int, ...]) -> None:
        """The host side of the FFI path (one model, outside user transforms): the ints
        (step, hit, the loss's bits: one int for a float32 loss, two for float64)."""
        step, hit, *bits = values
        if hit and self._errors.error is None and not self._muted:
            fmt = "<f" if len(bits) == 1 else "<d"
            self._deliver(step, struct.unpack(fmt, struct.pack(f"<{len(bits)}i", *bits))[0])

    def _deliver(self, step: Any, loss: Any) -> None:
        """One notification.

        Called eagerly (the usual case) it goes to the `Notifier` (bar and callback); an
        exception is kept, later notifications of the call are skipped, and ``__call__``
        re-raises it once the device loop has finished (the loop does not wait for the
        host, so it runs to its end first; the caller's state is untouched since ``fit``
        is pure). Inside a user's ``jax.jit``/``jax.vmap`` only ``callback`` fires (no
        progress bar) and its exception surfaces through JAX.
        """
        if self._notifier is None:
            if self.opts.callback is not None:
                self.opts.callback(int(step), float(loss))
            return
        self._errors.deliver(self._notifier, step, loss)

    # -- the stepwise reference -------------------------------------------------------
    def _check_model_state(self, state: FitState) -> None:
        """A call's state has a model state exactly when the fit was built with has_state."""
        if self.has_state == (state.model_state is None):
            want = (
                "a model state (this fit was built with has_state=True)"
                if self.has_state
                else "None (this fit was built with has_state=False)"
            )
            raise TypeError(
                f"`state.model_state` must be {want}; got "
                f"{type(state.model_state).__name__}. Pass the state this fit's "
                "init(params[, model_state]) made or its calls returned."
            )

    def _one_step(self, params: Any, opt_state: Any, model_state: Any, batch: tuple) -> Proposal:
        """One step of the stepwise reference, traced by ``self._step``."""
        self.compiles += 1  # Python runs here only while jax.jit traces a new step
        check_opt_state(self.optimizer, params, opt_state)
        loss = Loss(
            self.loss_fn, self.has_aux, loss_params(params), batch, self.has_state, model_state
        )
        # the fused loop's finite check at every step: the same values read, so that XLA
        # fuses the step alike (bit for bit the same results)
        checks = plan(self.optimizer, loss, params, opt_state, batch, model_state, lazy=False)
        return propose(self.optimizer, loss, params, opt_state, batch, None, model_state, checks)

    def _one_evaluation(self, params: Any, model_state: Any, eval_batch: tuple) -> dict:
        """The evaluation of the stepwise reference, traced by ``self._evaluate``."""
        self.compiles += 1  # Python runs here only while jax.jit traces a new evaluation
        evaluation = self._evaluation(params, model_state, eval_batch)
        assert evaluation is not None
        return evaluation(loss_params(params), model_state, eval_batch)

    def _run_stepwise(self, state: FitState, batch: tuple, n: int, eval_batch: tuple) -> tuple:
        self._check_model_state(state)
        # eval_fn checked before the first step, not at the first evaluation
        evaluation = self._evaluation(state.params, state.model_state, eval_batch)
        held: dict[str, Any] = {
            "params": state.params,
            "opt": state.opt_state,
            "model": state.model_state,
            "aux": None,
            "i": 0,  # the call's step: which minibatch of a data stream the next one takes
        }
        start = int(state.step)
        orders: dict[Any, np.ndarray] = {}  # the epochs' orders the call has used

        def propose_step() -> tuple[Any, bool, Any]:
            args = _data.host_pick(batch, held["i"], start + held["i"], orders)
            value, aux, new_params, new_opt, probe, _, new_model = self._step(
                held["params"], held["opt"], held["model"], args
            )
            held["aux"] = aux
            return np.asarray(value), bool(np.isfinite(probe)), (new_params, new_opt, new_model)

        def commit(token: Any) -> None:
            held["params"], held["opt"], held["model"] = token
            held["i"] += 1

        def evaluate() -> dict:
            return self._evaluate(held["params"], held["model"], eval_batch)

        failed: list[int] = []  # the step of a notification that raised

        def notify(step: int, loss: float) -> None:
            try:
                note(step, loss)
            except BaseException:
                failed.append(step)
                raise

        with Notifier(self.opts, start, n, label="stepfuse.jax") as note:
            try:
                trace = run_stepwise(
                    propose_step,
                    commit,
                    n,
                    self.opts,
                    start,
                    notify if self.opts.notify else None,
                    evaluate if self.opts.eval_fn is not None else None,
                )
            except BaseException as e:
                if not failed:
                    raise
                # (a notification follows its step's commit: held is the state at its step)
                reached = FitState(held["params"], held["opt"], jnp.int32(failed[0]), held["model"])
                raise with_state(e, reached, failed[0]) from None
            note.done(trace.steps)
        if evaluation is not None:
            trace = named_evals(trace, evaluation.dtypes)
        new = FitState(held["params"], held["opt"], jnp.int32(start + trace.steps), held["model"])
        trace = finish(trace, self.opts, start, new)
        return (new, trace, held["aux"]) if self.has_aux else (new, trace)
