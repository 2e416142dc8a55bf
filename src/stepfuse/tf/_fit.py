"""`Fit`, what the TF2 backend's `fuse` returns: ``fit(*batch)`` runs the steps in one
``tf.function`` call (a ``tf.while_loop``, XLA-compiled by default) and returns a
`stepfuse.Trace`. The variables and the optimizer state are updated in place. With
``eval_fn``, the evaluations run inside the loop (`_eval`).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .._core import (
    Notifier,
    Options,
    Trace,
    ceil_div,
    check_call_steps,
    check_eval_batch,
    deferred_interrupts,
    exclusive,
    finish,
    host_trace,
)
from ._checks import (
    _ArgumentError,
    _batch_mismatch,
    _check_known,
    _check_loss,
    _fail,
    _learning_rate_of,
    _tf_var,
    follow_hyper,
    hyper_of,
)
from ._data import Streams, only_given
from ._distribute import check_split, distributed_step, no_xla_under, strategy_of
from ._eval import Evaluations
from ._loop import _INT, _all_finite, _inner_loop, _outer_loop
from ._plan import AUTO, Parked, choose, given, undecided, xla_cause
from ._probe import Probe, avoid_xla, hold, probe
from ._stepwise import Stepwise

try:  # a gradient tape left open around a call must not record it (see `Fit._call`)
    from tensorflow.python.eager.record import stop_recording as _not_recorded
except ImportError:  # pragma: no cover - other TF versions
    _not_recorded = contextlib.nullcontext

__all__ = ["Fit"]

# The steps one launch of the (XLA) inner loop runs at most, unless the built `steps` is
# larger. Each launch costs wall time, so a call far longer than the built `steps` runs in
# launches this long; short calls are unaffected (docs/internals/tf.md).
_MIN_STEPS_PER_LAUNCH = 16384
# With eval_fn, a launch carries buffers for its evaluations, one slot per evaluation it may
# run, so it runs fewer steps: at least max(steps, 1024) where that needs at most
# _EVAL_SLOTS slots (else as many as the fit's `steps` need, or _EVAL_SLOTS). Sized by 16384
# steps they cost the seed with eval_every=steps=10 ~60 us a call more, ~45 us of it because
# XLA:CPU runs a loop body that touches a buffer over 512 bytes slower (63 slots and the
# spare one of int64 steps are 512 bytes); docs/internals/tf.md.
_MIN_STEPS_PER_EVAL_LAUNCH = 1024
_EVAL_SLOTS = 63


class Fit(Stepwise):
    """A fused fit: ``fit(*batch, steps=None)`` runs the steps in one ``tf.function`` call.

    Built by `fuse`.

    Attributes:
      mode: ``"fused"`` or ``"stepwise"`` (the ``mode`` given to `fuse`; a loop XLA cannot
        compile still runs fused, without XLA, and ``jit_compile`` says so).
      compiles: how many times a program was traced (``traces`` is the same counter, its
        older name; the stepwise mode's step and its evaluation count too). It stays at 1
        across calls with new ``steps`` and new batch values of the same shapes and
        dtypes; without a callback or bar, a call longer than ``max(steps, 16384)`` (with
        ``eval_fn`` shorter: see the TF guide) runs the compiled loop inside a graph loop,
        as every call with one does: a second program, traced once.
      step: updates applied since the fit was built.
      jit_compile: whether the loop is XLA-compiled. With ``jit_compile="auto"`` it is
        True until the first fused call chooses (see ``plan``); given True, it is turned
        off with a warning when an op cannot be compiled, or when the loss draws random
        numbers.
      plan: how the loop runs and why, ``{"xla": bool, "reason": str}`` (and
        ``"us_per_step": {"xla": ..., "tf": ...}``, the trial's times, where the first call
        timed them; ``"xla": None`` until an ``"auto"`` fit's first call decides).
      variables, optimizer: what the fit trains, and with what.
    """

    fallback_reason: str | None = None
    """Always None: a TF2 fit never falls back to the stepwise mode."""

    def __init__(
        self,
        loss_fn: Any,
        optimizer: Any,
        variables: Any,
        opts: Options,
        jit_compile: bool | str,
        held: Any = (),
    ) -> None:
        self.loss_fn, self.optimizer, self.variables, self.opts = (
            loss_fn,
            optimizer,
            variables,
            opts,
        )
        # "auto" runs XLA until the first fused call has timed both paths (`_plan`).
        self.jit_compile = jit_compile is not False
        self._jit_given = jit_compile
        self.plan: dict[str, Any] = given(jit_compile)
        self.mode = opts.mode
        if opts.mode == "stepwise" and jit_compile == AUTO:
            self.plan = {
                "xla": True,
                "reason": "jit_compile='auto', stepwise mode: the reference's step is "
                "XLA-compiled (unless the loss draws random numbers)",
            }
        self.step = 0
        self.compiles = 0
        self._tf_vars = [_tf_var(v) for v in variables]
        # A model and optimizer created under a tf.distribute strategy: each step runs on
        # every replica (`_distribute`), without XLA.
        self._strategy = strategy_of(variables, optimizer)
        if self._strategy is not None:
            no_xla_under(self, self._strategy, jit_compile)
        if not optimizer.built:  # as `apply_gradients` builds it (the variables' paths)
            with self._scope(), keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
        else:
            _check_known(optimizer, variables)
        # Everything a refused update must leave untouched: parameters and optimizer state.
        self._state = self._tf_vars + [_tf_var(v) for v in optimizer.variables]
        # The model's other variables that the forward pass may change: read before it and
        # put back with the rest when a step is refused (see `fuse`).
        # Until a probe says which the loss writes (`_probe`), those fuse was given.
        ids = {id(v) for v in self._state}
        self._given_held = [t for t in map(_tf_var, held) if id(t) not in ids]
        self._held: list = []
        # the steps one launch of the (XLA) inner loop runs at most
        self._steps_per_launch = max(opts.steps, _MIN_STEPS_PER_LAUNCH)
        if opts.eval_every is not None:  # see _EVAL_SLOTS
            k = opts.eval_every
            slots = min(ceil_div(_MIN_STEPS_PER_EVAL_LAUNCH, k), _EVAL_SLOTS)
            slots = max(ceil_div(opts.steps, k), slots)
            self._steps_per_launch = min(self._steps_per_launch, slots * k)
        # A progress bar alone needs no synchronous host call: the loop publishes
        # (step, loss) in this variable and a thread reads it (see `Notifier.watch`).
        # That costs a fraction of a notification through tf.numpy_function, which a callback
        # needs (it may raise, and the loop must stop there); docs/internals/tf.md.
        # The optimizer's iterations when a call of TensorFlow's kernels starts: where an op
        # fails mid-call, the steps applied are the iterations since (refused ones undone).
        # (`_iterations` counts every update; `iterations` divides it by gradient accumulation)
        self._iterations = _tf_var(getattr(optimizer, "_iterations", optimizer.iterations))
        self._iterations_before = tf.Variable(self._iterations.read_value(), trainable=False)
        self._published = (
            tf.Variable([math.nan, math.nan], dtype=tf.float64, trainable=False)
            if opts.progress and opts.callback is None
            else None
        )
        # The last call's speed (steps per second) sizes a bar's first chunk: one XLA launch
        # less per call (see _PUBLISH_SECONDS).
        self._steps_per_second = 0.0
        # Losses one inner loop records at most. With a callback a chunk ends at the next
        # multiple of `every`, which bounds it: the buffer is zeroed and copied at every XLA
        # launch (a long one costs at every notification). A bar
        # alone sizes its chunks by time (see `_outer_loop`), so only `_steps_per_launch`
        # bounds them.
        window = self._steps_per_launch
        if opts.callback is not None:
            window = min(window, opts.every or 1)
        self._cap = ceil_div(window, opts.record_every)
        self._notifier: Notifier | None = None
        self._notified_step: int | None = None
        self._trace_dtype = tf.float32  # the loss dtype of the batch being traced (see `_call`)
        self._callback_error: BaseException | None = None
        self._learning_rate = _learning_rate_of(optimizer)  # what the programs were traced with
        self._hyper = hyper_of(optimizer)  # (and its Python-number hyper-parameters)
        # The nesting of the batch the programs were traced for: they take its tensors
        # flat and `_loss_and_grads` packs them back for loss_fn (dicts, tuples ...).
        self._structure = None
        self._probes: dict[Any, Probe] = {}  # see `_probe`
        self._parked = Parked()  # the programs of other structures (`_plan.Parked`)
        self._drawn: list = []  # random generators' states the loss advances (see `_probe`)
        self._streams = Streams()  # Batches / Epochs / tf.data arguments (see `_data`)
        # eval_fn's arguments, check and buffers (see `_eval`); their tensors follow the batch's
        self._evals = Evaluations(opts, self._steps_per_launch) if opts.eval_fn else None
        self._build()

    @property
    def traces(self) -> int:
        """The older name of `compiles`."""
        return self.compiles

    # -- building -----------------------------------------------------------------------

    def _build(self, keep_parked: bool = False) -> None:
        if not keep_parked:  # (programs of other structures: traced with what changed)
            self._parked.clear()
        inner = self._inner_py
        if self.jit_compile:
            inner = tf.function(inner, jit_compile=True, autograph=False)
        self._inner = inner
        self._outer = tf.function(self._outer_py, autograph=False)
        # A call of at most `_steps_per_launch` steps with nothing to notify is the inner
        # loop alone, one launch without the graph loop around it (a large part of a short
        # call's time saved; docs/internals/tf.md).
        self._whole = (
            None
            if self.opts.notify
            else tf.function(self._whole_py, jit_compile=self.jit_compile, autograph=False)
        )
        self._single: tuple[Any, Any] | None = None
        self._evaluate: Any = None  # the stepwise mode's evaluation (see `_stepwise_evaluation`)
        self._concrete: dict[
            Any, Any
        ] = {}  # (program, batch signature) -> the traced function; see `_call`
        self._compiled: set[Any] = set()  # the programs (whole / outer) that have run once

    def _call(self, program, head, batch, tail=()):
        """``program(*head, *batch, *tail)`` through the concrete function traced for these
        arguments' dtypes and shapes (the losses kept in the batch's loss dtype; ``tail``:
        the evaluation's tensors).

        A ``tf.function`` call first matches its arguments against the traced signatures,
        Python work that is a large part of a short call. Looking the concrete function up
        by dtypes and shapes skips that (docs/internals/tf.md). Tracing,
        and so ``traces``, is unchanged: ``get_concrete_function`` traces what a call would.
        """
        args = (*head, *batch, *tail)
        key = (program, tuple((a.dtype, tuple(a.shape)) for a in args))
        concrete = self._concrete.get(key)
        if concrete is None:
            self._trace_dtype = self._probe(batch).dtype
            concrete = self._concrete[key] = program.get_concrete_function(*args)
        call_flat = getattr(concrete, "_call_flat", None)
        # Not recorded by a tape the caller has open: the call updates variables in place
        # and is not differentiable, and recording it asks XLA for a gradient-ready
        # program it cannot compile (the loss buffer).
        with _not_recorded():
            if call_flat is None:  # the tensors match its signature: a plain call is the same
                return concrete(*args)
            return call_flat(list(args), concrete.captured_inputs)

    def _probe(self, batch: Any) -> Probe:
        """What tracing the loss alone on this batch signature says (`_probe`), once per
        signature, before a program is traced: the trace's loss dtype, reasons to avoid
        XLA, and the variables the forward pass writes, which join ``_held`` (random
        generators' states apart, in ``_drawn``)."""
        key = tuple((b.dtype, tuple(b.shape)) for b in batch)  # (cleared with the structure)
        found = self._probes.get(key)
        if found is None:
            found = self._probes[key] = probe(self, batch)
            known = found.written is not None and self._strategy is None
            if hold(self, found.written if known else self._given_held, found.random_states):
                self._build()  # programs traced with the old lists
        return found

    def _scope(self) -> Any:
        """The strategy's scope (or nothing): where the optimizer builds its variables."""
        return contextlib.nullcontext() if self._strategy is None else self._strategy.scope()

    def _without_xla(self, reason: str) -> None:
        """Run the loop without XLA from now on (``fit.plan`` says why)."""
        self.plan = {"xla": False, "reason": reason}
        self.jit_compile = False
        self._build()

    def _written_variables(self) -> list:
        """Every variable a call may write: what a trial of the loop (`_plan`) puts back."""
        evaluated = self._evals.written if self._evals is not None else []
        return [*self._state, *self._held, *self._drawn, *evaluated, *self._streams.variables()]

    def _adopt(self, plan: dict[str, Any], program: Any, compiles: int) -> None:
        """Keep ``plan`` (`_plan.choose`): the chosen path's programs, with ``program``
        (the trial's, already traced for this batch) as the one-launch program."""
        kept = {k: c for k, c in self._concrete.items() if program is not None and k[0] is program}
        self.plan, self.jit_compile = plan, bool(plan["xla"])
        self._build()
        self.compiles = compiles
        if kept and self._whole is not None:
            self._whole = program
            self._concrete.update(kept)
            self.compiles += len(kept)
            self._compiled.add(True)

    def _loss_and_grads(self, batch):
        """The step's loss and gradients on the minibatch ``batch`` picks (`_data`)."""
        return self._loss_and_grads_of(*self._streams.unpack(self._structure, batch))

    def _loss_and_grads_of(self, batch, has=()):
        """``loss_fn(*batch)`` and its gradients (``has``: whether an iterator gave the
        step an element; where it did not, loss_fn does not run on the made-up element:
        a NaN loss refuses the step, `_data.OutOfDataError`)."""
        if not has:
            return self._loss_and_grads_on(batch)
        return only_given(has[0], lambda: self._loss_and_grads_on(batch), self._tf_vars)

    def _loss_and_grads_on(self, batch):
        """``loss_fn(*batch)`` and its gradients (None where none reaches a variable); the
        loss waits for the checks loss_fn runs (``tf.debugging.assert_*``) and the update
        for the loss, so a failing check stops the loop before its step changes anything,
        as in the plain loop."""
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        with tf.GradientTape() as tape:
            try:
                loss = self.loss_fn(*batch)
            except NotImplementedError as e:
                if "numpy()" not in str(e):
                    raise
                _fail(
                    TypeError,
                    "loss_fn",
                    self.loss_fn,
                    "traceable (it runs inside tf.function)",
                    f"It called .numpy() ({e}); use the variables and tensors themselves, "
                    "e.g. tf.matmul(x, kernel) rather than kernel.numpy().",
                )
            except (TypeError, ValueError) as e:
                if isinstance(e, _ArgumentError):
                    raise
                raise _batch_mismatch(e, batch) from e
            loss = _check_loss(loss, self.loss_fn)
        grads = tape.gradient(loss, self._tf_vars)
        checks = [op for op in graph.get_operations()[first:] if op.type == "Assert"]
        if checks:  # (the update waits for the loss: `_propose`)
            with tf.control_dependencies(checks):
                loss = tf.identity(loss)
        # As the plain loop's apply_gradients: a variable no gradient reaches (a model's
        # unused head) is left alone, with Keras's warning naming it; none reached is an error.
        if all(g is None for g in grads):
            _fail(
                ValueError,
                "loss_fn",
                self.loss_fn,
                "a loss that depends on the variables it trains",
                f"No gradient reaches any of {[v.name for v in self._tf_vars]}: read those "
                "variables inside loss_fn (not their numpy() values).",
            )
        return loss, grads

    def _propose(self, batch):
        """One step applied: ``(loss, snapshot, new, ok)``, the state before and after the
        optimizer's update and whether loss, gradients and new state are all finite
        (under a ``tf.distribute`` strategy, on every replica: `_distribute`)."""
        if self._strategy is not None:
            return distributed_step(self, batch)
        loss, grads = self._loss_and_grads(batch)
        snapshot = [v.read_value() for v in self._state]
        with tf.control_dependencies([loss]):  # after the checks loss_fn runs
            self.optimizer.apply_gradients(zip(grads, self.variables))
        new = [v.read_value() for v in self._state]
        return loss, snapshot, new, _all_finite([loss, *grads, *new])

    def _guarded_update(self, batch, held=()):
        """One step; undone (state and counters, and ``held``: the model's other variables
        as read before the forward pass) if anything is non-finite: ``(loss, ok)``."""
        loss, snapshot, _, ok = self._propose(batch)

        def restore():
            for v, old in zip(self._state + self._held, snapshot + list(held)):
                v.assign(old)
            return tf.constant(False)

        return loss, tf.cond(ok, lambda: tf.constant(True), restore)

    def _split(self, args: tuple) -> tuple[tuple, tuple]:
        """A program's flat arguments as ``(batch, tail)``: the loss's tensors and the
        evaluation's (empty without ``eval_fn``)."""
        if self._evals is None:
            return args, ()
        cut = len(args) - self._evals.size
        return args[:cut], args[cut:]

    def _inner_py(self, m, i0, prev, *args, xla=None):
        batch, tail = self._split(args)
        streams, structure = self._streams, self._structure
        carry = streams.carry_in(structure, batch)  # shuffled Epochs: the order, as a loop variable
        segments = None if self._evals is None else self._evals.segments(tail, i0)
        xla = self.jit_compile if xla is None else xla

        def step(carried=None):
            held = [v.read_value() for v in self._held]
            with streams.carrying(structure, batch, carried) as after:
                loss, ok = self._guarded_update(batch, held)
            return (loss, ok) if carried is None else (loss, ok, after())

        out = _inner_loop(
            step,
            m,
            i0,
            prev,
            self.opts,
            self._cap,
            xla=xla,
            dtype=self._trace_dtype,
            carry=carry,
            segments=segments,
        )
        evaluated: tuple = ()
        if segments is not None:  # the launch's evaluations: count, steps, *values
            out, evaluated = out[:-1], out[-1]
        if carry is not None:
            streams.carry_out(structure, batch, out[-1])
            out = out[:-1]
        return (*out, *evaluated)

    def _whole_py(self, n, *args, xla=None):
        self.compiles += 1
        if not (self.jit_compile if xla is None else xla):
            self._iterations_before.assign(self._iterations.read_value())
        buf, count, _, applied, stop, _, *evaluated = self._inner_py(
            n, tf.constant(0, _INT), tf.constant(math.nan, tf.float64), *args, xla=xla
        )
        return (buf, count, applied, stop, *evaluated)

    def _outer_py(self, n, step0, speed, *args):
        self.compiles += 1
        if not self.jit_compile:
            self._iterations_before.assign(self._iterations.read_value())
        return _outer_loop(
            lambda m, i0, prev: self._inner(m, i0, prev, *args),
            n,
            step0,
            self.opts,
            self._steps_per_launch,
            self._notify_host if self.opts.notify and self._published is None else None,
            self._published,
            speed,
            dtype=self._trace_dtype,
            gather=None if self._evals is None else self._evals.gather(),
        )

    def _notify_host(self, step, loss):
        step = int(step)
        self._notified_step = step
        assert self._notifier is not None  # set for the call that notifies
        try:
            self._notifier(step, float(loss))
        except BaseException as e:  # noqa: BLE001 - handed back to the caller as is
            self._callback_error = e
            raise
        return np.int32(1)

    # -- calling ------------------------------------------------------------------------

    def __call__(self, *batch: Any, steps: Any = None, eval_batch: Any = None) -> Trace:
        """Run ``steps`` (default: the ``steps`` given to `fuse`) updates; returns the `Trace`.

        ``eval_batch``: with ``eval_fn``, its arguments (a tuple is the arguments, any
        other value one argument, None none); new values of the same shapes and dtypes
        reuse the traced programs.
        """
        with exclusive(self):  # one call at a time
            n = check_call_steps(steps, self.opts, capped=False)
            eval_args = check_eval_batch(eval_batch, self.opts.eval_fn)
            if not tf.executing_eagerly():
                raise RuntimeError(
                    "stepfuse.tf: call the fit eagerly, not inside a tf.function or graph: it "
                    "compiles its own tf.function (all steps in one call) and reads the trace "
                    "back on the host. Call fit(*batch) from Python; for TF1 graphs use "
                    "stepfuse.tf.v1.fuse."
                )
            start = self.step
            batch, structure = self._streams.flatten(batch, n, start, self)
            if self._strategy is not None:  # each replica takes an equal share of a step's rows
                rows = self._streams.step_rows(structure, batch)
                check_split(rows, self._strategy.num_replicas_in_sync, self._strategy)
            if structure != self._structure:  # another nesting of tensors: trace again
                old = self._structure
                if old is not None and not self._parked.switch(self, old, structure):
                    self._build(keep_parked=True)
                    self._probes = {}
                self._structure = structure
            tail: tuple = ()
            if self._evals is not None:
                tail, eval_structure = self._evals.flatten(eval_args, start)
                if eval_structure != self._evals.structure or len(tail) != self._evals.size:
                    if self._evals.structure is not None:
                        self._build()
                    self._evals.structure, self._evals.size = eval_structure, len(tail)
                self._evals.probe(tail)  # eval_fn traces and returns scalars, before anything runs
            if _learning_rate_of(self.optimizer) is not self._learning_rate:
                # `optimizer.learning_rate = schedule` (or a callable) replaces the variable the
                # programs read: trace them again (assigning a float writes into the variable).
                self._learning_rate = _learning_rate_of(self.optimizer)
                self._build()
            follow_hyper(self)
            found = self._probe(batch)
            if self.jit_compile:
                avoid_xla(self, found)
            if self.opts.mode == "stepwise":
                return self._call_stepwise(batch, n, start, tail)
            if undecided(self):
                choose(self, batch, tail)
            self._callback_error, self._notified_step = None, None
            # Python's Ctrl-C handler runs in the main thread only, which is inside the call
            # until it returns (callbacks run on TF's threads): it could land between the
            # variables' update and `self.step`'s, so hold it until both are done.
            with (
                deferred_interrupts(),
                Notifier(self.opts, start, n, label="stepfuse.tf") as notifier,
            ):
                self._notifier = notifier
                if self._published is not None:
                    notifier.watch(self._published.numpy)
                try:
                    losses, applied, stop, last, evals = self._run(n, start, batch, tail)
                except tf.errors.OpError as e:
                    err = self._callback_error
                    if err is not None:  # the user's callback raised: hand it back as is
                        if self._notified_step is not None:
                            self.step = self._notified_step
                        raise err from None
                    if not self.jit_compile:  # an op failed mid-call (a check, a label)
                        applied = self._iterations.numpy() - self._iterations_before.numpy()
                        self.step = start + int(applied)
                        e.add_note(
                            f"stepfuse.tf: the call applied {self.step - start} step(s) before "
                            f"the one that failed, which changed nothing; fit.step is {self.step}."
                        )
                    raise
                finally:
                    self._notifier = None
                notifier.done(applied, None if last is None else float(last))
                follow_hyper(self, callback=True)
                self.step = start + int(applied)
            trace = host_trace(losses, int(applied), int(stop), self.opts.record_every, evals)
            self._streams.check_exhausted(trace, start, self.opts.record_every)
            return finish(trace, self.opts, start)

    def _run(self, n, start, batch, tail):
        """The call's program: ``(losses as numpy, applied, stop, last loss, evaluations)``;
        the last loss only from the program that notifies (else None), the evaluations
        (an `EvalTrace`) with ``eval_fn`` (else None)."""
        whole = self._whole is not None and n <= self._steps_per_launch
        evals = self._evals
        if whole:

            def run():
                buf, count, applied, stop, *evaluated = self._call(
                    self._whole, (tf.constant(n, _INT),), batch, tail
                )
                ev = None if evals is None else evals.trace(evaluated, gathered=False)
                return buf.numpy()[: int(count)], applied, stop, None, ev
        else:

            def run():
                t0 = time.perf_counter()
                losses, applied, stop, last, *evaluated = self._call(
                    self._outer,
                    (
                        tf.constant(n, _INT),
                        tf.constant(start, tf.int64),
                        tf.constant(self._steps_per_second, tf.float64),
                    ),
                    batch,
                    tail,
                )
                losses = losses.numpy()
                if self._published is not None and int(applied):
                    self._steps_per_second = int(applied) / (time.perf_counter() - t0)
                ev = None if evals is None else evals.trace(evaluated, gathered=True)
                return losses, applied, stop, last, ev

        return self._xla_or_plain(whole, run, "the fused loop", stacklevel=4)

    def _xla_or_plain(self, key: Any, run: Any, what: str, stacklevel: int) -> Any:
        """``run()``. Its first run with XLA (per ``key``) falls back to programs without
        XLA, with a warning, if XLA cannot compile an op."""
        if key in self._compiled or not self.jit_compile:
            out = run()
        else:
            try:
                out = run()
            except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
                msg = str(e)
                if self._callback_error is not None or not any(
                    s in msg for s in ("XLA", "xla", "compil", "Compil")
                ):
                    raise
                cause = xla_cause(e)
                if self._jit_given is True:  # ("auto": fit.plan says it)
                    warnings.warn(
                        f"stepfuse.tf: {what} could not be XLA-compiled, so it runs without XLA "
                        f"(slower). Pass jit_compile=False to silence this. Cause: {cause}",
                        RuntimeWarning,
                        stacklevel=stacklevel,
                    )
                self._without_xla(f"XLA could not compile {what} ({cause})")
                out = run()
        self._compiled.add(key)
        return out
