"""TF1 graph-mode backend: ``steps`` optimizer updates inside one ``sess.run``.

``fuse(loss_fn, optimizer, steps=...)`` builds, in the current ``tf.compat.v1`` graph, one
``tf.while_loop`` whose body holds one copy of loss -> gradients -> update; ``train_op`` and
``losses`` are outputs of that loop. `copies_train_op` is the seed's accepted answer (N
chained copies of the step), kept as the baseline the tests and benchmarks compare with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from .._core import (
    Notifier,
    Options,
    Trace,
    ceil_div,
    check_int,
    check_options,
    check_steps,
    finish,
    host_trace,
    run_stepwise,
)
from .._core.options import shared_doc_of
from ._checks import _check_jit_compile, _fail
from ._loop import _inner_loop, _outer_loop
from ._v1_data import V1Data
from ._v1_graph import (
    _check_graph_mode,
    _prepare,
    _step_ops,
    _variable_reads,
    _warn_stale_hyper_parameters,
)

__all__ = ["fuse", "Fit", "Fused", "Stepwise", "copies_train_op"]

tf1 = tf.compat.v1

# The default `chunk` (the most steps one launch of the compiled inner loop runs): for an
# int `steps`, the built `steps` but at least this many (a run of at most `chunk` steps is
# one launch); for a tensor `steps`, whose runs chain launches in a graph loop, this many.
_MIN_STEPS_PER_LAUNCH = 256
_TENSOR_STEPS_PER_LAUNCH = 1024


class Fit:
    """What `fuse` builds in the graph: a `Fused` loop or a `Stepwise` reference.

    Attributes:
      mode: ``"fused"`` or ``"stepwise"``.
      compiles: loop graphs built for this fit: 1 (one ``fuse`` call builds one graph that
        serves every fed ``steps`` and every batch).
      step: updates this object's ``run`` calls applied.
      opts: the validated shared options.
      loss: the loss at the current variables (the forward pass that created them).
      var_list, state: the trained variables; those plus the optimizer's variables.
    """

    mode: str
    compiles: int = 1
    fallback_reason: str | None = None
    step: int
    opts: Options
    loss: Any
    var_list: list
    state: list
    optimizer: Any

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    def run(
        self, sess: Any, feed_dict: dict | None = None, steps: int | None = None
    ) -> Trace:  # pragma: no cover - each mode runs its own
        raise NotImplementedError


class Fused(Fit):
    """The fused loop built by `fuse` (mode ``"fused"``): one ``sess.run`` runs the steps.

    Attributes:
      train_op: runs the loop (``steps`` guarded updates); same loop as ``losses``.
      losses: the recorded losses of that run, float32 (float64 for a float64 loss):
        ``loss[j]`` is the loss before update ``j * record_every``; after a non-finite stop
        the refused loss is last.
      steps_taken: int32, updates applied in that run. stop: int32 `stepfuse.Stop` code.
      steps: the int32 tensor giving the number of steps (a ``placeholder_with_default``
        when ``steps`` was a Python int: feed it to change the count without rebuilding).
      max_steps: the most steps one run may take (``chunk``) for an int ``steps`` up to
        ``chunk``; ``None`` where chunks are chained (see `fuse`'s ``chunk``).
      packed: one vector with all of a run's results, which ``run`` fetches: a loss
        buffer whose first ``count`` entries are ``losses``, then ``count``,
        ``steps_taken`` and ``stop``: as int32 bits in float32 (on the host: ``count, taken,
        stop = packed[-3:].view(np.int32)``), or as float64 values for a float64 loss.
    """

    mode = "fused"
    train_op: Any
    losses: Any
    steps_taken: Any
    stop: Any
    steps: Any
    packed: Any
    jit_compile: bool
    chunk: int
    counter: Any
    notes: dict[str, Any]
    max_steps: int | None
    streams: Any = None

    def run(self, sess: Any, feed_dict: dict | None = None, steps: int | None = None) -> Trace:
        """Run the loop once in ``sess`` and return the host `stepfuse.Trace`."""
        feed = dict(feed_dict or {})
        if self.streams is not None:
            self.streams.check_feed(feed, self.opts.steps if steps is None else steps)
        if steps is not None and not (
            type(steps) is int and steps == self.opts.steps and self.max_steps
        ):
            n = _check_run_steps(steps, self.max_steps)
            if self.max_steps is None or n != self.opts.steps:  # a feed costs time each run
                feed[self.steps] = n
        # One fetch: each fetched tensor costs sess.run time (see `packed`).
        if self.counter is None:
            packed = sess.run(self.packed, feed)
        else:
            self.notes["error"] = self.notes["step"] = None
            try:
                packed = sess.run(self.packed, feed)
            except tf.errors.OpError:
                error = self.notes["error"]
                if error is None:
                    raise
                # The callback raised: the updates up to its step stay applied (as in a
                # plain loop); the graph's count already says so (see `_outer_loop`).
                self.step = self.notes["step"]
                raise error from None
        tail = (
            packed[-3:].astype(np.int32)
            if packed.dtype == np.float64
            else packed[-3:].view(np.int32)
        )
        count, applied, stop = tail.tolist()
        start = self.step
        self.step += applied
        return finish(
            host_trace(packed[:count], applied, stop, self.opts.record_every), self.opts, start
        )


class Stepwise(Fit):
    """The stepwise reference (mode ``"stepwise"``): one guarded step per ``sess.run``.

    ``run(sess, feed_dict, steps)`` drives single steps with the shared driver
    (`stepfuse._core.stepwise.run_stepwise`): each step proposes the update (applies it,
    reads the new state, restores the old one), then commits it only if everything was
    finite.
    """

    mode = "stepwise"
    loss_t: Any
    finite: Any
    new: list
    placeholders: list
    commit_op: Any
    steps_tensor: Any
    streams: Any = None

    def run(self, sess: Any, feed_dict: dict | None = None, steps: int | None = None) -> Trace:
        """Run ``steps`` (default: the built ``steps``; a tensor ``steps`` is evaluated
        with ``feed_dict``) single steps; returns the `Trace`."""
        feed = dict(feed_dict or {})
        if steps is None and self.steps_tensor is not None:
            steps = int(sess.run(self.steps_tensor, feed))
        n = self.opts.steps if steps is None else _check_run_steps(steps)
        if self.streams is not None:
            self.streams.check_feed(feed, n)
        at = [0]  # the step's index in the run (its minibatch with `data`)

        def propose():
            if self.streams is not None:
                feed[self.streams.index] = at[0]
                at[0] += 1
            loss, finite, new = sess.run([self.loss_t, self.finite, self.new], feed)
            return loss, bool(finite), new

        def commit(new):
            sess.run(self.commit_op, dict(zip(self.placeholders, new)))
            self.step += 1

        start = self.step
        with Notifier(self.opts, start, n, label="stepfuse.tf.v1") as notifier:
            trace = run_stepwise(
                propose, commit, n, self.opts, start, notifier if self.opts.notify else None
            )
            notifier.done(trace.steps)
        return finish(trace, self.opts, start)


def _check_run_steps(steps: Any, most: int | None = None) -> int:
    n = check_steps(steps)
    if most is not None and n > most:
        _fail(
            ValueError,
            "steps",
            steps,
            f"at most {most} (the chunk this graph was built with)",
            f"Build with fuse(..., steps={n}) (or chunk={n}), or give steps as an int32 "
            "tensor (a placeholder) to chain chunks in one run.",
        )
    return n


@shared_doc_of("tol", "record_every", "callback", "on_nonfinite", "mode")
def fuse(
    loss_fn: Callable[[], Any],
    optimizer: Any,
    *,
    steps: Any,
    var_list: list | None = None,
    tol: float | None = None,
    record_every: int = 1,
    mode: str = "fused",
    jit_compile: bool = True,
    chunk: int | None = None,
    on_nonfinite: str = "stop",
    global_step: Any = None,
    callback: Callable[[int, float], Any] | None = None,
    every: int | None = None,
    data: Any = None,
) -> Fit:
    """Build ``steps`` TF1 optimizer updates that run inside one ``sess.run``.

    Call in graph mode (``tf.compat.v1.disable_eager_execution()``, or inside
    ``with tf.Graph().as_default():``). The graph gets one copy of loss -> gradients ->
    update inside a ``tf.while_loop``, whatever ``steps`` is; the gradient is recomputed
    at the current variables at every step; the fed batch is read once per run.

    Args:
      loss_fn: ``loss_fn()`` builds the scalar loss from placeholders and variables. It is
        called once outside the loop (creating the variables with ``tf1.get_variable``)
        and once inside it (reusing them). A Keras layer or ``tf.Variable`` that would be
        created anew on each call must be created before, outside ``loss_fn``.
      optimizer: a ``tf.compat.v1.train`` optimizer (GradientDescent, Momentum, Adam,
        RMSProp...); its slot variables are created outside the loop.
      steps: updates per run: a Python int ``>= 1`` (fed to a
        ``placeholder_with_default``, so ``{fused.steps: n}`` changes it per run) or an
        int32 scalar tensor such as a placeholder.
      var_list: the variables to train; ``None`` means the graph's trainable variables
        that the loss reads (as ``optimizer.minimize``: another model's are left alone).
      {options}
      jit_compile: XLA-compile the step loop (default; much faster per step than a plain
        graph loop on CPU: docs/internals/tf.md). An op XLA can't compile makes the first
        ``sess.run`` fail with an XLA error: rebuild with ``jit_compile=False``.
      global_step: an integer variable incremented by each applied update, as with
        ``optimizer.minimize(loss, global_step=...)`` (not by a refused one). A learning
        rate that decays with it must be given as a callable, e.g. ``learning_rate=lambda:
        tf1.train.exponential_decay(0.5, global_step, 100, 0.9)``, which the optimizer
        evaluates at every step; a tensor is read once per run (a warning says so).
      every: how often ``callback`` fires (``step`` counts the updates this object
        applied, over runs). With a callback the loop runs as chunks of the compiled loop
        chained in a graph loop, which calls the host between them
        (``tf.numpy_function``), also for an int ``steps``; ``run`` re-raises a
        callback's exception as it is, and a bare ``sess.run`` raises TF's error
        wrapping it.
      data: None, or a `stepfuse.Batches` of graph tensors (placeholders) holding
        stacked minibatches: ``loss_fn(*minibatch)`` is then called with step ``i``'s
        slices (``xs[i], ys[i]``) and the stack is fed once per run; ``run`` checks that
        it holds at least the run's steps (docs/guides/data_tf.md).
      chunk: the most steps one launch of the compiled inner loop runs (XLA needs a
        static-size loss buffer). Default: ``steps`` (at least 256) for an int ``steps``,
        1024 for a tensor. With an int ``steps`` up to ``chunk`` a run is one call of that
        loop, so it takes at most ``chunk`` steps (feeding more fails with a message naming
        ``steps``); with a tensor ``steps``, or an int above ``chunk``, longer runs chain
        chunks in a graph loop inside the same ``sess.run``.

    Returns:
      a `Fused` with ``train_op``, ``losses``, ``steps_taken``, ``stop`` (outputs of one
      loop) and ``run(sess, feed_dict, steps=None) -> Trace``; with ``mode="stepwise"`` a
      `Stepwise` with ``run``. A non-finite loss, gradient, new variable or optimizer state
      stops the loop without applying that update (``stop == Stop.NONFINITE``). With
      ``on_nonfinite="raise"``, ``run(...)`` raises `stepfuse.NonFiniteError`
      (``error.step`` counts the updates applied by this object's ``run`` calls); a bare
      ``sess.run(train_op)`` cannot raise: read ``stop`` then.

    Example:
      >>> g = tf.Graph()
      >>> with g.as_default():
      ...     x = tf1.placeholder(tf.float32, [None, 2]); y = tf1.placeholder(tf.int32, [None])
      ...     def loss_fn():
      ...         w = tf1.get_variable("w", initializer=tf.ones([2, 2]))
      ...         logits = tf.matmul(x, w)
      ...         return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
      ...     fused = fuse(loss_fn, tf1.train.GradientDescentOptimizer(0.01), steps=3)
      ...     init = tf1.global_variables_initializer()
      >>> with tf1.Session(graph=g) as sess:
      ...     sess.run(init)
      ...     losses, _ = sess.run([fused.losses, fused.train_op], {x: xs, y: ys})  # 3 steps
    """
    steps_given = steps
    _check_jit_compile(jit_compile)
    if isinstance(steps, (tf.Tensor, tf.Variable)):
        if not steps.dtype.base_dtype.is_integer or (steps.shape.rank not in (None, 0)):
            _fail(
                TypeError,
                "steps",
                steps,
                "an int >= 1 or a scalar integer tensor",
                "Pass e.g. steps=100 or steps=tf.compat.v1.placeholder(tf.int32, []).",
            )
        opts = check_options(
            1, tol, record_every, callback, every, on_nonfinite=on_nonfinite, mode=mode
        )
    else:
        opts = check_options(
            steps, tol, record_every, callback, every, on_nonfinite=on_nonfinite, mode=mode
        )
    if global_step is not None and not (
        isinstance(global_step, tf.Variable)
        and global_step.dtype.base_dtype.is_integer
        and global_step.shape.rank == 0
    ):
        _fail(
            TypeError,
            "global_step",
            global_step,
            "None or a scalar integer variable",
            "Pass e.g. tf1.train.get_or_create_global_step().",
        )
    streams = None if data is None else V1Data(data, mode == "stepwise", steps_given)
    first = loss_fn
    if streams is not None:
        first, loss_fn = streams.wrap(loss_fn)
    loss0, var_list, state = _prepare(first, optimizer, var_list)
    if global_step is not None and all(v is not global_step for v in state):
        state = state + [global_step]  # a refused update leaves it too; stepwise commits it
    _warn_stale_hyper_parameters(optimizer, state)
    if mode == "stepwise":
        return _build_stepwise(
            loss_fn,
            optimizer,
            var_list,
            state,
            opts,
            loss0,
            steps_given if isinstance(steps_given, (tf.Tensor, tf.Variable)) else None,
            global_step,
            streams,
        )
    if isinstance(steps_given, (tf.Tensor, tf.Variable)):
        n = tf.cast(steps_given, tf.int32)
    else:
        n = tf1.placeholder_with_default(np.int32(opts.steps), [], name="stepfuse_steps")
    if chunk is None:
        chunk = (
            max(opts.steps, _MIN_STEPS_PER_LAUNCH)
            if isinstance(steps_given, int)
            else _TENSOR_STEPS_PER_LAUNCH
        )
    chunk = check_int(
        chunk, "chunk", "Pass the most steps one compiled inner loop runs, e.g. chunk=1000."
    )
    cap = ceil_div(chunk, opts.record_every)
    # A run chains chunks of the compiled loop in a graph loop for a tensor `steps`, for a
    # callback (it is called between chunks), and for an int `steps` above `chunk`.
    chained = isinstance(steps_given, (tf.Tensor, tf.Variable)) or opts.notify or opts.steps > chunk

    def step():
        loss, snapshot, new, ok = _step_ops(loss_fn, optimizer, var_list, state, global_step)

        def keep():
            return tf.constant(True)

        def restore():
            with tf.control_dependencies([v.assign(old) for v, old in zip(state, snapshot)]):
                return tf.constant(False)

        with tf.control_dependencies(new):
            ok = tf.cond(ok, keep, restore)
        return loss, ok

    # The step loop is a tf.function (XLA-compiled by default) called from this graph: it
    # captures the placeholders and variables; automatic control dependencies order every
    # read and write inside it. A tensor `steps` chains chunks of it in a plain graph loop;
    # an int `steps` makes a run one call of it.
    # The trace keeps a float64 loss as float64 (its `tol` compares those values), any
    # other as float32; `packed` is of that dtype, its last three entries the int32 counts.
    wide = loss0.dtype.base_dtype == tf.float64
    dtype = tf.float64 if wide else tf.float32

    def pack(ints):
        return tf.cast(ints, tf.float64) if wide else tf.bitcast(ints, tf.float32)

    def inner_py(m, i0, prev):
        return _inner_loop(step, m, i0, prev, opts, cap, xla=jit_compile, dtype=dtype)

    def whole_run_py(m):
        """All of a run in one call, whose one output is `packed`: no graph op after it."""
        buf, count, _, applied, stop, _ = _inner_loop(
            step,
            m,
            tf.constant(0, tf.int32),
            tf.constant(math.nan, tf.float64),
            opts,
            cap,
            xla=jit_compile,
            dtype=dtype,
        )
        return tf.concat([buf, pack(tf.stack([count, applied, stop]))], 0)

    notes: dict[str, Any] = {
        "error": None,
        "step": None,
    }  # from the host side of a callback (see `Fused.run`)
    counter = None
    if opts.notify:  # the updates applied over runs, in the graph: a callback's step numbers
        with tf1.init_scope():
            counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="stepfuse_step")

    def notify(step, loss):
        notes["step"] = int(step)
        try:
            assert opts.callback is not None  # notify is built for a callback only
            opts.callback(int(step), float(loss))
        except BaseException as e:  # noqa: BLE001 - `run` re-raises it as it is
            notes["error"] = e
            raise
        return np.int32(1)

    # `loss` fetched with the loop in one run is the loss before the run's updates, as with
    # `sess.run([loss, optimizer.minimize(loss)])`: the loop waits for its variable reads
    # (only the reads: a run of the loop alone does not pay for the forward pass).
    resets = [] if streams is None else streams.resets()
    with tf1.name_scope("stepfuse_loop"), tf.control_dependencies(_variable_reads(loss0) + resets):
        if chained:
            inner = tf.function(inner_py, jit_compile=bool(jit_compile), autograph=False)
            positive = tf.debugging.Assert(
                n >= 1,
                ["stepfuse.tf.v1: the `steps` tensor must be at least 1 in each run. Got:", n],
            )
            with tf.control_dependencies([positive]):
                step0 = counter.read_value() if counter is not None else tf.constant(0, tf.int64)
                losses, applied, stop, _ = _outer_loop(
                    inner,
                    n,
                    step0,
                    opts,
                    chunk,
                    notify if opts.notify else None,
                    dtype=dtype,
                    count=counter,
                )
            tail = pack(tf.stack([tf.size(losses), applied, stop]))
            packed = tf.concat([losses, tail], 0, name="packed")
        else:
            # At most `chunk` steps per run and no graph loop around the call: less per
            # sess.run, about what the one-step graph of the seed costs (docs/internals/tf.md).
            fits = tf.debugging.Assert(
                tf.logical_and(n >= 1, n <= chunk),
                [
                    f"stepfuse.tf.v1: `steps` fed to this graph must be at least 1 and at most "
                    f"{chunk} (the chunk it was built with); build with fuse(..., steps=N) for "
                    f"larger N, or with chunk=N, or give steps as an int32 tensor. Got:",
                    n,
                ],
            )
            whole_run = tf.function(whole_run_py, jit_compile=bool(jit_compile), autograph=False)
            # `run` fetches the call's own output, packed inside the call: cheaper than
            # fetching four tensors, or one packed by graph ops after it (docs/internals/tf.md).
            with tf.control_dependencies([fits]):
                packed = whole_run(n)
            ints = tf.cast(packed[-3:], tf.int32) if wide else tf.bitcast(packed[-3:], tf.int32)
            count, applied, stop = tf.unstack(ints, num=3)
            losses = packed[:count]
        train_op = tf.group(applied, stop, losses, name="train_op")
    return Fused(
        train_op=train_op,
        losses=losses,
        steps_taken=applied,
        stop=stop,
        steps=n,
        packed=packed,
        loss=loss0,
        var_list=var_list,
        state=state,
        opts=opts,
        optimizer=optimizer,
        jit_compile=bool(jit_compile),
        chunk=chunk,
        step=0,
        counter=counter,
        notes=notes,
        max_steps=None if chained else chunk,
        streams=streams,
    )


def _build_stepwise(
    loss_fn: Any,
    optimizer: Any,
    var_list: Any,
    state: Any,
    opts: Options,
    loss0: Any,
    steps_tensor: Any = None,
    global_step: Any = None,
    streams: Any = None,
) -> Stepwise:
    loss, snapshot, new, finite = _step_ops(loss_fn, optimizer, var_list, state, global_step)
    with tf.control_dependencies(new + [finite, loss]):
        restore = tf.group(*[v.assign(old) for v, old in zip(state, snapshot)])
    with tf.control_dependencies([restore]):
        loss_out, finite_out = tf.identity(loss), tf.identity(finite)
        new_out = [tf.identity(t) for t in new]
    placeholders = [tf1.placeholder(v.dtype.base_dtype, v.shape) for v in state]
    commit_op = tf.group(*[v.assign(p) for v, p in zip(state, placeholders)])
    return Stepwise(
        loss_t=loss_out,
        finite=finite_out,
        new=new_out,
        placeholders=placeholders,
        commit_op=commit_op,
        loss=loss0,
        var_list=var_list,
        state=state,
        opts=opts,
        optimizer=optimizer,
        step=0,
        steps_tensor=steps_tensor,
        streams=streams,
    )


def copies_train_op(
    loss_fn: Callable[[], Any], optimizer: Any, n: int, var_list: Any = None
) -> Any:
    """The seed's accepted answer: ``n`` chained copies of loss -> gradients -> update.

    Each copy's loss is built under a control dependency on the previous copy's update,
    so every gradient is taken at the updated variables. The graph grows with ``n``
    (this is the baseline `fuse` replaces). Returns ``(train_op, losses)`` where
    ``losses`` is the list of the ``n`` per-step loss tensors.

    Example:
      >>> train_op, losses = copies_train_op(loss_fn, tf1.train.GradientDescentOptimizer(0.01), 3)
    """
    _check_graph_mode()
    prev: list[Any] = []
    losses: list[Any] = []
    with tf1.variable_scope(tf1.get_variable_scope(), reuse=tf1.AUTO_REUSE):
        for _ in range(n):
            with tf.control_dependencies(prev):
                loss = loss_fn()
                if var_list is None:
                    var_list = tf1.trainable_variables()
                gvs = optimizer.compute_gradients(loss, var_list)
                prev = [optimizer.apply_gradients(gvs)]
                losses.append(loss)
    return prev[0], losses
