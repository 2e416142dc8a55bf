"""How a TF2 fit runs its loop: XLA-compiled or on TensorFlow's own kernels, and why.

``jit_compile="auto"`` (the default) decides at the fit's first fused call. XLA wins where
a step is many small operations (its fused loop runs the seed's step in ~1 us, where a
loop of TensorFlow's kernels pays ~45 us of dispatch), TensorFlow's kernels (oneDNN on
CPU) where a step is a few large matrix products (measured on a 2-core CPU VM: the
``mlp`` 2-64-64-2 on 1,024 rows ~612 against ~500 us a step, the ``wide`` 2-1024-1024-2
~103 against ~88 ms; docs/performance.md). No rule on the model's shape tells the two
apart on every machine, so the fit times them on the call's own batch:

1. a copy of the state (parameters, optimizer state, the model's other variables, the
   streams' positions) is kept, and every trial call is undone from it, so the fit's
   results are those of the chosen path alone, as if it had been given from the start;
2. the XLA loop runs one step (compiling it), then a timed call of ``m`` steps: ``m`` is
   the fit's ``steps``, bounded so that a call takes about `_TRIAL_SECONDS` (and by the
   steps one launch holds). A step under `_XLA_SURE_US` ends the trial there: TensorFlow's
   kernels cannot run a loop step that fast (their dispatch alone costs more);
3. otherwise the loop on TensorFlow's kernels is traced and warmed up the same way, and
   `_TRIAL_ROUNDS` interleaved rounds time both on ``m`` steps; the faster (best round)
   is kept, XLA on a tie.

The trial's cost does not grow with a call's ``steps``: two program builds and a few
calls of at most ~`_TRIAL_SECONDS` each (or of one step, where a step takes longer). The
program of the kept path is the one the fit goes on running (no second trace); the other
is dropped. ``fit.plan`` says what was chosen and why: ``{"xla": bool, "reason": str}``,
with ``"us_per_step": {"xla": ..., "tf": ...}`` (the best trial times) where a trial timed
them (``None`` where a step took less time than the trial calls' noise). Given ``jit_compile=True`` or ``False``, the fit does as told (``reason`` says so).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import tensorflow as tf

from .._core import deferred_interrupts
from ._checks import _fail

__all__ = ["AUTO", "Parked", "check_jit_compile", "choose", "given", "undecided", "xla_cause"]

AUTO = "auto"

# The length of one timed trial call, in seconds (a call of one step where a step is longer).
_TRIAL_SECONDS = 0.02
# Interleaved rounds timing both paths, the best of each kept (the machine's noise).
_TRIAL_ROUNDS = 3
# An XLA loop step faster than this (us) is kept without trying TensorFlow's kernels: a
# loop of them costs ~45 us a step on the seed's perceptron (2-core CPU VM), its dispatch.
_XLA_SURE_US = 20.0


def check_jit_compile(jit_compile: Any) -> bool | str:
    """``True``, ``False`` or `AUTO` (``None`` is `AUTO`); a named error for anything else."""
    if jit_compile is None or (isinstance(jit_compile, str) and jit_compile == AUTO):
        return AUTO
    if not isinstance(jit_compile, bool):
        _fail(
            TypeError,
            "jit_compile",
            jit_compile,
            "True, False or 'auto'",
            "Pass jit_compile='auto' (the default: the fit times XLA against TensorFlow's "
            "kernels at its first call and keeps the faster), True to XLA-compile the loop, "
            "or False to run it without XLA.",
        )
    return jit_compile


def given(jit_compile: bool | str) -> dict[str, Any]:
    """The plan of a fit before its first call."""
    if jit_compile == AUTO:
        return {
            "xla": None,
            "reason": "jit_compile='auto': decided at the first fused call, which times the "
            "XLA loop against TensorFlow's kernels on its batch",
        }
    return {"xla": bool(jit_compile), "reason": f"jit_compile={jit_compile} was given"}


def undecided(fit: Any) -> bool:
    """Whether the fit is still to choose (``"auto"``, fused, and nothing has forced it)."""
    return fit.plan["xla"] is None


def _is_xla_error(e: BaseException) -> bool:
    msg = str(e)
    return isinstance(e, (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError)) and any(
        s in msg for s in ("XLA", "xla", "compil", "Compil")
    )


def xla_cause(e: BaseException) -> str:
    """The line of XLA's error that names what it could not compile (its first line is
    often only "Graph execution error:")."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    marks = ("unsupported operations", "No registered", "not supported", "XLA", "xla")
    for mark in marks:
        for ln in lines:
            if mark in ln:
                return ln[:300]
    return lines[0][:300] if lines else type(e).__name__


def _slope(t1: float, tm: float, m: int) -> float:
    """Seconds a step from calls of 1 and of ``m`` steps (the call's own cost aside)."""
    return t1 if m == 1 else max(tm - t1, 0.0) / (m - 1)


