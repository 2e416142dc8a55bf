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
them. Given ``jit_compile=True`` or ``False``, the fit does as told (``reason`` says so).
"""

from __future__ import annotations

import time
from typing import Any

import tensorflow as tf

from .._core import deferred_interrupts
from ._checks import _fail

__all__ = ["AUTO", "check_jit_compile", "given", "undecided", "choose"]

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


def choose(fit: Any, batch: tuple, tail: tuple) -> None:
    """Time the fit's loop with XLA and without on ``batch`` (then undo every trial step),
    and set ``fit.jit_compile`` and ``fit.plan``; the kept program becomes the fit's."""
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
        """Seconds of a call of ``m`` steps; the state is put back after it."""
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
        timed: dict[bool, float] = {}
        try:
            run(True, 1)  # (compiles)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
            if not _is_xla_error(e):
                raise
            first = str(e).splitlines()[0][:300]
            plan = {
                "xla": False,
                "reason": f"jit_compile='auto': XLA cannot compile the loop ({first})",
            }
        else:
            one = run(True, 1)
            m = max(1, min(limit, int(_TRIAL_SECONDS / max(one, 1e-9))))
            timed[True] = run(True, m) / m
            if 1e6 * timed[True] < _XLA_SURE_US:
                plan = {
                    "xla": True,
                    "reason": f"jit_compile='auto': the XLA loop ran a step in "
                    f"{1e6 * timed[True]:.1f} us (timed on {m} steps), under the "
                    f"{_XLA_SURE_US:.0f} us that a loop of TensorFlow's kernels costs in "
                    "dispatch alone",
                }
            else:
                run(False, 1)  # (traces)
                run(False, 1)
                timed[False] = float("inf")
                for r in range(_TRIAL_ROUNDS):
                    for flag in (True, False) if r % 2 else (False, True):
                        timed[flag] = min(timed[flag], run(flag, m) / m)
                xla = timed[True] <= timed[False]
                faster = "XLA" if xla else "TensorFlow's kernels"
                plan = {
                    "xla": xla,
                    "reason": f"jit_compile='auto': {faster} ran the loop faster on this batch "
                    f"(best of {_TRIAL_ROUNDS} timed calls of {m} steps each: XLA "
                    f"{1e6 * timed[True]:.1f} us a step, TensorFlow's kernels "
                    f"{1e6 * timed[False]:.1f} us)",
                }
        if timed:
            plan["us_per_step"] = {
                ("xla" if k else "tf"): round(1e6 * t, 2) for k, t in sorted(timed.items())
            }
    fit._adopt(plan, programs.get(bool(plan["xla"])), before)
