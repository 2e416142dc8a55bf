"""The stepwise reference of the TF2 `Fit` (``mode="stepwise"``): one guarded step per
Python iteration, through a ``tf.function`` XLA-compiled as the fused loop is, driven by
the shared `stepfuse._core.run_stepwise`."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .._core import Notifier, Trace, deferred_interrupts, finish, named_evals, run_stepwise

__all__ = ["Stepwise"]


class Stepwise:
    """The stepwise mode of `stepfuse.tf.Fit` (a mixin: the fit's variables, options and
    `_xla_or_plain` are its own)."""

    opts: Any
    step: int
    compiles: int
    jit_compile: bool
    _state: list
    _held: list
    _evals: Any
    _streams: Any
    _single: Any
    _evaluate: Any
    _callback_error: BaseException | None

    def _propose(self, batch: Any) -> Any:  # pragma: no cover - the Fit's
        raise NotImplementedError

    def _xla_or_plain(
        self, key: Any, run: Any, what: str, stacklevel: int
    ) -> Any:  # pragma: no cover - the Fit's
        raise NotImplementedError

    def _propose_py(self, *batch):
        held = [v.read_value() for v in self._held]
        loss, snapshot, new, finite = self._propose(batch)
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
            self.compiles += 1
        return self._single

    def _commit_py(self, new):
        for v, value in zip(self._state, new):
            v.assign(value)

    def _stepwise_evaluation(self, tail: tuple) -> dict:
        """The stepwise mode's evaluation at the current variables, through a
        ``tf.function`` XLA-compiled as the fused loop is; NumPy values."""
        evals = self._evals
        assert evals is not None

        def evaluate(*flat):
            self.compiles += 1  # Python runs here only while the function is traced
            return evals.values(flat)

        def run():
            if self._evaluate is None:  # (again after `_build`: XLA may have been turned off)
                self._evaluate = tf.function(
                    evaluate, autograph=False, jit_compile=self.jit_compile
                )
            return self._evaluate(*tail[1:])

        out = self._xla_or_plain("evaluation", run, "the evaluation", stacklevel=7)
        return {name: v.numpy() for name, v in out.items()}

    def _call_stepwise(self, batch: Any, n: Any, start: Any, tail: tuple = ()) -> Trace:
        self._callback_error = None  # a fused call's, which would hide an XLA failure here

        def propose():
            loss, finite, new = self._propose_once(batch)
            return loss.numpy(), bool(finite), new

        def commit(new):
            with deferred_interrupts():  # variables, optimizer state and step move together
                self._stepwise_functions()[1](new)
                self.step += 1

        def evaluate():
            return self._stepwise_evaluation(tail)

        with Notifier(self.opts, start, n, label="stepfuse.tf") as notifier:
            trace = run_stepwise(
                propose,
                commit,
                n,
                self.opts,
                start,
                notifier if self.opts.notify else None,
                evaluate if self._evals is not None else None,
            )
            notifier.done(trace.steps)
        if self._evals is not None:
            trace = named_evals(trace, {n: d.as_numpy_dtype for n, d in self._evals.dtypes.items()})
        self._streams.check_exhausted(trace, start, self.opts.record_every)
        return finish(trace, self.opts, start)
