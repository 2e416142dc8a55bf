"""The options every backend's ``fuse`` shares, validated and documented in one place.

Every check runs before anything is traced, compiled or updated, and every error
names the argument, the value received and how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import textwrap
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from .trace import ceil_div

__all__ = [
    "Options",
    "a_type",
    "check_options",
    "check_call_steps",
    "check_int",
    "check_steps",
    "check_tol",
    "OPTIONS_DOC",
    "fail",
    "shared_doc",
]

OPTIONS_DOC = """\
steps: updates per call, an ``int >= 1``; a call may pass ``steps=n`` to run
  ``n`` updates with the same compiled program.
tol: stop early inside the loop once ``abs(loss[i] - loss[i-1]) <= tol``
  (consecutive losses of one call); ``None`` (default) never stops early.
record_every: keep every k-th loss in the trace (memory ``O(steps / k)``).
callback: ``callback(step, loss)`` called on the host from *inside* the fused loop
  after every ``every``-th update (``step`` counts updates since ``init``, ``loss``
  is the loss before that update). An exception it raises reaches the caller.
every: how often ``callback`` fires, and the steps at which the progress bar may
  move (it redraws about ten times a second); default about 100 times per call of
  ``steps``.
progress: show a progress bar for each call, updated from inside the loop.
on_nonfinite: ``"stop"`` (default) ends the call with ``Stop.NONFINITE``;
  ``"raise"`` also raises `stepfuse.NonFiniteError` with the step number. Either
  way the refused update is not applied.
mode: ``"fused"`` (default) runs the steps in one compiled call; ``"stepwise"``
  runs the identical semantics as a plain Python loop of single steps (the
  reference the fused mode is tested against, and handy for debugging).
eval_fn: evaluated on the device, inside the loop, after every update that brings
  the fit's step count (updates since ``init``) to a multiple of ``eval_every``;
  returns a scalar or a dict of scalars. Each call passes its arguments as
  ``eval_batch=(...)``; the results come back as ``trace.eval`` (`EvalTrace`).
eval_every: how many updates between evaluations (default: ``steps``, once at the
  end of each full call); only with ``eval_fn``."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _put_options(fn: _F, text: str) -> _F:
    """Put ``text`` where ``fn``'s docstring has a line ``{options}``, indented as that line is."""
    lines = (fn.__doc__ or "").split("\n")
    at = [i for i, line in enumerate(lines) if line.strip() == "{options}"]
    if len(at) != 1:
        raise ValueError(f"{fn.__qualname__}'s docstring needs one line '{{options}}'")
    indent = lines[at[0]][: len(lines[at[0]]) - len(lines[at[0]].lstrip())]
    lines[at[0]] = textwrap.indent(text, indent)
    fn.__doc__ = "\n".join(lines)
    return fn


def shared_doc(fn: _F) -> _F:
    """Put `OPTIONS_DOC` where ``fn``'s docstring has a line ``{options}``, indented as
    that line is (the argument list of every backend's ``fuse``)."""
    return _put_options(fn, OPTIONS_DOC)


class Described:
    """A value received, described rather than shown (a large value or structure): what
    `fail` writes after "got", the type's name with it."""

    def __init__(self, text: str, value: Any):
        self.text, self.kind = text, type(value).__name__


