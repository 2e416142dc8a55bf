"""The graph loops both TF backends run: a call's steps as an (XLA-compiled) inner
``tf.while_loop`` of guarded steps, chained by an outer loop that reaches the host
between chunks; and the finite check of one step. Shared by `stepfuse.tf` (TF2) and
`stepfuse.tf.v1` (TF1).

A loop may also be cut into segments (`Segments`: TF2's evaluation inside the loop),
each followed by a step of its own outside the steps' loop, and the outer loop may gather
more outputs of each launch (``gather``); without them the graphs are those built
before either existed."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import tensorflow as tf

from .._core import Flow, Options, Stop, ceil_div, loop, next_multiple
from ._ops import OPS

_INT = tf.int32


def _all_finite(tensors: Any) -> tf.Tensor:
    """Whether every floating-point value in ``tensors`` is finite (see `_finite_probe`;
    under XLA the check by shape itself, without the probe's round trip through a float)."""
    if not _XLA.get():
        return tf.math.is_finite(_finite_probe(tensors))
    flat = _floating(tensors)
    return _finite_by_shape(flat) if flat else tf.constant(True)


# Whether the step being traced is compiled by XLA (set by `_inner_loop` and `xla_traced`):
# the cheapest finite check differs between XLA and TensorFlow's kernels (`_finite_probe`).
_XLA = contextvars.ContextVar("stepfuse_tf_xla", default=False)


@contextlib.contextmanager
def xla_traced(xla: bool) -> Iterator[None]:
    """Within: the steps traced are compiled by XLA when ``xla`` (see `_finite_probe`)."""
    token = _XLA.set(bool(xla))
    try:
        yield
    finally:
        _XLA.reset(token)


def _finite_probe(tensors: Any) -> tf.Tensor:
    """A scalar (float64 if any value is, else float32) that is 0 when every
    floating-point value in ``tensors`` is finite and NaN otherwise. Probes add up: the
    sum of several is finite exactly when each is.

    On TensorFlow's kernels it is the sum of ``x * 0`` over the flattened, concatenated
    tensors (``x * 0`` is 0 for a finite ``x``, NaN for inf or NaN; a plain sum could
    overflow): a fixed handful of ops whatever the tensors' number, where
    ``reduce_all(is_finite(t))`` costs a few per tensor. Under XLA:CPU, where an op costs
    little but a concatenation ~0.85 ns a value, the tensors are grouped by shape (a
    weight, its gradient and its optimizer moments share one) and each group's
    ``is_finite`` masks and-ed, one fused pass a group (`_finite_by_shape`;
    docs/internals/tf.md).
    """
    flat = _floating(tensors)
    if not flat:
        return tf.constant(0.0)
    dtype = tf.float64 if any(t.dtype.base_dtype == tf.float64 for t in flat) else tf.float32
    if _XLA.get():
        return tf.where(_finite_by_shape(flat), tf.constant(0, dtype), tf.constant(math.nan, dtype))
    return tf.reduce_sum(tf.concat([tf.reshape(tf.cast(t, dtype), [-1]) for t in flat], 0) * 0)


def _floating(tensors: Any) -> list:
    """The floating-point tensors of ``tensors`` (an ``IndexedSlices``' values; None and
    integer tensors left out)."""
    flat = []
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        if t is not None and t.dtype.base_dtype.is_floating:
            flat.append(t)
    return flat


def _finite_by_shape(flat: list) -> tf.Tensor:
    """Whether every value of ``flat`` is finite, for XLA: the ``is_finite`` masks of the
    tensors of one (static) shape and-ed together, which XLA fuses into one pass; the
    masks of fewer than `_CONCAT_BELOW` values flattened into one reduction, each larger
    one reduced on its own (a concatenation costs ~0.85 ns a value)."""
    groups: dict[Any, Any] = {}
    for k, t in enumerate(flat):
        shape = t.shape
        key = tuple(shape.as_list()) if shape.is_fully_defined() else ("unknown", k)
        mask = tf.math.is_finite(t)
        groups[key] = mask if key not in groups else tf.logical_and(groups[key], mask)
    small = [tf.reshape(m, [-1]) for m in groups.values() if _values(m) < _CONCAT_BELOW]
    oks = [tf.reduce_all(m) for m in groups.values() if _values(m) >= _CONCAT_BELOW]
    if small:
        oks.append(tf.reduce_all(small[0] if len(small) == 1 else tf.concat(small, 0)))
    return oks[0] if len(oks) == 1 else tf.reduce_all(tf.stack(oks))


_CONCAT_BELOW = 512  # see `_finite_by_shape`


def _values(t: Any) -> int:
    """The number of values of ``t`` (unknown dimensions counted as large)."""
    n = t.shape.num_elements()
    return _CONCAT_BELOW if n is None else int(n)


# A progress bar alone (no callback) is drawn by a host thread (see `Notifier.watch`), so
# the loop publishes at a multiple of `every` once at least this long has passed, judged
# by the last chunk's speed (the first chunk's by the previous call's). Each publication
# ends an XLA launch, and a launch costs wall time, mostly waiting for threads to wake;
# 0.25 s keeps that a small fraction of a long call (docs/internals/tf.md).
_PUBLISH_SECONDS = 0.25


_LOSSES_PER_COPY = 32  # losses an XLA inner loop keeps on the side between copies into the trace


class Segments(Protocol):
    """Cuts an inner loop into segments, with a step of its own after each (TF2's
    evaluations): the steps' loop runs unchanged within a segment, and ``after`` runs
    between segments, once per segment, never per step.

    Attributes:
      state: the tensors ``after`` carries from segment to segment (loop variables).
    """

    state: tuple

    def end(self, flow: Flow) -> Any:
        """The inner loop's iteration (``flow.i``, int32) at which the segment that
        starts at ``flow`` ends."""
        ...

    def after(self, before: Flow, flow: Flow, state: tuple) -> tuple:
        """``state`` after the segment that went from ``before`` to ``flow``."""
        ...


class Gather(Protocol):
    """More outputs of each launch of the inner loop, gathered by `_outer_loop`."""

    def start(self) -> tuple:
        """The loop variables that gather them (e.g. ``TensorArray`` objects)."""
        ...

    def write(self, held: tuple, k: Any, outputs: list) -> tuple:
        """``held`` with launch ``k``'s ``outputs`` (those after the usual six)."""
        ...

    def finish(self, held: tuple) -> tuple:
        """The gathered outputs of the call."""
        ...


class Buffers:
    """A `Gather` of buffers each launch returns after a count of their entries (its
    evaluations: steps, then values): launch ``k``'s ``buffer[:count]`` of each, in
    ``TensorArray`` objects, concatenated at the end of the call."""

    def __init__(self, dtypes: Sequence[Any]):
        self.dtypes = tuple(dtypes)

    def start(self) -> tuple:
        return tuple(
            tf.TensorArray(d, size=0, dynamic_size=True, infer_shape=False, element_shape=[None])
            for d in self.dtypes
        )

    def write(self, held: tuple, k: Any, outputs: list) -> tuple:
        count, *buffers = outputs
        return tuple(ta.write(k, b[:count]) for ta, b in zip(held, buffers))

    def finish(self, held: tuple) -> tuple:
        return tuple(ta.concat() for ta in held)


def _inner_loop(
    step: Any,
    m: Any,
    i0: Any,
    prev: Any,
    opts: Options,
    cap: int,
    xla: bool = False,
    dtype: Any = tf.float32,
    carry: tuple | None = None,
    segments: Segments | None = None,
) -> Any:
    """At most ``m`` guarded steps (the part of a call that XLA compiles).

    ``step()`` evaluates the loss and gradients at the current variables and applies the
    update unless something is non-finite; it returns ``(loss, ok)``. ``i0`` is the index
    within the call of the first step, ``prev`` the previous loss (for ``tol``). The loop
    ends early on tol or on a refused update. Returns the recorded losses (a buffer whose
    first ``count`` entries are this loop's: at least ``cap`` long under XLA, ``count``
    without), steps evaluated and applied, the stop code and the last loss.

    Without XLA each loss goes straight into a TensorArray. Under XLA a TensorArray
    write is an update of the whole buffer, which XLA:CPU copies at every step (a large
    part of a small model's step); there the losses of ``_LOSSES_PER_COPY`` recorded
    steps gather in a small buffer, written into the trace once.
    The losses are kept as ``dtype``: float64 for a float64 loss, whose ``tol`` compares
    the losses themselves (a float32 copy rounds away differences of ~1e-7 relative).

    ``segments``: the steps run in segments, each followed by ``segments.after`` (under
    XLA within a chunk of losses); its final state comes last in what the loop returns.
    """
    r = opts.record_every
    first_slot = ceil_div(i0, r)  # the record index of this loop's first recorded loss
    # `tol` is checked on the carried losses at the loop's test (see `loop.converged`), in
    # float64, where the recorded losses of every dtype are exact.
    met = None if opts.tol is None else loop.within_tol(OPS, opts.tol, np.float64)
    nan32, nan64 = tf.constant(math.nan, tf.float32), tf.constant(math.nan, tf.float64)

    extra = len(carry) if carry is not None else 0

    def guarded(flow: Flow, held: tuple) -> tuple[Any, Flow, tuple]:
        """One step at call index ``i0 + flow.i``: (its loss as `dtype`, the next Flow,
        the next carry)."""
        with xla_traced(xla):  # (its finite check: see `_finite_probe`)
            if carry is None:
                loss, ok = step()
            else:
                loss, ok, held = step(held)
        kept = tf.cast(loss, dtype)
        probe = tf.where(ok, tf.constant(0, tf.float32), nan32)
        return kept, loop.advance(flow, tf.cast(kept, tf.float64), probe), tuple(held)

    # A Flow's fields and the carry as loop variables (tf.while_loop takes no None:
    # `before` is carried with `tol` only) and back.
    def flat(flow: Flow, held: tuple = ()) -> tuple:
        return (*held, *(x for x in flow if x is not None))

    def split(values: Any) -> tuple[Flow, tuple]:
        held, (i, probe, last, *before) = tuple(values[:extra]), values[extra:]
        return Flow(i, probe, last, before[0] if before else None), held

    def unflat(values: Any) -> Flow:
        return split(values)[0]

    def running(values: Any) -> Any:
        return loop.running(OPS, unflat(values), m, met)

    flow0 = Flow(
        tf.constant(0, _INT), tf.constant(0, tf.float32), prev, nan64 if met is not None else None
    )
    if not xla:

        def body(values: Any, buf: Any) -> Any:
            flow, held = split(values)
            kept, new, held = guarded(flow, held)
            i = i0 + flow.i
            if r == 1:
                buf = buf.write(flow.i, kept)
            else:
                slot = loop.record_slot(i, r, first_slot, -1, OPS)
                buf = tf.cond(slot >= 0, lambda: buf.write(slot, kept), lambda: buf)
            return flat(new, held), buf

        # Sized by what is written: stacking a TensorArray of `cap` entries costs time
        # however few steps ran.
        buf = tf.TensorArray(dtype, size=0, dynamic_size=True, element_shape=[])
        if segments is None:
            values, buf = tf.while_loop(
                lambda v, b: running(v), body, (flat(flow0, carry or ()), buf), maximum_iterations=m
            )
        else:

            def segment(values: Any, buf: Any, state: tuple) -> Any:
                end = tf.minimum(m, segments.end(unflat(values)))
                new, buf = tf.while_loop(
                    lambda v, b: tf.logical_and(running(v), unflat(v).i < end), body, (values, buf)
                )
                return new, buf, segments.after(unflat(values), unflat(new), state)

            values, buf, state = tf.while_loop(
                lambda v, b, s: running(v),
                segment,
                (flat(flow0, carry or ()), buf, segments.state),
            )
        buf = buf.stack()
    else:
        C = _LOSSES_PER_COPY
        where = tf.range(C, dtype=_INT)

        def chunk(values: Any, chunks: Any, k: Any, *state: tuple) -> Any:
            """The steps whose losses fill slots [k C, (k + 1) C) of the buffer (and the
            segments' ``state`` with them)."""
            end = tf.minimum(m, ((k + 1) * C + first_slot) * r - i0)

            def body(values: Any, small: Any) -> Any:
                flow, held = split(values)
                kept, new, held = guarded(flow, held)
                slot = loop.record_slot(i0 + flow.i, r, first_slot + k * C, C, OPS)
                return flat(new, held), tf.where(tf.equal(where, slot), kept, small)

            small = tf.fill([C], tf.constant(math.nan, dtype))
            if segments is None:
                values, small = tf.while_loop(
                    lambda v, b: tf.logical_and(running(v), unflat(v).i < end),
                    body,
                    (values, small),
                )
                return values, chunks.write(k, small), k + 1
            assert segments is not None

            def segment(values: Any, small: Any, state: tuple) -> Any:
                stop = tf.minimum(end, segments.end(unflat(values)))
                new, small = tf.while_loop(
                    lambda v, b: tf.logical_and(running(v), unflat(v).i < stop),
                    body,
                    (values, small),
                )
                return new, small, segments.after(unflat(values), unflat(new), state)

            values, small, after = tf.while_loop(
                lambda v, b, s: tf.logical_and(running(v), unflat(v).i < end),
                segment,
                (values, small, state[0]),
            )
            return values, chunks.write(k, small), k + 1, after

        chunks = tf.TensorArray(dtype, size=ceil_div(cap, C), element_shape=[C])
        if segments is None:
            values, chunks, _ = tf.while_loop(
                lambda v, c, k: running(v),
                chunk,
                (flat(flow0, carry or ()), chunks, tf.constant(0, _INT)),
            )
        else:
            values, chunks, _, state = tf.while_loop(
                lambda v, c, k, s: running(v),
                chunk,
                (flat(flow0, carry or ()), chunks, tf.constant(0, _INT), segments.state),
            )
        buf = tf.reshape(chunks.stack(), [-1])
    flow, held = split(values)
    count = ceil_div(i0 + flow.i, r) - first_slot
    out: tuple = (
        buf,
        count,
        flow.i,
        loop.applied(OPS, flow),
        loop.stop_code(OPS, flow, met),
        flow.last,
    )
    if carry is not None:
        out = (*out, held)
    return out if segments is None else (*out, state)


def _outer_loop(
    inner: Any,
    n: Any,
    step0: Any,
    opts: Options,
    steps_per_launch: int,
    notify: Any = None,
    publish: Any = None,
    speed: Any = None,
    dtype: Any = tf.float32,
    count: Any = None,
    gather: Gather | None = None,
) -> Any:
    """A whole call: ``inner`` chunks (launches of the compiled inner loop) of at most
    ``steps_per_launch`` steps each, until ``n`` or a stop.

    Runs outside XLA, so the trace can grow with ``n`` (a TensorArray of the chunks'
    recorded losses) and notifications reach the host (``notify(step, loss)`` through
    ``tf.numpy_function``, cheaper per call than ``tf.py_function``) between
    chunks. With ``publish`` (a float64 variable of 2) each chunk writes ``(step, loss)``
    there instead, for a host thread to read: the loop never waits for Python, and a
    chunk runs to the first multiple of `every` at least ``_PUBLISH_SECONDS`` away at the
    last chunk's speed; the first chunk at ``speed`` (steps per second, a float64 scalar:
    the previous call's), or when that is 0 to the first multiple. ``count`` (an int64
    variable) gets each chunk's applied updates before its notification, so a callback
    that raises leaves it right. ``gather``: ``inner`` returns more outputs after its six,
    gathered launch by launch (`Gather`).
    Returns ``(losses, applied, stop, last loss)``, then ``gather.finish``'s outputs.
    """

    def cond(i, applied, stop, prev, ta, k, ticks, clock, *more):
        return tf.logical_and(i < n, tf.equal(stop, int(Stop.STEPS)))

    def body(i, applied, stop, prev, ta, k, ticks, clock, *more):
        m = tf.minimum(tf.constant(steps_per_launch, _INT), n - i)
        if opts.notify:  # a chunk ends at a multiple of `every` (the XLA loop needn't check)
            gstep = step0 + tf.cast(applied, tf.int64)
            ahead = tf.constant(1, tf.int64)
            if publish is not None:  # a bar alone: see _PUBLISH_SECONDS
                ahead = tf.maximum(ahead, tf.cast(clock[1] * _PUBLISH_SECONDS, tf.int64))
            end = next_multiple(gstep, opts.every, ahead)
            m = tf.minimum(m, tf.cast(end - gstep, _INT))
        buf, kept, j, a, stop, prev, *outputs = inner(m, i, prev)
        ta = ta.write(k, buf[:kept])
        if gather is not None:
            more = (gather.write(more[0], k, outputs),)
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
        return (i + j, applied, stop, prev, ta, k + 1, ticks, clock, *more)

    ta = tf.TensorArray(dtype, size=0, dynamic_size=True, infer_shape=False, element_shape=[None])
    # (time the last chunk ended, its steps per second): sizes a bar's chunks
    clock = tf.stack([tf.timestamp(), tf.constant(0, tf.float64) if speed is None else speed])
    init: tuple = (
        tf.constant(0, _INT),  # steps evaluated
        tf.constant(0, _INT),  # updates applied
        tf.constant(int(Stop.STEPS), _INT),  # the stop code so far
        tf.constant(math.nan, tf.float64),  # the last loss
        ta,
        tf.constant(0, _INT),
        tf.constant(0, _INT),
        clock,
    )
    if gather is not None:
        init = (*init, gather.start())
    _, applied, stop, prev, ta, _, _, _, *more = tf.while_loop(cond, body, init)
    if gather is None:
        return ta.concat(), applied, stop, prev
    return (ta.concat(), applied, stop, prev, *gather.finish(more[0]))
