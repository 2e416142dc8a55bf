"""The host side of `stepfuse.tf.v1`: what ``fuse`` returns (`Fused`, `Stepwise`) and how
a run reads its results."""

from __future__ import annotations

import time
import weakref
from typing import Any

import tensorflow as tf

from .._core import (
    Notifier,
    Options,
    Trace,
    check_steps,
    deferred_interrupts,
    finish,
    host_trace,
    run_stepwise,
)
from ._checks import _fail
from ._plan import timed
from ._v1_loop import read_tail

__all__ = ["Fit", "Fused", "Stepwise"]


class Fit:
    """What `fuse` builds in the graph: a `Fused` loop or a `Stepwise` reference.

    Attributes:
      mode: ``"fused"`` or ``"stepwise"``.
      compiles: loop graphs built for this fit: 1 (one ``fuse`` call builds one graph that
        serves every fed ``steps`` and every batch).
      step: updates applied: the value of ``counter`` after this object's last run where
        the fit has one, else the updates this object's ``run`` calls applied.
      counter: the fit's step count in the graph, an int64 variable (None unless the fit
        uses ``data=Epochs``, ``eval_fn`` or ``callback``): each applied update increments
        it, a refused one does not; ``Epochs``' minibatches, the evaluation schedule and
        the callback's step numbers follow it. A ``tf.compat.v1.train.Saver`` checkpoint
        holds it (`stepfuse.tf.checkpoint.saver` too), so a restored fit goes on where the
        saved one stopped.
      opts: the validated shared options.
      loss: the loss at the current variables (the forward pass that created them; with
        ``data``, on entry 0 of the stack, or on the minibatch of step ``counter`` of an
        ``Epochs``).
      var_list, state: the trained variables; those plus the optimizer's variables.
      plan: how the loop runs and why, ``{"xla": bool, "reason": str}`` (with
        ``"us_per_step": {"xla": ..., "tf": ...}`` where a trial timed them); ``"xla":
        None`` while a ``jit_compile="auto"`` fit has not decided (`Fused.decide`).
    """

    mode: str
    compiles: int = 1
    fallback_reason: str | None = None
    step: int
    counter: Any = None
    opts: Options
    loss: Any
    var_list: list
    state: list
    optimizer: Any
    streams: Any = None
    evaluation: Any = None
    plan: dict[str, Any] = {
        "xla": False,
        "reason": "stepwise mode: one step per sess.run, without XLA",
    }

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
      evals: with ``eval_fn``, the evaluations of that run: ``{name: values}`` (one entry
        per evaluation; ``"value"`` for a scalar ``eval_fn``); None without.
      eval_steps: with ``eval_fn``, the fit's step count (``counter``) at each of them.
      steps: the int32 tensor giving the number of steps (a ``placeholder_with_default``
        when ``steps`` was a Python int: feed it to change the count without rebuilding).
      max_steps: the most steps one run may take (``chunk``) for an int ``steps`` up to
        ``chunk``; ``None`` where chunks are chained (see `fuse`'s ``chunk``).
      packed: one vector with all of a run's results, which ``run`` fetches: a loss
        buffer whose first ``count`` entries are ``losses``, then int32 counts: ``count,
        steps_taken, stop``, then (with ``counter``) its int64 value after the run as two
        int32 words, then (with ``eval_fn``) the number of evaluations; as int32 bits in
        float32 (on the host: ``packed[-k:].view(np.int32)``), or as float64 values for
        a float64 loss.
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
    notes: dict[str, Any]
    max_steps: int | None
    evals: Any = None
    eval_steps: Any = None
    eval_buffers: Any = None  # what `run` fetches beside `packed` with eval_fn
    plan: dict[str, Any]
    direct: dict[bool, list]  # by XLA flag: what `run` fetches (packed, eval buffers)
    trial: dict[bool, Any] | None = None  # jit_compile="auto": each loop's one-call program
    shadow: Any = None  # jit_compile="auto": `_v1_loop.Shadow`

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self._told: weakref.WeakSet = weakref.WeakSet()  # sessions the choice was written in

    def decide(self, sess: Any, feed_dict: dict | None = None, steps: int | None = None) -> dict:
        """With ``jit_compile="auto"``, time the XLA loop against TensorFlow's kernels on
        this feed (each trial run undone) and keep the faster for every later run, bare
        ``sess.run(train_op)`` included; the first `run` calls it. Once decided, writes the
        choice into ``sess`` (a new session, or one whose variables were initialised again:
        `run` does it once per session). Returns ``plan``."""
        if self.trial is None:
            return self.plan
        if self.plan["xla"] is not None:
            sess.run(self.shadow.choose, {self.shadow.pick: int(self.plan["xla"])})
            self._told.add(sess)
            return self.plan
        told, feed = sess, dict(feed_dict or {})
        # A MonitoredSession's hooks would see the trial's runs (a StopAtStepHook stopping
        # inside them): the trial runs in its own session, which the hooks do not watch.
        sess = getattr(sess, "_tf_sess", lambda: sess)()
        if steps is not None:
            n = _check_run_steps(steps, self.max_steps)
        elif self.steps in feed:
            n = int(feed[self.steps])
        else:
            n = int(sess.run(self.steps, feed))
        trial, shadow = self.trial, self.shadow

        def run(flag: bool, m: int) -> float:
            t0 = time.perf_counter()
            try:
                sess.run(trial[flag], {**feed, self.steps: m})
                return time.perf_counter() - t0
            finally:
                sess.run(shadow.load)

        with deferred_interrupts():  # every trial run is undone before anything else runs
            sess.run(shadow.save)
            plan = timed(run, n, min(n, self.chunk))
            sess.run(shadow.choose, {shadow.pick: int(plan["xla"])})
        self.plan, self.jit_compile = plan, bool(plan["xla"])
        self._told.add(told)
        return plan

    def run(self, sess: Any, feed_dict: dict | None = None, steps: int | None = None) -> Trace:
        """Run the loop once in ``sess`` and return the host `stepfuse.Trace` (with
        ``eval_fn``, its ``eval`` holds the run's evaluations)."""
        feed = dict(feed_dict or {})
        if self.streams is not None:  # (the steps of this run: given, fed, or built)
            n = self.opts.steps if steps is None else _check_run_steps(steps, self.max_steps)
            if steps is None and self.steps in feed:
                n = int(feed[self.steps])
            self.streams.check_feed(feed, n)
        if steps is not None and not (
            type(steps) is int and steps == self.opts.steps and self.max_steps
        ):
            n = _check_run_steps(steps, self.max_steps)
            if self.max_steps is None or n != self.opts.steps:  # a feed costs time each run
                feed[self.steps] = n
        if self.trial is not None and sess not in self._told:
            self.decide(sess, feed)  # "auto": the first run times both loops; a new session
            # gets the choice the bare `train_op` reads (its variable starts at XLA)
        # One fetch (and the evaluations' buffers): each fetched tensor costs sess.run time.
        direct = self.direct[bool(self.plan["xla"])]
        fetches = direct[0] if self.eval_buffers is None else direct
        if not self.opts.notify:
            out = sess.run(fetches, feed)
        else:
            self.notes["error"] = self.notes["step"] = None
            try:
                out = sess.run(fetches, feed)
            except tf.errors.OpError:
                error = self.notes["error"]
                if error is None:
                    raise
                # The callback raised: the updates up to its step stay applied (as in a
                # plain loop); the graph's count already says so (see `_outer_loop`).
                self.step = self.notes["step"]
                raise error from None
        packed = out if self.eval_buffers is None else out[0]
        has_eval = self.eval_buffers is not None
        count, applied, stop, after, evaluations = read_tail(
            packed, self.counter is not None, has_eval
        )
        start = self.step if self.counter is None else after - applied
        self.step = start + applied
        evals = None
        if has_eval:
            evals = self.evaluation.host(evaluations, out[1], out[2:])
        trace = host_trace(packed[:count], applied, stop, self.opts.record_every, evals)
        return finish(trace, self.opts, start)


class Stepwise(Fit):
    """The stepwise reference (mode ``"stepwise"``): one guarded step per ``sess.run``.

    ``run(sess, feed_dict, steps)`` drives single steps with the shared driver
    (`stepfuse._core.stepwise.run_stepwise`): each step proposes the update (applies it,
    reads the new state, restores the old one), then commits it only if everything was
    finite; with ``eval_fn``, the evaluation (built outside any loop) is fetched with the
    run's ``feed_dict`` at each step the schedule names.
    """

    mode = "stepwise"
    loss_t: Any
    finite: Any
    new: list
    placeholders: list
    commit_op: Any
    steps_tensor: Any

    def run(self, sess: Any, feed_dict: dict | None = None, steps: int | None = None) -> Trace:
        """Run ``steps`` (default: the built ``steps``; a tensor ``steps`` is evaluated
        with ``feed_dict``) single steps; returns the `Trace`."""
        feed = dict(feed_dict or {})
        if steps is None and self.steps_tensor is not None:
            steps = int(sess.run(self.steps_tensor, feed))
        n = self.opts.steps if steps is None else _check_run_steps(steps)
        if self.streams is not None:
            self.streams.check_feed(feed, n)
        if self.counter is not None:
            self.step = int(sess.run(self.counter))
        at = [0]  # the step's index in the run (its minibatch with stacked `data`)

        def propose():
            if self.streams is not None and self.streams.index is not None:
                feed[self.streams.index] = at[0]
                at[0] += 1
            loss, finite, new = sess.run([self.loss_t, self.finite, self.new], feed)
            return loss, bool(finite), new

        def commit(new):
            sess.run(self.commit_op, dict(zip(self.placeholders, new)))
            self.step += 1

        evaluate = None
        if self.evaluation is not None:
            fetches = self.evaluation.fetches

            def evaluate():
                return sess.run(fetches, feed)

        start = self.step
        with Notifier(self.opts, start, n, label="stepfuse.tf.v1") as notifier:
            trace = run_stepwise(
                propose,
                commit,
                n,
                self.opts,
                start,
                notifier if self.opts.notify else None,
                evaluate,
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
