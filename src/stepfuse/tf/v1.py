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

from .._core import Options, ceil_div, check_int, check_options
from .._core.data import Batches, Epochs
from .._core.options import shared_doc_of
from ._checks import _fail
from ._loop import Buffers, _inner_loop, _outer_loop
from ._plan import AUTO, check_jit_compile, given
from ._v1_data import V1Data, _resource_variable
from ._v1_eval import V1Eval
from ._v1_fit import Fit, Fused, Stepwise
from ._v1_graph import (
    _check_arity,
    _check_graph_mode,
    _check_loss_fn,
    _check_optimizer,
    _prepare,
    _random_draws,
    _step_ops,
    _variable_reads,
    _warn_stale_hyper_parameters,
    _without_xla_for,
)
from ._v1_loop import Carry, Shadow, tail, tail_size

__all__ = ["fuse", "Fit", "Fused", "Stepwise", "copies_train_op"]

tf1 = tf.compat.v1

# The default `chunk` (the most steps one launch of the compiled inner loop runs): for an
# int `steps`, the built `steps` but at least this many (a run of at most `chunk` steps is
# one launch); for a tensor `steps`, whose runs chain launches in a graph loop, this many.
_MIN_STEPS_PER_LAUNCH = 256
_TENSOR_STEPS_PER_LAUNCH = 1024


