"""TensorFlow 2 / Keras backend: many Keras-optimizer steps inside one ``tf.function`` call.

``fuse(loss_fn, optimizer, variables, steps=...)`` returns a `Fit`; ``fit(*batch)`` runs the
steps in one ``tf.function`` call (a ``tf.while_loop``, XLA-compiled by default) and returns
a `stepfuse.Trace`. The variables and the optimizer state are updated in place.
TF1 graph mode (``sess.run``) lives in `stepfuse.tf.v1`.
"""

from __future__ import annotations

import contextlib
import math
import textwrap
import time
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .._core import (
    OPTIONS_DOC,
    Notifier,
    Options,
    Stop,
    Trace,
    check_call_steps,
    check_options,
    deferred_interrupts,
    finish,
    host_trace,
    run_stepwise,
)
from .._core import fail as _options_fail

try:  # a gradient tape left open around a call must not record it (see `Fit._call`)
    from tensorflow.python.eager.record import stop_recording as _not_recorded
except ImportError:  # pragma: no cover - other TF versions
    _not_recorded = contextlib.nullcontext

__all__ = ["fuse", "Fit"]

_INT = tf.int32


class _ArgumentError:
    """Marks stepfuse's own argument errors (so they are not re-wrapped as batch errors)."""


class _ArgTypeError(TypeError, _ArgumentError):
    pass


class _ArgValueError(ValueError, _ArgumentError):
    pass


def _fail(exc, name: str, value: Any, want: str, fix: str):
    """The shared argument error (`stepfuse._options._fail`), marked as stepfuse's own."""
    marked = {TypeError: _ArgTypeError, ValueError: _ArgValueError}.get(exc, exc)
    _options_fail(marked, name, value, want, fix)


def _tf_var(v):
    """The ``tf.Variable`` behind a Keras 3 variable (or ``v`` itself)."""
    return v.value if isinstance(v, keras.Variable) else v


