"""Timing of contenders run side by side in one process, and their report.

A contender is a function ``run(n)`` that performs ``n`` optimizer steps and returns
only when they are done (it blocks on the result). The harness warms it up (that
first call's time is reported as the build/compile time), then takes the best of a few
repeats, interleaving the contenders so that a noisy neighbour hurts them alike. A
contender backed by a stepfuse fit exposes it as ``run.fit``: its mode as it ran is
printed next to its time, so a fit that fell back to stepwise never reads as fused.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Result", "time_call", "interleaved_best", "measure", "print_table", "write_json"]


@dataclasses.dataclass
class Result:
    backend: str
    problem: str
    contender: str
    steps: int
    us_per_step: float
    build_s: float
    ratio: float | None = None  # us_per_step / stepfuse's us_per_step on the same row group
    note: str = ""
    n: int = 0  # the N of the row group (a slow contender may be timed on fewer `steps`)
    mode: str = ""  # a stepfuse fit's mode as it ran ("fused", "stepwise"; see `fit_mode`)


def fit_mode(run: Any) -> str:
    """The mode of the stepfuse fit behind a contender's ``run`` (its ``run.fit``), read
    after it ran: ``"fused"`` or ``"stepwise"`` (a fit that fell back), with ``", no XLA"``
    for a TF fit whose loop is not XLA-compiled; ``""`` for a contender without a fit."""
    fit = getattr(run, "fit", None)
    if fit is None:
        return ""
    mode = str(getattr(fit, "mode", "?"))
    if getattr(fit, "jit_compile", True) is False:
        mode += ", no XLA"
    return mode


def time_call(
    run: Callable[[int], object],
    n: int,
    repeats: int = 5,
    min_time: float = 0.02,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Best seconds per step of ``run(n)`` over ``repeats`` timed samples (after one warm-up).

    A sample repeats ``run(n)`` until it has taken ``min_time`` (a short call, such as
    one ``sess.run`` of one step, is far below the timer's and the machine's noise) and
    counts the mean of its calls. ``clock``: wall time by default; ``time.thread_time``
    (the calling thread's CPU time) leaves out what other processes take of the CPU.
    """
    best = float("inf")
    for r in range(repeats):
        calls, t0 = 0, clock()
        while True:
            run(n)
            calls += 1
            dt = clock() - t0
            if dt >= min_time or calls >= 10_000:
                break
        best = min(best, dt / calls)
        if dt > 10 * min_time and r >= 1:
            break
    return best / n


def interleaved_best(
    calls: dict[object, Callable[[], object]], rounds: int, per_sample: int = 1
) -> dict[object, float]:
    """Best seconds per call of each ``calls[key]()``: ``rounds`` rounds timing every call
    in turn (``per_sample`` calls a sample), the order reversed every other round so that
    no call always runs first or right after the same neighbour."""
    best = dict.fromkeys(calls, float("inf"))
    for r in range(rounds):
        for key in list(calls) if r % 2 == 0 else list(calls)[::-1]:
            call, t0 = calls[key], time.perf_counter()
            for _ in range(per_sample):
                call()
            best[key] = min(best[key], (time.perf_counter() - t0) / per_sample)
    return best


def measure(
    contenders: dict[str, Callable[[], Callable[[int], object]]],
    n: int,
    *,
    backend: str,
    problem: str,
    reference: str = "stepfuse",
    repeats: int = 5,
    steps_for: dict[str, int] | None = None,
    min_seconds: float = 0.0,
    max_rounds: int = 40,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Result]:
    """Build, warm up and time each contender on ``n`` steps; ratios are to ``reference``.

    ``contenders`` maps a name to a *builder*: calling it builds the contender (its
    time is part of ``build_s``) and returns ``run(n)``. ``steps_for`` lets a slow
    contender be timed on fewer steps (its per-step time is what is compared).
    Interleaved rounds go on after ``repeats`` until every contender has been timed for
    ``min_seconds`` (at most ``max_rounds``): short calls need many samples here (TF1,
    the seed, N = 1, stepfuse's time over the N-copies graph's: 0.96 to 1.20 over five
    runs of five 20 ms samples each; 0.97 in both of two runs of thirty). ``clock`` times
    the samples (`time_call`); the first call is always wall time.
    """
    runs, results = {}, {}
    for name, build in contenders.items():
        m = (steps_for or {}).get(name, n)
        t0 = time.perf_counter()
        run = build()
        run(m)  # first call: tracing / compiling / graph building
        results[name] = Result(
            backend, problem, name, m, float("inf"), time.perf_counter() - t0, n=n
        )
        results[name].mode = fit_mode(run)
        runs[name] = (run, m)
    spent, rounds = dict.fromkeys(runs, 0.0), 0
    while rounds < repeats or (min(spent.values()) < min_seconds and rounds < max_rounds):
        for name, (run, m) in runs.items():  # interleave the contenders
            t0 = time.perf_counter()
            results[name].us_per_step = min(
                results[name].us_per_step, 1e6 * time_call(run, m, repeats=1, clock=clock)
            )
            spent[name] += time.perf_counter() - t0
        rounds += 1
    ref = results.get(reference)
    for r in results.values():
        if ref is not None:
            r.ratio = r.us_per_step / ref.us_per_step
    return list(results.values())


def print_table(results: list[Result], title: str = "stepfuse benchmark") -> None:
    """A terminal table (rich) of the results, ratio = contender time / stepfuse time."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ("backend", "problem", "contender", "mode", "N", "us/step", "x stepfuse", "build s")
    for col in cols:
        table.add_column(
            col, justify="right" if col in ("N", "us/step", "x stepfuse", "build s") else "left"
        )
    for r in results:
        table.add_row(
            r.backend,
            r.problem,
            r.contender,
            r.mode,  # next to the time: a fit that fell back is shown as stepwise
            str(r.steps),
            f"{r.us_per_step:.2f}",
            "" if r.ratio is None else f"{r.ratio:.2f}",
            f"{r.build_s:.2f}",
        )
    Console().print(table)


def write_json(results: list[Result], path: str, **meta: Any) -> None:
    payload = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d"),
        **meta,
        "results": [dataclasses.asdict(r) for r in results],
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