@shared_doc_of("tol", "record_every", "callback", "on_nonfinite", "mode", "eval_fn", "eval_every")
def fuse(
    loss_fn: Callable[[], Any],
    optimizer: Any,
    *,
    steps: Any,
    var_list: list | None = None,
    tol: float | None = None,
    record_every: int = 1,
    mode: str = "fused",
    jit_compile: bool | str = "auto",
    chunk: int | None = None,
    on_nonfinite: str = "stop",
    global_step: Any = None,
    callback: Callable[[int, float], Any] | None = None,
    every: int | None = None,
    data: Any = None,
    eval_fn: Callable[[], Any] | None = None,
    eval_every: int | None = None,
) -> Fit:
    """Build ``steps`` TF1 optimizer updates that run inside one ``sess.run``.

    Call in graph mode (``tf.compat.v1.disable_eager_execution()``, or inside
    ``with tf.Graph().as_default():``). The graph gets one copy of loss -> gradients ->
    update inside a ``tf.while_loop``, whatever ``steps`` is; the gradient is recomputed
    at the current variables at every step; the fed batch is read once per run.

    With ``eval_fn``, TF1 calls ``eval_fn()`` with no arguments, as ``loss_fn``: it builds
    the evaluation from the graph's tensors (validation placeholders fed in the run's
    ``feed_dict``, TF1's ``eval_batch``) and runs under a ``tf.cond`` inside the loop; with a
    tensor ``steps``, ``eval_every`` must be given. The schedule, ``Epochs``' minibatches
    and the callback's step numbers follow the fit's step count in the graph,
    ``fused.counter`` (docs/guides/tf1.md).

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
      jit_compile: ``"auto"`` (default; ``None`` too): the graph holds the loop both
        XLA-compiled and on TensorFlow's kernels, and the first ``fused.run`` (or
        ``fused.decide(sess, feed_dict)``) times both on its feed, undoing every trial step,
        and keeps the faster (``fused.plan`` says which and why); until then a bare
        ``sess.run(fused.train_op)`` runs the XLA loop. ``True`` XLA-compiles the step loop
        (much faster per step than a plain graph loop on small models:
        docs/internals/tf.md); an op XLA can't compile makes the first ``sess.run`` fail
        with an XLA error: rebuild with ``jit_compile=False``. ``False``: without XLA. A
        loss that draws random numbers (``tf1.nn.dropout``) runs without XLA whatever is
        given, with a warning (XLA draws other numbers from the same seed).
      global_step: an integer variable incremented by each applied update, as with
        ``optimizer.minimize(loss, global_step=...)`` (not by a refused one). A learning
        rate that decays with it must be given as a callable, e.g. ``learning_rate=lambda:
        tf1.train.exponential_decay(0.5, global_step, 100, 0.9)``, which the optimizer
        evaluates at every step; a tensor is read once per run (a warning says so).
      every: how often ``callback`` fires (``step`` is the fit's step count,
        ``fused.counter``, over runs). With a callback the loop runs as chunks of the compiled loop
        chained in a graph loop, which calls the host between them
        (``tf.numpy_function``), also for an int ``steps``; ``run`` re-raises a
        callback's exception as it is, and a bare ``sess.run`` raises TF's error
        wrapping it.
      data: None; a `stepfuse.Epochs` of NumPy arrays (a resident dataset, put into the
        graph once as variables): ``loss_fn(*minibatch)`` is then called with the
        minibatch of the fit's global step ``fused.counter``, reshuffled on the device
        when the epoch changes; or a `stepfuse.Batches` of graph tensors (placeholders,
        leading axis ``None`` allowed) holding stacked minibatches: ``loss_fn`` is called
        with step ``i``'s slices (``xs[i], ys[i]``) and the stack is fed once per run;
        ``run`` checks the fed lengths before anything runs (docs/guides/data_tf.md).
      chunk: the most steps one launch of the compiled inner loop runs (XLA needs a
        static-size loss buffer). Default: ``steps`` (at least 256) for an int ``steps``,
        1024 for a tensor. With an int ``steps`` up to ``chunk`` a run is one call of that
        loop, so it takes at most ``chunk`` steps (feeding more fails with a message naming
        ``steps``); with a tensor ``steps``, or an int above ``chunk``, longer runs chain
        chunks in a graph loop inside the same ``sess.run``.

    Returns:
      a `Fused` with ``train_op``, ``losses``, ``steps_taken``, ``stop`` (with ``eval_fn``,
      ``evals`` and ``eval_steps``: outputs of one loop) and ``run(sess, feed_dict,
      steps=None) -> Trace`` (``trace.eval``: the run's evaluations); with ``mode="stepwise"`` a
      `Stepwise` with ``run``. A non-finite loss, gradient, new variable or optimizer state
      stops the loop without applying that update (``stop == Stop.NONFINITE``). With
      ``on_nonfinite="raise"``, ``run(...)`` raises `stepfuse.NonFiniteError`
      (``error.step``: the refused update's step, by ``fused.counter`` where the fit has
      one, else counting the updates this object's ``run`` calls applied); a bare
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
    jit_compile = check_jit_compile(jit_compile)
    auto = jit_compile == AUTO
    flags = (True, False) if auto else (bool(jit_compile),)  # the loops the graph holds
    tensor_steps = isinstance(steps, (tf.Tensor, tf.Variable))
    if tensor_steps:
        if not steps.dtype.base_dtype.is_integer or (steps.shape.rank not in (None, 0)):
            _fail(
                TypeError,
                "steps",
                steps,
                "an int >= 1 or a scalar integer tensor",
                "Pass e.g. steps=100 or steps=tf.compat.v1.placeholder(tf.int32, []).",
            )
        if eval_fn is not None and eval_every is None:
            _fail(
                ValueError,
                "eval_every",
                eval_every,
                "an int >= 1 when `steps` is a tensor (its default is the built steps)",
                "Pass how many updates between evaluations, e.g. eval_every=100.",
            )
    opts = check_options(
        1 if tensor_steps else steps,
        tol,
        record_every,
        callback,
        every,
        on_nonfinite=on_nonfinite,
        mode=mode,
        eval_fn=eval_fn,
        eval_every=eval_every,
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
    _check_graph_mode()
    _check_loss_fn(loss_fn)
    _check_optimizer(optimizer)
    if data is None or isinstance(data, (Batches, Epochs)):
        _check_arity(loss_fn, None if data is None else len(data.arrays))
    streams = None if data is None else V1Data(data, steps_given)
    # The fit's step count in the graph, where a step depends on it (an Epochs minibatch,
    # the evaluation schedule, a callback's step numbers).
    counter = None
    if (streams is not None and streams.needs_step) or opts.eval_fn or opts.notify:
        counter = _resource_variable(tf.constant(0, tf.int64), "stepfuse_step")

    def first():
        if streams is None:
            return loss_fn()
        return loss_fn(*streams.first(None if counter is None else counter.read_value()))

    loss0, var_list, state, writes = _prepare(first, optimizer, var_list, shown=loss_fn)
    if global_step is not None and all(v is not global_step for v in state):
        state = state + [global_step]  # a refused update leaves it too; stepwise commits it
    plan = given(jit_compile)
    drawn = _random_draws(loss0)
    if drawn and mode != "stepwise" and jit_compile is not False:
        plan = _without_xla_for(drawn)
        jit_compile, auto, flags = False, False, (False,)
    if mode == "stepwise":
        return _build_stepwise(
            loss_fn,
            optimizer,
            var_list,
            state,
            opts,
            loss0,
            steps_given if tensor_steps else None,
            global_step,
            streams,
            counter,
        )
    if tensor_steps:
        n = tf.cast(steps_given, tf.int32)
    else:
        n = tf1.placeholder_with_default(np.int32(opts.steps), [], name="stepfuse_steps")
    if chunk is None:
        chunk = (
            max(opts.steps, _MIN_STEPS_PER_LAUNCH) if not tensor_steps else _TENSOR_STEPS_PER_LAUNCH
        )
    chunk = check_int(
        chunk, "chunk", "Pass the most steps one compiled inner loop runs, e.g. chunk=1000."
    )
    evaluation = None
    if opts.eval_fn is not None:
        assert opts.eval_every is not None
        evaluation = V1Eval(opts.eval_fn, opts.eval_every, chunk)
    cap = ceil_div(chunk, opts.record_every)
    # A run chains chunks of the compiled loop in a graph loop for a tensor `steps`, for a
    # callback (it is called between chunks), and for an int `steps` above `chunk`.
    chained = tensor_steps or opts.notify or opts.steps > chunk

    def guarded(args):
        """One step on ``loss_fn(*args)``: ``(loss, ok)``, the update kept only if ok."""
        loss, snapshot, new, ok = _step_ops(
            lambda: loss_fn(*args), optimizer, var_list, state, global_step, shown=loss_fn
        )

        def keep():
            return tf.constant(True)

        def restore():
            with tf.control_dependencies([v.assign(old) for v, old in zip(state, snapshot)]):
                return tf.constant(False)

        with tf.control_dependencies(new):
            ok = tf.cond(ok, keep, restore)
        return loss, ok

    # What the loop carries besides its Flow (see `_v1_loop`): none for a plain fit.
    carry = None if counter is None and streams is None else Carry(counter, streams, evaluation)

    # The step loop is a tf.function (XLA-compiled by default) called from this graph: it
    # captures the placeholders and variables; automatic control dependencies order every
    # read and write inside it. A tensor `steps` chains chunks of it in a plain graph loop;
    # an int `steps` makes a run one call of it.
    # The trace keeps a float64 loss as float64 (its `tol` compares those values), any
    # other as float32; `packed` is of that dtype, its last entries the int32 counts.
    wide = loss0.dtype.base_dtype == tf.float64
    dtype = tf.float64 if wide else tf.float32

    def pack(ints):
        return tf.cast(ints, tf.float64) if wide else tf.bitcast(ints, tf.float32)

    def launch(m, i0, prev, xla):
        """At most ``m`` steps: `_inner_loop`'s results, then the fit's step after them
        and the evaluation buffers (count first) where the fit has them."""
        if carry is None:
            out = _inner_loop(lambda: guarded([]), m, i0, prev, opts, cap, xla=xla, dtype=dtype)
            return (*out, None, ())
        *out, held = _inner_loop(
            lambda held: carry.step(held, guarded),
            m,
            i0,
            prev,
            opts,
            cap,
            xla=xla,
            dtype=dtype,
            carry=carry.start(i0),
        )
        _, t, evals = carry.end(held)  # (the writes run: this is a tf.function)
        return (*out, t, evals)

    def inner_py(m, i0, prev, xla):
        *out, _, evals = launch(m, i0, prev, xla)
        return (*out, *evals)

    def whole_run_py(m, xla):
        """All of a run in one call, whose first output is `packed`: no graph op after it
        (then the evaluation buffers, with eval_fn)."""
        buf, count, _, applied, stop, _, t, evals = launch(
            m, tf.constant(0, tf.int32), tf.constant(math.nan, tf.float64), xla
        )
        ints = tail(count, applied, stop, t, evals[0] if evals else None)
        packed = tf.concat([buf, pack(ints)], 0)
        return packed if evaluation is None else (packed, *evals[1:])

    def whole_runs():
        """The one-call program of each loop the graph holds, by XLA flag."""
        return {
            f: tf.function(lambda m, f=f: whole_run_py(m, f), jit_compile=f, autograph=False)
            for f in flags
        }

    # "auto": which loop runs, set by `Fused.decide` (1: XLA, 0: TensorFlow's kernels);
    # until a run decides, the XLA loop. `shadow` keeps the state a trial run changes.
    shadow = choice = None
    if auto:
        choice = _resource_variable(tf.constant(1, tf.int32), "stepfuse_xla")
        written = [*state, *writes, *([counter] if counter is not None else [])]
        if streams is not None and streams.order is not None:
            written += [streams.order, streams.order_epoch]
        shadow = Shadow(written, choice)

    def chosen(run_each):
        """``run_each(xla)`` of the chosen loop: a ``tf.cond`` on ``choice`` for "auto"."""
        if choice is None:
            return run_each(flags[0])
        return tf.cond(choice.read_value() > 0, lambda: run_each(True), lambda: run_each(False))

    notes: dict[str, Any] = {
        "error": None,
        "step": None,
    }  # from the host side of a callback (see `Fused.run`)

    def notify(step, loss):
        notes["step"] = int(step)
        try:
            assert opts.callback is not None  # notify is built for a callback only
            opts.callback(int(step), float(loss))
        except BaseException as e:  # noqa: BLE001 - `run` re-raises it as it is
            notes["error"] = e
            raise
        return np.int32(1)

    gather = None if evaluation is None else Buffers((tf.int64, *evaluation.dtypes))
    k = tail_size(counter is not None, evaluation is not None)
    # `loss` fetched with the loop in one run is the loss before the run's updates, as with
    # `sess.run([loss, optimizer.minimize(loss)])`: the loop waits for its variable reads
    # (only the reads: a run of the loop alone does not pay for the forward pass).
    with tf1.name_scope("stepfuse_loop"), tf.control_dependencies(_variable_reads(loss0)):
        checks = [] if streams is None else streams.fed_checks(n)  # (fed stacks' lengths)
        if chained:
            inners = {
                f: tf.function(
                    lambda m, i0, prev, f=f: inner_py(m, i0, prev, f),
                    jit_compile=f,
                    autograph=False,
                )
                for f in flags
            }

            def inner(m, i0, prev):
                return chosen(lambda f: inners[f](m, i0, prev))

            positive = tf.debugging.Assert(
                n >= 1,
                ["stepfuse.tf.v1: the `steps` tensor must be at least 1 in each run. Got:", n],
            )
            with tf.control_dependencies([positive, *checks]):
                step0 = counter.read_value() if counter is not None else tf.constant(0, tf.int64)
                losses, applied, stop, _, *evals = _outer_loop(
                    inner,
                    n,
                    step0,
                    opts,
                    chunk,
                    notify if opts.notify else None,
                    dtype=dtype,
                    gather=gather,
                )
            t_after = None
            if counter is not None:  # (each chunk wrote it back)
                with tf.control_dependencies([losses, applied, stop, *evals]):
                    t_after = counter.read_value()
            ints = tail(
                tf.size(losses), applied, stop, t_after, tf.size(evals[0]) if evals else None
            )
            packed = tf.concat([losses, pack(ints)], 0, name="packed")
            buffers = fetched = evals
            direct = {f: [packed, *fetched] for f in flags}
            if auto:  # the trial's programs: one call of each loop, as an unchained run
                whole_run = whole_runs()
                with tf.control_dependencies([positive, *checks]):
                    trial = {f: whole_run[f](n) for f in flags}
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
            whole_run = whole_runs()
            # `run` fetches the call's own output, packed inside the call: cheaper than
            # fetching four tensors, or one packed by graph ops after it (docs/internals/tf.md).
            with tf.control_dependencies([fits, *checks]):
                out = chosen(lambda f: whole_run[f](n))
                trial = {f: whole_run[f](n) for f in flags} if auto else {flags[0]: out}
            packed, *fetched = [out] if evaluation is None else out
            direct = {f: [t] if evaluation is None else list(t) for f, t in trial.items()}
            ints = tf.cast(packed[-k:], tf.int32) if wide else tf.bitcast(packed[-k:], tf.int32)
            count, applied, stop = tf.unstack(ints if k == 3 else ints[:3], num=3)
            losses = packed[:count]
            buffers = [b[: ints[-1]] for b in fetched]  # (full-size buffers: `run` slices)
        train_op = tf.group(applied, stop, losses, name="train_op")
    # After the loop is built: the optimizer's own per-step tensors (`_prepare`, run by each
    # step's apply_gradients) are then those of the loop's body, in a graph of their own.
    _warn_stale_hyper_parameters(optimizer, state)
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
        plan=plan,
        direct=direct,
        trial=trial if auto else None,
        shadow=shadow,
        chunk=chunk,
        step=0,
        counter=counter,
        notes=notes,
        max_steps=None if chained else chunk,
        streams=streams,
        evaluation=evaluation,
        eval_steps=buffers[0] if evaluation is not None else None,
        evals=dict(zip(evaluation.names, buffers[1:])) if evaluation is not None else None,
        eval_buffers=fetched if evaluation is not None else None,
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
    counter: Any = None,
) -> Stepwise:
    args: list[Any] = []
    if streams is not None:
        args = streams.stepwise(None if counter is None else counter.read_value())
    loss, snapshot, new, finite = _step_ops(
        lambda: loss_fn(*args), optimizer, var_list, state, global_step, shown=loss_fn
    )
    with tf.control_dependencies(new + [finite, loss]):
        restore = tf.group(*[v.assign(old) for v, old in zip(state, snapshot)])
    with tf.control_dependencies([restore]):
        loss_out, finite_out = tf.identity(loss), tf.identity(finite)
        new_out = [tf.identity(t) for t in new]
    placeholders = [tf1.placeholder(v.dtype.base_dtype, v.shape) for v in state]
    commits = [v.assign(p) for v, p in zip(state, placeholders)]
    if counter is not None:
        commits.append(counter.assign_add(1))
    evaluation = None
    if opts.eval_fn is not None:
        assert opts.eval_every is not None
        evaluation = V1Eval(opts.eval_fn, opts.eval_every, 1)
    return Stepwise(
        loss_t=loss_out,
        finite=finite_out,
        new=new_out,
        placeholders=placeholders,
        commit_op=tf.group(*commits),
        loss=loss0,
        var_list=var_list,
        state=state,
        opts=opts,
        optimizer=optimizer,
        step=0,
        steps_tensor=steps_tensor,
        streams=streams,
        counter=counter,
        evaluation=evaluation,
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