def timed(run: Any, steps: int, limit: int) -> dict[str, Any]:
    """The plan from timing both paths: ``run(xla, m)`` runs a call of ``m`` steps on one
    path and returns its seconds, the state put back after it (the caller's). ``steps``:
    the call length to decide for (the fit's ``steps``); ``limit``: the most steps one
    trial call may run."""
    try:
        run(True, 1)  # (compiles)
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
        if not _is_xla_error(e):
            raise
        return {
            "xla": False,
            "reason": f"jit_compile='auto': XLA cannot compile the loop ({xla_cause(e)})",
        }
    one: dict[bool, float] = {True: min(run(True, 1), run(True, 1))}  # the best call of 1 step
    # m: the fit's `steps`, or as many as a call of about _TRIAL_SECONDS runs
    m, many = 1, {True: one[True]}  # the best call of m steps
    while m < limit and many[True] < _TRIAL_SECONDS:
        m = min(limit, 8 * m)
        many[True] = run(True, m)
    per_step = {True: _slope(one[True], many[True], m)}
    if 1e6 * per_step[True] < _XLA_SURE_US:
        if per_step[True] > 0:
            ran = f"ran a step in {1e6 * per_step[True]:.1f} us (calls of 1 and {m} steps)"
        else:  # the m-step call no slower than the best 1-step call: below the noise
            ran = (
                f"ran a call of {m} steps in {1e3 * many[True]:.3g} ms against "
                f"{1e3 * one[True]:.3g} ms for 1 step (a step's time is below the calls' "
                "noise)"
            )
        plan: dict[str, Any] = {
            "xla": True,
            "reason": f"jit_compile='auto': the XLA loop {ran}, under the "
            f"{_XLA_SURE_US:.0f} us a step that a loop of TensorFlow's kernels costs in "
            "dispatch alone",
        }
    else:
        run(False, 1)  # (traces)
        one[False] = min(run(False, 1), run(False, 1))
        many[False] = one[False] if m == 1 else run(False, m)
        for r in range(_TRIAL_ROUNDS - 1):
            for flag in (True, False) if r % 2 else (False, True):
                one[flag] = min(one[flag], run(flag, 1))
                if m > 1:
                    many[flag] = min(many[flag], run(flag, m))
        per_step = {k: _slope(one[k], many[k], m) for k in (True, False)}
        # what a call of the fit's `steps` costs each way
        call = {k: one[k] + per_step[k] * (steps - 1) for k in (True, False)}
        xla = call[True] <= call[False]
        plan = {
            "xla": xla,
            "reason": f"jit_compile='auto': {'XLA' if xla else 'TensorFlow kernels'} ran "
            f"the loop faster on this batch: a call of {steps} step(s) "
            f"{1e3 * call[True]:.3g} ms with XLA against {1e3 * call[False]:.3g} ms on "
            f"TensorFlow's kernels (best of {_TRIAL_ROUNDS} timed calls of 1 and {m} "
            "steps each way)",
        }
    plan["us_per_step"] = {  # (None: a step's time below what the trial calls resolve)
        ("xla" if k else "tf"): round(1e6 * t, 2) if t > 0 else None
        for k, t in sorted(per_step.items())
    }
    return plan


def choose(fit: Any, batch: tuple, tail: tuple) -> None:
    """Time the TF2 fit's loop with XLA and without on ``batch`` (`timed`; every trial
    step undone), and set ``fit.jit_compile`` and ``fit.plan``; the kept program becomes
    the fit's."""
    variables = fit._written_variables()
    programs: dict[bool, Any] = {}
    before = fit.compiles
    limit = min(fit.opts.steps, fit._steps_per_launch, fit._cap * fit.opts.record_every)

    def program(flag: bool) -> Any:
        if flag not in programs:
            programs[flag] = tf.function(
                lambda n, *args: fit._whole_py(n, *args, xla=flag),
                jit_compile=flag,
                autograph=False,
            )
        return programs[flag]

    def run(flag: bool, m: int) -> float:
        t0 = time.perf_counter()
        try:
            out = fit._call(program(flag), (tf.constant(m, tf.int32),), batch, tail)
            out[0].numpy()
            return time.perf_counter() - t0
        finally:
            for v, old in zip(variables, snapshot):
                v.assign(old)

    with deferred_interrupts():  # the trial's steps are undone before anything else runs
        snapshot = [tf.identity(v.read_value()) for v in variables]
        plan = timed(run, fit.opts.steps, limit)
    fit._adopt(plan, programs.get(bool(plan["xla"])), before)


class Parked:
    """The traced programs of up to `SIZE` batch structures a fit left (another nesting,
    another stream layout: an `Epochs` of another seed), so that going back to one reuses
    its programs instead of tracing them again, as JAX's and torch's caches do. Anything
    else that has the fit trace again (`Fit._build`) drops them: they were traced with
    what changed."""

    SIZE = 4
    # (`_compiled`: which of them ran once; XLA's first run of one may fall back)
    NAMES = (
        "_inner",
        "_outer",
        "_whole",
        "_single",
        "_evaluate",
        "_concrete",
        "_probes",
        "_compiled",
    )

    def __init__(self) -> None:
        self._kept: OrderedDict[Any, dict[str, Any]] = OrderedDict()

    def clear(self) -> None:
        self._kept.clear()

    def switch(self, fit: Any, old: Any, new: Any) -> bool:
        """Park ``fit``'s programs (traced for structure ``old``) and put back those of
        ``new`` if they are parked: whether they were."""
        got = self._kept.pop(_hashable(new), None)
        self._kept[_hashable(old)] = {k: getattr(fit, k) for k in self.NAMES}
        while len(self._kept) > self.SIZE:
            self._kept.popitem(last=False)
        for k, v in (got or {}).items():
            setattr(fit, k, v)
        return got is not None


def _hashable(structure: Any) -> Any:
    """A batch structure (`tf.nest`'s: dicts, lists, tuples of leaves) as a hashable key."""
    if isinstance(structure, dict):
        items = sorted(structure.items(), key=lambda kv: repr(kv[0]))
        return ("dict", tuple((k, _hashable(v)) for k, v in items))
    if isinstance(structure, (list, tuple)):
        return (type(structure).__name__, tuple(_hashable(v) for v in structure))
    try:
        hash(structure)
    except TypeError:
        return ("repr", repr(structure))
    return structure