def _check_optimizer(optimizer) -> None:
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        _fail(
            TypeError,
            "optimizer",
            optimizer,
            "a Keras 3 optimizer",
            "Pass e.g. keras.optimizers.SGD(0.01) or keras.optimizers.Adam(1e-3); "
            "optax optimizers go to stepfuse.jax, torch.optim ones to stepfuse.torch, "
            "tf.compat.v1.train ones to stepfuse.tf.v1.",
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        _fail(
            TypeError,
            "optimizer",
            optimizer,
            "an optimizer that is not a LossScaleOptimizer",
            "A fused loop stops at a non-finite gradient and never applies it (Stop.NONFINITE), "
            "while a LossScaleOptimizer needs those steps to lower its scale, so it would never "
            "train. Use mixed_bfloat16 (no loss scaling needed) or float32, with the inner "
            "optimizer.",
        )


def _check_variables(variables) -> list:
    fix = (
        "Pass a non-empty list of trainable floating-point tf.Variable / keras.Variable, "
        "a tf.Module, or a built Keras model (e.g. model.trainable_variables)."
    )
    given = variables
    if hasattr(variables, "trainable_variables") and not isinstance(variables, (list, tuple)):
        variables = list(variables.trainable_variables)
        if not variables:
            _fail(
                ValueError,
                "variables",
                given,
                "a module/model with trainable variables",
                "Build the model first (call it once on a batch or give it an Input) "
                "and make sure some layers are trainable.",
            )
    elif isinstance(variables, (tf.Variable, keras.Variable)):
        variables = [variables]
    elif isinstance(variables, (list, tuple)):
        variables = list(variables)
    else:
        _fail(
            TypeError, "variables", given, "a list of variables, a tf.Module or a Keras model", fix
        )
    if not variables:
        _fail(ValueError, "variables", given, "a non-empty list of variables", fix)
    seen = set()
    for v in variables:
        if not isinstance(v, (tf.Variable, keras.Variable)):
            _fail(
                TypeError,
                "variables",
                given,
                "a list of tf.Variable / keras.Variable only",
                f"{v!r} is not a variable. " + fix,
            )
        if not v.trainable:
            _fail(
                ValueError,
                "variables",
                given,
                "trainable variables",
                f"{getattr(v, 'name', v)!r} has trainable=False. " + fix,
            )
        if not tf.as_dtype(v.dtype).is_floating:
            _fail(
                TypeError,
                "variables",
                given,
                "floating-point variables",
                f"{getattr(v, 'name', v)!r} has dtype {tf.as_dtype(v.dtype).name}. " + fix,
            )
        if id(v) in seen:
            _fail(ValueError, "variables", given, "a list without duplicates", fix)
        seen.add(id(v))
    return variables


def _all_finite(tensors) -> tf.Tensor:
    """Whether every floating-point value in ``tensors`` is finite, as one reduction.

    ``x * 0`` is 0 for a finite ``x`` and NaN for inf or NaN, so the sum of ``x * 0`` over
    all values is finite exactly when each value is (a plain sum could overflow). One sum
    over the flattened, concatenated tensors is five ops whatever their number, against
    three per tensor for ``reduce_all(is_finite(t))``. Measured on the seed (TF1, a loss,
    two gradients and two new values checked; best of 10-15 rounds, interleaved): 2.0 ->
    1.8 us a step with XLA (two runs), 51-55 -> 50-52 without (three runs); the mlp and
    wide problems unchanged within noise.
    """
    flat = []
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        if t is not None and t.dtype.base_dtype.is_floating:
            flat.append(t)
    if not flat:
        return tf.constant(True)
    dtype = tf.float64 if any(t.dtype.base_dtype == tf.float64 for t in flat) else tf.float32
    flat = tf.concat([tf.reshape(tf.cast(t, dtype), [-1]) for t in flat], 0)
    return tf.math.is_finite(tf.reduce_sum(flat * 0))


_MIN_CHUNK = 256  # stepfuse.tf.v1's default for an int `steps` (its runs are one XLA call each)
# TF2: the steps one XLA launch of a call runs at most, unless `steps` is larger. A launch
# costs ~0.4-1 ms of wall time on this VM, so a call far longer than the built `steps`
# runs in chunks this long (a fit built with steps=100, called with 100,000 on the seed:
# 311-333 ms per call with chunks of 256, 242-258 ms with 16,384; 3-step calls unchanged
# within noise, 825-880 against 844-957 us each).
_TF2_MIN_CHUNK = 16384
# A progress bar alone (no callback) is drawn by a host thread (see `Notifier.watch`), so
# the loop publishes at a multiple of `every` once at least this long has passed, judged
# by the last chunk's speed (the first chunk's by the previous call's). Each publication
# ends an XLA launch, and on this 2-core VM a launch costs ~0.4-1 ms of wall time, mostly
# waiting for threads to wake (the seed, a 100,000-step call in chunks of 1,000: +39%
# against one chunk); 0.25 s keeps that under ~0.5% of a long call.
_PUBLISH_SECONDS = 0.25


_XLA_CHUNK = 32  # losses an XLA inner loop keeps on the side between copies into the trace


def _inner_loop(step, m, i0, prev, opts: Options, cap: int, xla: bool = False, dtype=tf.float32):
    """At most ``m`` guarded steps (the part of a call that XLA compiles).

    ``step()`` evaluates the loss and gradients at the current variables and applies the
    update unless something is non-finite; it returns ``(loss, ok)``. ``i0`` is the index
    within the call of the first step, ``prev`` the previous loss (for ``tol``). The loop
    ends early on tol or on a refused update. Returns the recorded losses (a buffer whose
    first ``count`` entries are this loop's: at least ``cap`` long under XLA, ``count``
    without), steps evaluated and applied, the stop code and the last loss.

    Without XLA each loss goes straight into a TensorArray. Under XLA a TensorArray
    write is an update of the whole buffer, which XLA:CPU copies at every step (the seed,
    a 16,384-entry buffer: ~0.8 us of a ~1.8 us step); there the losses of
    ``_XLA_CHUNK`` recorded steps gather in a small buffer, written into the trace once.
    The losses are kept as ``dtype``: float64 for a float64 loss, whose ``tol`` compares
    the losses themselves (a float32 copy rounds away differences of ~1e-7 relative).
    """
    r = opts.record_every
    first_slot = (i0 + r - 1) // r

    def guarded(j, applied):
        """One step at call index ``i0 + j``: (loss as `dtype`, as float64, applied, stop,
        recorded, slot)."""
        loss, ok = step()
        kept = tf.cast(loss, dtype)
        loss64 = tf.cast(kept, tf.float64)
        i = i0 + j
        applied = applied + tf.cast(ok, _INT)
        stop = tf.where(
            ok, tf.constant(int(Stop.STEPS), _INT), tf.constant(int(Stop.NONFINITE), _INT)
        )
        return kept, loss64, applied, stop, tf.equal(i % r, 0), i // r - first_slot

    zero = tf.constant(0, _INT)

    # The last loss, and with `tol` the one before it: `tol` is checked on these carried
    # values at the loop's test. Inside a step XLA fuses the loss's last operation into the
    # comparison and may round that copy differently (an FMA) from the one it records, so a
    # float64 `tol` within an ulp of a recorded difference stopped a step early or late.
    def shift(last, loss64):
        return (loss64, last[0]) if opts.tol is not None else (loss64,)

    def converged(last):
        """Whether the last two losses met `tol` (the last update was applied: TOL)."""
        if opts.tol is None:
            return tf.constant(False)
        return tf.abs(last[0] - last[1]) <= opts.tol  # NaN before the call's second step: False

    def running(j, stop, last):
        going = tf.logical_and(j < m, tf.equal(stop, 0))
        if opts.tol is None:
            return going
        # not `logical_not(converged)`: TF1's graph optimizer turns that into `diff > tol`,
        # which is False for a NaN difference (the first step's) and ended the loop there.
        diff = tf.abs(last[0] - last[1])
        return tf.logical_and(going, tf.logical_or(diff > opts.tol, tf.math.is_nan(diff)))

    last = (prev, tf.constant(math.nan, tf.float64)) if opts.tol is not None else (prev,)
    if not xla:

        def body(j, applied, stop, last, buf):
            kept, loss64, applied, stop, recorded, slot = guarded(j, applied)
            if r == 1:
                buf = buf.write(j, kept)
            else:
                buf = tf.cond(recorded, lambda: buf.write(slot, kept), lambda: buf)
            return j + 1, applied, stop, shift(last, loss64), buf

        # Sized by what is written: stacking a TensorArray of `cap` entries costs ~2 ms a
        # call at cap = 16,384 however few steps ran (the seed, a 1-step call).
        buf = tf.TensorArray(dtype, size=0, dynamic_size=True, element_shape=[])
        j, applied, stop, last, buf = tf.while_loop(
            lambda j, a, s, p, b: running(j, s, p),
            body,
            (zero, zero, zero, last, buf),
            maximum_iterations=m,
        )
        buf = buf.stack()
    else:
        C = _XLA_CHUNK
        where = tf.range(C, dtype=_INT)

        def chunk(j, applied, stop, last, chunks, k):
            """The steps whose losses fill slots [k C, (k + 1) C) of the buffer."""
            end = tf.minimum(m, ((k + 1) * C + first_slot) * r - i0)

            def body(j, applied, stop, last, small):
                kept, loss64, applied, stop, recorded, slot = guarded(j, applied)
                small = tf.where(
                    tf.logical_and(recorded, tf.equal(where, slot - k * C)), kept, small
                )
                return j + 1, applied, stop, shift(last, loss64), small

            j, applied, stop, last, small = tf.while_loop(
                lambda j, a, s, p, b: tf.logical_and(running(j, s, p), j < end),
                body,
                (j, applied, stop, last, tf.fill([C], tf.constant(math.nan, dtype))),
            )
            return j, applied, stop, last, chunks.write(k, small), k + 1

        chunks = tf.TensorArray(dtype, size=-(-cap // C), element_shape=[C])
        j, applied, stop, last, chunks, _ = tf.while_loop(
            lambda j, a, s, p, c, k: running(j, s, p), chunk, (zero, zero, zero, last, chunks, zero)
        )
        buf = tf.reshape(chunks.stack(), [-1])
    if opts.tol is not None:
        met = tf.logical_and(tf.equal(stop, 0), converged(last))
        stop = tf.where(met, tf.constant(int(Stop.TOL), _INT), stop)
    count = (i0 + j + r - 1) // r - first_slot
    return buf, count, j, applied, stop, last[0]


def _outer_loop(
    inner,
    n,
    step0,
    opts: Options,
    chunk: int,
    notify=None,
    publish=None,
    speed=None,
    dtype=tf.float32,
    count=None,
):
    """A whole call: ``inner`` chunks of at most ``chunk`` steps until ``n`` or a stop.

    Runs outside XLA, so the trace can grow with ``n`` (a TensorArray of the chunks'
    recorded losses) and notifications reach the host (``notify(step, loss)`` through
    ``tf.numpy_function``: ~200 us per call here against ~360 for ``tf.py_function``) between
    chunks. With ``publish`` (a float64 variable of 2) each chunk writes ``(step, loss)``
    there instead, for a host thread to read: the loop never waits for Python, and a
    chunk runs to the first multiple of `every` at least ``_PUBLISH_SECONDS`` away at the
    last chunk's speed; the first chunk at ``speed`` (steps per second, a float64 scalar:
    the previous call's), or when that is 0 to the first multiple. ``count`` (an int64
    variable) gets each chunk's applied updates before its notification, so a callback
    that raises leaves it right.
    Returns ``(losses, applied, stop, last loss)``.
    """

    def cond(i, applied, stop, prev, ta, k, ticks, clock):
        return tf.logical_and(i < n, tf.equal(stop, 0))

    def body(i, applied, stop, prev, ta, k, ticks, clock):
        m = tf.minimum(tf.constant(chunk, _INT), n - i)
        if opts.notify:  # a chunk ends at a multiple of `every` (the XLA loop needn't check)
            gstep = step0 + tf.cast(applied, tf.int64)
            ahead = tf.constant(1, tf.int64)
            if publish is not None:  # a bar alone: see _PUBLISH_SECONDS
                ahead = tf.maximum(ahead, tf.cast(clock[1] * _PUBLISH_SECONDS, tf.int64))
            end = (gstep + ahead + opts.every - 1) // opts.every * opts.every
            m = tf.minimum(m, tf.cast(end - gstep, _INT))
        buf, kept, j, a, stop, prev = inner(m, i, prev)
        ta = ta.write(k, buf[:kept])
        applied = applied + a
        if count is not None:
            with tf.control_dependencies([count.assign_add(tf.cast(a, tf.int64))]):
                a = tf.identity(a)
        gstep = step0 + tf.cast(applied, tf.int64)
        if publish is not None:
            publish.assign(tf.stack([tf.cast(gstep, tf.float64), prev]))
            with tf.control_dependencies([j]):
                t1 = tf.timestamp()
            clock = tf.stack([t1, tf.cast(j, tf.float64) / tf.maximum(t1 - clock[0], 1e-9)])
        if notify is not None:
            due = tf.logical_and(a > 0, tf.equal(gstep % opts.every, 0))  # (after `count`)
            ticks = tf.cond(
                due,
                lambda: ticks + tf.reshape(tf.numpy_function(notify, [gstep, prev], _INT), []),
                lambda: ticks,
            )
            with tf.control_dependencies([ticks]):  # a TF1 graph would prune the unread count
                j = tf.identity(j)
        return i + j, applied, stop, prev, ta, k + 1, ticks, clock

    ta = tf.TensorArray(dtype, size=0, dynamic_size=True, infer_shape=False, element_shape=[None])
    # (time the last chunk ended, its steps per second): sizes a bar's chunks
    clock = tf.stack([tf.timestamp(), tf.constant(0, tf.float64) if speed is None else speed])
    init = (
        tf.constant(0, _INT),
        tf.constant(0, _INT),
        tf.constant(0, _INT),
        tf.constant(math.nan, tf.float64),
        ta,
        tf.constant(0, _INT),
        tf.constant(0, _INT),
        clock,
    )
    _, applied, stop, prev, ta, _, _, _ = tf.while_loop(cond, body, init)
    return ta.concat(), applied, stop, prev


class Fit:
    """A fused fit: ``fit(*batch, steps=None)`` runs the steps in one ``tf.function`` call.

    Built by `fuse`. Attributes: ``step`` (updates applied since the fit was built),
    ``traces`` (how many times a fused program was traced: it stays at 1 across calls
    with new ``steps`` and new batch values of the same shapes/dtypes; without a callback
    or bar, a call longer than ``max(steps, 16384)`` runs the compiled loop inside a graph
    loop, as every call with one does: a second program, traced once), ``jit_compile``
    (whether the loop is XLA-compiled; turned off with a warning when an op can't be),
    ``variables`` and ``optimizer``.
    """

    def __init__(self, loss_fn, optimizer, variables, opts: Options, jit_compile: bool, held=()):
        self.loss_fn, self.optimizer, self.variables, self.opts = (
            loss_fn,
            optimizer,
            variables,
            opts,
        )
        self.jit_compile = bool(jit_compile)
        self.step = 0
        self.traces = 0
        self._compiled = set()  # the programs (whole / outer) that have run once
        self._tf_vars = [_tf_var(v) for v in variables]
        if not optimizer.built:
            optimizer.build(variables)
        # Everything a refused update must leave untouched: parameters and optimizer state.
        self._state = self._tf_vars + [_tf_var(v) for v in optimizer.variables]
        # The model's other variables that the forward pass may change: read before it and
        # put back with the rest when a step is refused (see `fuse`).
        ids = {id(v) for v in self._state}
        self._held = [t for t in map(_tf_var, held) if id(t) not in ids]
        self._chunk = max(opts.steps, _TF2_MIN_CHUNK)  # steps one (XLA) inner loop runs at most
        # A progress bar alone needs no synchronous host call: the loop publishes
        # (step, loss) in this variable and a thread reads it (see `Notifier.watch`).
        # Measured on the seed problem (every=100, 1,000 notifications per call): ~20 us per
        # notification, against ~110 us through tf.numpy_function, which a callback needs
        # (it may raise, and the loop must stop there).
        self._published = (
            tf.Variable([math.nan, math.nan], dtype=tf.float64, trainable=False)
            if opts.progress and opts.callback is None
            else None
        )
        # The last call's speed (steps per second) sizes a bar's first chunk: one XLA launch
        # less per call (a launch costs ~0.4-1 ms here; see _PUBLISH_SECONDS).
        self._steps_per_second = 0.0
        # Losses one inner loop records at most. With a callback a chunk ends at the next
        # multiple of `every`, which bounds it: the buffer is zeroed and copied at every XLA
        # launch (measured: a 100,000-entry one cost ~170 us more per notification). A bar
        # alone sizes its chunks by time (see `_outer_loop`), so only `chunk` bounds them.
        window = min(self._chunk, opts.every) if opts.callback is not None else self._chunk
        self._cap = -(-window // opts.record_every)
        self._notifier: Notifier | None = None
        self._notified_step: int | None = None
        self._trace_dtype = tf.float32  # the loss dtype of the batch being traced (see `_call`)
        self._callback_error: BaseException | None = None
        self._learning_rate = _learning_rate_of(optimizer)  # what the programs were traced with
        # The nesting of the batch the programs were traced for: they take its tensors
        # flat and `_loss_and_grads` packs them back for loss_fn (dicts, tuples ...).
        self._structure = None
        self._build()

    # -- building -----------------------------------------------------------------------

    def _build(self) -> None:
        inner = self._inner_py
        if self.jit_compile:
            inner = tf.function(inner, jit_compile=True, autograph=False)
        self._inner = inner
        self._outer = tf.function(self._outer_py, autograph=False)
        # A call of at most `chunk` steps with nothing to notify is the inner loop alone,
        # one launch without the graph loop around it (measured on the seed with XLA, two
        # instances, best of 15 x 20 calls: 1 step 0.76-0.81 -> 0.40-0.42 ms a call; 10
        # steps 0.82-0.88 -> 0.43-0.46; 100 steps 1.02-1.04 -> 0.50-0.61).
        self._whole = (
            None
            if self.opts.notify
            else tf.function(self._whole_py, jit_compile=self.jit_compile, autograph=False)
        )
        self._single = None
        self._concrete = {}  # (program, batch signature) -> the traced function; see `_call`

    def _call(self, program, head, batch):
        """``program(*head, *batch)`` through the concrete function traced for these
        arguments' dtypes and shapes (the losses kept in the batch's loss dtype).

        A ``tf.function`` call first matches its arguments against the traced signatures,
        ~140 us of Python a call here; a call of 1-100 steps on the seed is ~0.4 ms in all.
        Looking the concrete function up by dtypes and shapes skips that (the seed, a
        1-step call: 253 -> 56 us for the program call alone, best of 15 x 50). Tracing,
        and so ``traces``, is unchanged: ``get_concrete_function`` traces what a call would.
        """
        args = (*head, *batch)
        key = (program, tuple((a.dtype, tuple(a.shape)) for a in args))
        concrete = self._concrete.get(key)
        if concrete is None:
            self._trace_dtype = self._loss_dtype(batch)
            concrete = self._concrete[key] = program.get_concrete_function(*args)
        call_flat = getattr(concrete, "_call_flat", None)
        # Not recorded by a tape the caller has open: the call updates variables in place
        # and is not differentiable, and recording it asks XLA for a gradient-ready
        # program it cannot compile (the loss buffer).
        with _not_recorded():
            if call_flat is None:  # the tensors match its signature: a plain call is the same
                return concrete(*args)
            return call_flat(list(args), concrete.captured_inputs)

    def _loss_dtype(self, batch) -> tf.DType:
        """The trace's dtype for this batch: float64 for a float64 loss, else float32. Found
        by tracing the loss alone in a scratch graph (nothing runs), once per batch
        signature, before the program is traced: inside it the loss is known only within
        the loop, after its buffers are made."""
        specs = [tf.TensorSpec(b.shape, b.dtype) for b in batch]
        loss = (
            tf.function(lambda *b: self._loss_and_grads(b)[0], autograph=False)
            .get_concrete_function(*specs)
            .structured_outputs
        )
        return tf.float64 if loss.dtype.base_dtype == tf.float64 else tf.float32

    def _loss_and_grads(self, batch):
        batch = tf.nest.pack_sequence_as(self._structure, list(batch))
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
                shapes = tf.nest.map_structure(
                    lambda b: f"{b.dtype.name}{list(b.shape)}", list(batch)
                )
                exc = TypeError if isinstance(e, TypeError) else ValueError
                raise exc(
                    f"`batch` must fit loss_fn; got {len(batch)} tensor(s) {shapes} and "
                    f"loss_fn(*batch) failed while tracing: {e} -- Pass the tensors loss_fn "
                    "expects (count, shapes, dtypes), e.g. fit(x, y) for loss_fn(x, y)."
                ) from e
        _check_loss(loss, self.loss_fn)
        loss = tf.convert_to_tensor(loss)
        grads = tape.gradient(loss, self._tf_vars)
        missing = [v.name for v, g in zip(self._tf_vars, grads) if g is None]
        if missing:
            _fail(
                ValueError,
                "loss_fn",
                self.loss_fn,
                "a loss that depends on every variable",
                f"No gradient reaches {missing}: read those variables inside loss_fn "
                "(not their numpy() values), or leave them out of `variables`.",
            )
        return loss, grads

    def _apply_checked(self, loss, grads):
        """Apply the optimizer's update: ``(snapshot, new, ok)``, the state before and after
        it and whether loss, gradients and new state are all finite."""
        snapshot = [v.read_value() for v in self._state]
        self.optimizer.apply_gradients(zip(grads, self.variables))
        new = [v.read_value() for v in self._state]
        return snapshot, new, _all_finite([loss, *grads, *new])

    def _guarded_update(self, loss, grads, held=()):
        """Apply the optimizer's update; undo it (state and counters, and ``held``: the
        model's other variables as read before the forward pass) if anything is non-finite."""
        snapshot, _, ok = self._apply_checked(loss, grads)

        def restore():
            for v, old in zip(self._state + self._held, snapshot + list(held)):
                v.assign(old)
            return tf.constant(False)

        return tf.cond(ok, lambda: tf.constant(True), restore)

    def _inner_py(self, m, i0, prev, *batch):
        def step():
            held = [v.read_value() for v in self._held]
            loss, grads = self._loss_and_grads(batch)
            return loss, self._guarded_update(loss, grads, held)

        return _inner_loop(
            step, m, i0, prev, self.opts, self._cap, xla=self.jit_compile, dtype=self._trace_dtype
        )

    def _whole_py(self, n, *batch):
        self.traces += 1
        buf, count, _, applied, stop, _ = self._inner_py(
            n, tf.constant(0, _INT), tf.constant(math.nan, tf.float64), *batch
        )
        return buf, count, applied, stop

    def _outer_py(self, n, step0, speed, *batch):
        self.traces += 1
        return _outer_loop(
            lambda m, i0, prev: self._inner(m, i0, prev, *batch),
            n,
            step0,
            self.opts,
            self._chunk,
            self._notify_host if self.opts.notify and self._published is None else None,
            self._published,
            speed,
            dtype=self._trace_dtype,
        )

    def _notify_host(self, step, loss):
        step = int(step)
        self._notified_step = step
        try:
            self._notifier(step, float(loss))
        except BaseException as e:  # noqa: BLE001 - handed back to the caller as is
            self._callback_error = e
            raise
        return np.int32(1)

    # -- calling ------------------------------------------------------------------------

    def __call__(self, *batch, steps=None) -> Trace:
        """Run ``steps`` (default: the ``steps`` given to `fuse`) updates; returns the `Trace`."""
        n = check_call_steps(steps, self.opts, capped=False)
        if not tf.executing_eagerly():
            raise RuntimeError(
                "stepfuse.tf: call the fit eagerly, not inside a tf.function or graph: it "
                "compiles its own tf.function (all steps in one call) and reads the trace "
                "back on the host. Call fit(*batch) from Python; for TF1 graphs use "
                "stepfuse.tf.v1.fuse."
            )
        batch, structure = _flat_batch(batch)
        start = self.step
        if structure != self._structure:  # another nesting of tensors: trace again
            if self._structure is not None:
                self._build()
            self._structure = structure
        if _learning_rate_of(self.optimizer) is not self._learning_rate:
            # `optimizer.learning_rate = schedule` (or a callable) replaces the variable the
            # programs read: trace them again (assigning a float writes into the variable).
            self._learning_rate = _learning_rate_of(self.optimizer)
            self._build()
        if self.opts.mode == "stepwise":
            return self._call_stepwise(batch, n, start)
        self._callback_error, self._notified_step = None, None
        # Python's Ctrl-C handler runs in the main thread only, which is inside the call
        # until it returns (callbacks run on TF's threads): it could land between the
        # variables' update and `self.step`'s, so hold it until both are done.
        with deferred_interrupts(), Notifier(self.opts, start, n, label="stepfuse.tf") as notifier:
            self._notifier = notifier
            if self._published is not None:
                notifier.watch(self._published.numpy)
            try:
                losses, applied, stop, last = self._run(n, start, batch)
            except tf.errors.OpError:
                err = self._callback_error
                if err is not None:  # the user's callback raised: hand it back as is
                    if self._notified_step is not None:
                        self.step = self._notified_step
                    raise err from None
                raise
            finally:
                self._notifier = None
            notifier.done(applied, None if last is None else float(last))
            self.step = start + int(applied)
        return finish(
            host_trace(losses, int(applied), int(stop), self.opts.record_every), self.opts, start
        )

    def _run(self, n, start, batch):
        """The call's program: ``(losses as numpy, applied, stop, last loss)``; the last loss
        only from the program that notifies (else None)."""
        whole = self._whole is not None and n <= self._chunk
        if whole:

            def run():
                buf, count, applied, stop = self._call(self._whole, (tf.constant(n, _INT),), batch)
                return buf.numpy()[: int(count)], applied, stop, None
        else:

            def run():
                t0 = time.perf_counter()
                losses, applied, stop, last = self._call(
                    self._outer,
                    (
                        tf.constant(n, _INT),
                        tf.constant(start, tf.int64),
                        tf.constant(self._steps_per_second, tf.float64),
                    ),
                    batch,
                )
                losses = losses.numpy()
                if self._published is not None and int(applied):
                    self._steps_per_second = int(applied) / (time.perf_counter() - t0)
                return losses, applied, stop, last

        return self._xla_or_plain(whole, run, "the fused loop", stacklevel=4)

    def _xla_or_plain(self, key, run, what: str, stacklevel: int):
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
                warnings.warn(
                    f"stepfuse.tf: {what} could not be XLA-compiled, so it runs without XLA "
                    f"(slower). Pass jit_compile=False to silence this. Cause: {msg.splitlines()[0][:300]}",
                    RuntimeWarning,
                    stacklevel=stacklevel,
                )
                self.jit_compile = False
                self._build()
                out = run()
        self._compiled.add(key)
        return out

    # -- the stepwise reference -------------------------------------------------------

    def _propose_py(self, *batch):
        held = [v.read_value() for v in self._held]
        loss, grads = self._loss_and_grads(batch)
        snapshot, new, finite = self._apply_checked(loss, grads)
        with tf.control_dependencies(new):
            for v, old in zip(self._state, snapshot):
                v.assign(old)
        # A refused step also leaves the model's other variables as they were before it.
        tf.cond(
            finite, tf.no_op, lambda: tf.group(*[v.assign(o) for v, o in zip(self._held, held)])
        )
        return loss, finite, new

    def _propose_once(self, batch):
        """One proposed step through a ``tf.function``, XLA-compiled as the fused loop is
        (so random ops, e.g. Dropout, draw what the fused loop draws)."""
        return self._xla_or_plain(
            "stepwise", lambda: self._stepwise_functions()[0](*batch), "the step", stacklevel=7
        )

    def _stepwise_functions(self):
        if self._single is None:
            self._single = (
                tf.function(self._propose_py, autograph=False, jit_compile=self.jit_compile),
                tf.function(self._commit_py, autograph=False),
            )
            self.traces += 1
        return self._single

    def _commit_py(self, new):
        for v, value in zip(self._state, new):
            v.assign(value)

    def _call_stepwise(self, batch, n, start) -> Trace:
        self._callback_error = None  # a fused call's, which would hide an XLA failure here

        def propose():
            loss, finite, new = self._propose_once(batch)
            return loss.numpy(), bool(finite), new

        def commit(new):
            with deferred_interrupts():  # variables, optimizer state and step move together
                self._stepwise_functions()[1](new)
                self.step += 1

        with Notifier(self.opts, start, n, label="stepfuse.tf") as notifier:
            trace = run_stepwise(
                propose, commit, n, self.opts, start, notifier if self.opts.notify else None
            )
            notifier.done(trace.steps)
        return finish(trace, self.opts, start)


def _flat_batch(batch):
    """``(tensors, structure)``: the batch's tensors in `tf.nest` order (a batch argument
    may be a dict, tuple or list of them) and its nesting with the tensors as 0s."""
    if all(isinstance(b, tf.Tensor) for b in batch):  # the usual case: ~25 us less a call
        return batch, (0,) * len(batch)
    flat = []
    for i, b in enumerate(tf.nest.flatten(batch)):
        if isinstance(b, (tf.SparseTensor, tf.RaggedTensor)):
            raise TypeError(
                f"`batch` must hold dense tensors; got a {type(b).__name__} ({b.dtype.name}, shape "
                f"{list(b.shape)}) as tensor {i}. Pass it dense (tf.sparse.to_dense / .to_tensor()), "
                "or its component tensors, and rebuild it inside loss_fn."
            )
        try:
            flat.append(tf.convert_to_tensor(b))
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"`batch` must hold tensors (or arrays, numbers), also inside dicts, tuples and "
                f"lists; tensor {i} of it is {type(b).__name__}, which TensorFlow cannot convert "
                f"({e}). Pass the values loss_fn needs as tensors."
            ) from None
    return tuple(flat), tf.nest.map_structure(lambda _: 0, batch)


def _learning_rate_of(optimizer):
    """The object a Keras optimizer reads its learning rate from (a variable, a schedule or
    a callable), which ``optimizer.learning_rate = ...`` may replace."""
    return getattr(optimizer, "_learning_rate", None)


def _check_loss(loss, loss_fn) -> None:
    try:
        t = tf.convert_to_tensor(loss)
    except (TypeError, ValueError):
        _fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "a function returning a scalar float tensor",
            f"It returned {loss!r}; return e.g. tf.reduce_mean(...).",
        )
    if t.shape.rank != 0:
        _fail(
            ValueError,
            "loss_fn",
            loss_fn,
            "a function returning a scalar (shape ())",
            f"It returned a tensor of shape {t.shape}; reduce it, e.g. tf.reduce_mean(loss).",
        )
    if not t.dtype.is_floating:
        _fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "a function returning a floating-point scalar",
            f"It returned dtype {t.dtype.name}; cast it, e.g. tf.cast(loss, tf.float32).",
        )
    return t


def fuse(
    loss_fn: Callable[..., Any],
    optimizer,
    variables,
    *,
    steps: int,
    tol: float | None = None,
    record_every: int = 1,
    callback: Callable[[int, float], Any] | None = None,
    every: int | None = None,
    progress: bool = False,
    on_nonfinite: str = "stop",
    mode: str = "fused",
    jit_compile: bool = True,
) -> Fit:
    """Build a fused fit that runs many Keras-optimizer steps in one ``tf.function`` call.

    Args:
      loss_fn: ``loss_fn(*batch)`` reads the variables and returns a scalar float tensor.
        It is traced once (its Python body runs at trace time only).
      optimizer: a Keras 3 optimizer (``keras.optimizers.SGD``, ``Adam``, ``AdamW``,
        ``RMSprop``...). Its slot variables are built here; its own update rule is used.
      variables: a list of trainable float ``tf.Variable`` / ``keras.Variable``, a
        ``tf.Module`` or a built Keras model (its ``trainable_variables``).
    {options}
      jit_compile: XLA-compile the step loop (default), and the stepwise mode's step (so
        random ops draw what the fused loop draws). If an op can't be compiled, the first
        call warns and falls back to a plain ``tf.function``.

    Returns:
      a `Fit`; ``trace = fit(*batch, steps=None)`` updates the variables and the optimizer
      state in place and returns a `stepfuse.Trace`. Any ``steps`` reuses the same traced
      program; so do new batch values of the same shapes and dtypes.

    Example:
      >>> import keras, tensorflow as tf, stepfuse.tf as sf
      >>> from stepfuse.problems import blobs
      >>> x, y = blobs()
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
      >>> ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
      >>> fit = sf.fuse(lambda x, y: ce(y, model(x)), keras.optimizers.SGD(0.01), model, steps=3)
      >>> trace = fit(x, y)                 # 3 updates, one tf.function call
      >>> trace = fit(x, y, steps=1000)     # same program, no retrace
    """
    opts = check_options(steps, tol, record_every, callback, every, progress, on_nonfinite, mode)
    if not callable(loss_fn):
        _fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "callable as loss_fn(*batch) -> scalar tensor",
            "Pass a function that reads the variables and returns the loss.",
        )
    _check_optimizer(optimizer)
    # A model's non-trainable variables (BatchNorm statistics, dropout seeds) change in the
    # forward pass: a refused step puts them back too.
    held = list(getattr(variables, "non_trainable_variables", None) or [])  # a module's or model's
    variables = _check_variables(variables)
    if not isinstance(jit_compile, bool):
        _fail(
            TypeError,
            "jit_compile",
            jit_compile,
            "True or False",
            "Pass jit_compile=False to run the loop without XLA.",
        )
    return Fit(loss_fn, optimizer, variables, opts, jit_compile, held=held)


fuse.__doc__ = fuse.__doc__.replace("    {options}", textwrap.indent(OPTIONS_DOC, "  "))