def a_type(value: Any) -> str:
    """``value``'s type name with its article: "a list", "an int"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def fail(exc: type[BaseException], name: str, value: Any, want: str, fix: str) -> NoReturn:
    """Raise ``exc`` with stepfuse's argument error: the argument's name, what it must be,
    the value received (and its type) and how to fix it (a `Described` value: its text)."""
    if isinstance(value, Described):
        got = f"{value.text} ({value.kind})"
    else:
        got = f"{value!r} ({type(value).__name__})"
    raise exc(f"`{name}` must be {want}; got {got}. {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value: Any, name: str, fix: str, *, minimum: int = 1) -> int:
    """``value`` as a Python int ``>= minimum``, or a TypeError/ValueError naming ``name``."""
    if not _is_int(value):
        fail(TypeError, name, value, f"an int >= {minimum}", fix)
    if value < minimum:
        fail(ValueError, name, value, f"an int >= {minimum}", fix)
    return int(value)


def check_steps(value: Any, name: str = "steps") -> int:
    fix = f"Pass the number of optimizer updates per call, e.g. {name}=100."
    if "Tracer" in type(value).__name__:  # a traced value inside a user's jax.jit
        fix += (
            " The step count sizes the compiled loop, so it must be a Python int: inside "
            "jax.jit make it static (static_argnums / static_argnames) or close over it."
        )
    return check_int(value, name, fix)


def check_tol(value: Any) -> float | None:
    if value is None:
        return None
    fix = "Pass a loss difference >= 0 such as tol=1e-6, or tol=None to never stop early."
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        fail(TypeError, "tol", value, "a float >= 0 or None", fix)
    if not float(value) >= 0 or math.isnan(value):
        fail(ValueError, "tol", value, "a float >= 0 or None", fix)
    return float(value)


@dataclasses.dataclass(frozen=True)
class Options:
    """The validated options shared by every backend (see `OPTIONS_DOC`)."""

    steps: int
    tol: float | None = None
    record_every: int = 1
    callback: Callable[[int, float], Any] | None = None
    every: int | None = None
    progress: bool = False
    on_nonfinite: str = "stop"
    mode: str = "fused"
    eval_fn: Callable[..., Any] | None = None
    eval_every: int | None = None

    @property
    def eval_capacity(self) -> int:
        """Evaluation slots a call of up to ``steps`` updates needs (0 without ``eval_fn``)."""
        if self.eval_every is None:
            return 0
        return ceil_div(self.steps, self.eval_every)

    @property
    def capacity(self) -> int:
        """Recorded-loss slots a call of up to ``steps`` updates needs.

        A call evaluates at most ``steps`` losses (a refused non-finite update is one
        of the ``steps`` iterations), so this is ``ceil(steps / record_every)``.
        """
        return ceil_div(self.steps, self.record_every)

    @property
    def notify(self) -> bool:
        """Whether the loop has to reach the host from inside (callback or progress)."""
        return self.callback is not None or self.progress


def check_options(
    steps: Any,
    tol: Any = None,
    record_every: Any = 1,
    callback: Any = None,
    every: Any = None,
    progress: Any = False,
    on_nonfinite: Any = "stop",
    mode: Any = "fused",
    modes: tuple = ("fused", "stepwise"),
    eval_fn: Any = None,
    eval_every: Any = None,
) -> Options:
    """Validate the shared options of ``fuse``; raises before anything is built."""
    from .evaluation import check_eval  # evaluation's checks use this module's `fail`

    steps = check_steps(steps)
    tol = check_tol(tol)
    record_every = check_int(
        record_every, "record_every", "Pass 1 to keep every loss, or k to keep every k-th one."
    )
    if callback is not None and not callable(callback):
        fail(
            TypeError,
            "callback",
            callback,
            "callable as callback(step, loss) or None",
            "Pass a function, e.g. callback=lambda step, loss: print(step, loss).",
        )
    if not isinstance(progress, bool):
        fail(
            TypeError,
            "progress",
            progress,
            "True or False",
            "Pass progress=True for a progress bar.",
        )
    if every is not None:
        every = check_int(
            every, "every", "Pass how many updates between callbacks, e.g. every=100."
        )
        if callback is None and not progress:
            fail(
                ValueError,
                "every",
                every,
                "used with `callback` or `progress=True`",
                "Pass callback=... or progress=True, or drop `every`.",
            )
    elif callback is not None or progress:
        every = max(1, steps // 100)
    if on_nonfinite not in ("stop", "raise"):
        fail(
            ValueError,
            "on_nonfinite",
            on_nonfinite,
            '"stop" or "raise"',
            'Pass on_nonfinite="stop" to end the call quietly or "raise" to get an error.',
        )
    if mode not in modes:
        fail(
            ValueError,
            "mode",
            mode,
            " or ".join(repr(m) for m in modes),
            'Use mode="fused" for the compiled loop or mode="stepwise" for the reference loop.',
        )
    eval_fn, eval_every = check_eval(eval_fn, eval_every, steps)
    return Options(
        steps, tol, record_every, callback, every, progress, on_nonfinite, mode, eval_fn, eval_every
    )


def check_call_steps(value: Any, opts: Options, *, capped: bool) -> int:
    """The ``steps=`` of one call: ``None`` means ``opts.steps``.

    ``capped`` backends (those whose trace buffer is sized when the program is built)
    accept at most ``opts.steps``.
    """
    if value is None:
        return opts.steps
    n = check_steps(value)
    if capped and n > opts.steps:
        fail(
            ValueError,
            "steps",
            value,
            f"at most {opts.steps} (the `steps` given to fuse)",
            f"Build with fuse(..., steps={n}) (or more) to run longer calls; "
            "any smaller `steps` reuses the same program.",
        )
    return n


def shared_doc_of(*names: str) -> Callable[[_F], _F]:
    """`shared_doc` for a ``fuse`` that takes only some of the shared options (or documents
    others its own way): the line ``{options}`` gets the entries of `OPTIONS_DOC` named
    ``names``, in `OPTIONS_DOC`'s order, indented as that line is."""
    entries: dict[str, list[str]] = {}
    for line in OPTIONS_DOC.split("\n"):
        if not line.startswith(" "):  # an entry's first line: "name: ..."
            entries[line.split(":", 1)[0]] = []
        entries[next(reversed(entries))].append(line)
    unknown = [n for n in names if n not in entries]
    if unknown or not names:
        raise ValueError(f"shared_doc_of: no shared options named {unknown or names!r}")
    text = "\n".join(line for name, lines in entries.items() if name in names for line in lines)

    return lambda fn: _put_options(fn, text)
