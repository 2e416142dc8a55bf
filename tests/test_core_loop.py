"""The shared step semantics (`stepfuse._core.loop`) and the host driver's helpers, on their own."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from stepfuse import Stop
from stepfuse._core import (
    HOST,
    CallbackErrors,
    Flow,
    loop,
    next_multiple,
    paced_every,
    shared_doc,
)


class _NumpyOps:
    """Ops over NumPy arrays, as a framework's would be over its tensors."""

    where = staticmethod(np.where)
    isfinite = staticmethod(np.isfinite)
    logical_not = staticmethod(np.logical_not)
    equal = staticmethod(np.equal)

    @staticmethod
    def to_int(x):
        return np.asarray(x).astype(np.int32)

    @staticmethod
    def cast(x, dtype):
        return np.asarray(x).astype(dtype)

    @staticmethod
    def false():
        return np.bool_(False)


NP = _NumpyOps()


def _exact(a, b, tol) -> bool:
    return abs(Fraction(float(a)) - Fraction(float(b))) <= Fraction(tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ops", [NP, HOST], ids=["numpy", "host"])
def test_within_tol_is_the_exact_test_at_the_last_bit(ops, dtype):
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):
        scale = 10.0 ** rng.integers(-3, 3)
        a, b = (rng.standard_normal(2) * scale).astype(dtype)
        if rng.random() < 0.3:  # losses more than 2x apart
            b = dtype(a * rng.uniform(2.5, 40))
        d = abs(Fraction(float(a)) - Fraction(float(b)))
        # tols at, and one float64 ulp around, the exact difference (and its float32 rounding)
        centre = float(d)
        for tol in (
            centre,
            np.nextafter(centre, np.inf),
            np.nextafter(centre, -np.inf),
            float(np.float32(centre)),
        ):
            if tol < 0:
                continue
            met = loop.within_tol(ops, float(tol), dtype)
            assert bool(met(a, b)) == _exact(a, b, tol), (a, b, tol, dtype)
            checked += 1
    assert checked > 900


@pytest.mark.parametrize("ops", [NP, HOST], ids=["numpy", "host"])
def test_within_tol_nan_meets_no_tol_and_inf_tol_meets_every_number(ops):
    for tol in (0.0, 1e-3, math.inf):
        met = loop.within_tol(ops, tol, np.float32)
        assert not bool(met(np.float32(1.0), np.float32("nan")))
        assert not bool(met(np.float32("nan"), np.float32("nan")))
    met = loop.within_tol(ops, math.inf, np.float32)
    assert bool(met(np.float32(1e30), np.float32(-1e30)))
    assert bool(met(np.float32(1.0), np.float32(1.0)))


def _run(losses, finite, n, tol=None, ops=HOST):
    """Drive a Flow over given per-step losses/finite flags as a loop would."""
    met = None if tol is None else loop.within_tol(ops, tol, np.float64)
    flow = Flow(0, 0.0, math.nan, math.nan)
    while bool(loop.running(ops, flow, n, met)):
        i = int(flow.i)
        flow = loop.advance(flow, losses[i], 0.0 if finite[i] else math.nan)
    return int(loop.applied(ops, flow)), int(loop.stop_code(ops, flow, met)), int(flow.i)


@pytest.mark.parametrize("ops", [NP, HOST], ids=["numpy", "host"])
def test_flow_stops_for_each_reason_and_counts_applied_updates(ops):
    losses = [4.0, 3.0, 2.5, 2.5, 1.0, 0.5]
    assert _run(losses, [True] * 6, 6, ops=ops) == (6, Stop.STEPS, 6)
    assert _run(losses, [True] * 6, 4, ops=ops) == (4, Stop.STEPS, 4)
    # tol: update 3 (loss 2.5 == the one before) is applied, then the loop stops
    assert _run(losses, [True] * 6, 6, tol=0.0, ops=ops) == (4, Stop.TOL, 4)
    # the first step never meets tol (no loss before it in this call)
    assert _run([1.0, 5.0], [True, True], 2, tol=0.5, ops=ops) == (2, Stop.STEPS, 2)
    # a refused step: evaluated, not applied, and it ends the loop before tol is looked at
    assert _run(losses, [True, True, True, False, True, True], 6, tol=0.0, ops=ops) == (
        3,
        Stop.NONFINITE,
        4,
    )
    assert _run(losses, [False] * 6, 6, ops=ops) == (0, Stop.NONFINITE, 1)


def test_masked_steps_change_nothing_and_absent_fields_stay_absent():
    old = Flow(np.int32(3), np.float32(0), np.float32(2.0), None)
    new = loop.advance(old, np.float32(1.0), np.float32(0))
    assert new.before is None and float(new.last) == 1.0 and int(new.i) == 4
    kept = loop.masked(NP, np.bool_(False), new, old)
    assert int(kept.i) == 3 and float(kept.last) == 2.0 and kept.before is None
    taken = loop.masked(NP, np.bool_(True), new, old)
    assert int(taken.i) == 4 and float(taken.last) == 1.0


def test_record_slot_keeps_every_kth_loss_and_sends_the_rest_to_the_spare_slot():
    slots = [int(loop.record_slot(np.int32(i), 3, 2, 99, NP)) for i in range(6, 13)]
    assert slots == [0, 99, 99, 1, 99, 99, 2]
    assert [loop.record_slot(i, 1, 4, 99) for i in (4, 5)] == [0, 1]


def test_next_multiple_and_pacing():
    assert [next_multiple(s, 10) for s in (0, 9, 10, 11)] == [10, 10, 20, 20]
    assert next_multiple(10, 10, ahead=25) == 40
    assert paced_every(10, None, 0.1) == 10
    assert paced_every(10, 1e-4, 0.1) == 1000  # 1,000 steps are ~0.1 s long
    assert paced_every(10, 1.0, 0.1) == 10  # never less than `every`


def test_callback_errors_keep_the_first_and_skip_the_rest():
    seen, errors = [], CallbackErrors()

    def notify(step, loss):
        seen.append(step)
        if step == 2:
            raise KeyError("user")

    for step in (1, 2, 3):
        errors.deliver(notify, step, 0.0)
    assert seen == [1, 2]
    with pytest.raises(KeyError, match="user"):
        errors.reraise()
    errors.reraise()  # cleared: nothing more to raise


def test_shared_doc_indents_the_options_like_the_line_it_replaces():
    def fuse():
        """Build it.

        Args:
          loss_fn: the loss.
          {options}
          extra: more.
        """

    shared_doc(fuse)
    lines = fuse.__doc__.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("steps:"))
    assert lines[at].startswith("          steps:")  # the Args entries' indent
    assert any(line.startswith("          record_every:") for line in lines)
    assert "{options}" not in fuse.__doc__

    def bad():
        """No placeholder."""

    with pytest.raises(ValueError, match="options"):
        shared_doc(bad)
