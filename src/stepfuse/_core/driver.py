"""The host side of every fused call, written once: notifications from inside the loop
(the user's callback and the progress bar), where a call's loop reaches the host
(`next_multiple`, `paced_every`), a callback's error kept until the loop is done
(`CallbackErrors`), Ctrl-C held back while results are written (`deferred_interrupts`),
and one call of a fit at a time (`exclusive`).
"""

from __future__ import annotations

import importlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .options import Options

if TYPE_CHECKING:
    from .bar import Bar

__all__ = [
    "CallbackErrors",
    "Notifier",
    "deferred_interrupts",
    "exclusive",
    "next_multiple",
    "paced_every",
    "user_stacklevel",
]


def next_multiple(step: Any, every: Any, ahead: Any = 1) -> Any:
    """The first multiple of ``every`` at least ``ahead`` steps after ``step``: where a
    segment of a call that notifies every ``every`` updates ends (ints or tensors)."""
    return (step + ahead + every - 1) // every * every


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` that names the first caller outside
    stepfuse, from wherever inside it the warning is raised (the depth differs between
    a call's start and a callback mid-call)."""
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


class exclusive:  # noqa: N801 - used as a function: ``with exclusive(fit):``
    """One call of a fit at a time: ``with exclusive(fit):`` around ``Fit.__call__``'s body
    (no frame of its own, so warnings still point at the caller's line). A call while
    another runs (from another thread, or from the fit's own callback) raises before
    anything runs: two calls at once would write the same parameters, optimizer state and
    step count in turns."""

    def __init__(self, fit: Any):
        self.fit = fit
        self.lock = fit.__dict__.get("_call_lock") or fit.__dict__.setdefault(
            "_call_lock", threading.Lock()
        )

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            backend = type(self.fit).__module__.rsplit("._", 1)[0]
            raise RuntimeError(
                f"{backend}: this fit is already running a call (from another thread, "
                "or from its own callback); a fit runs one call at a time. Wait for it to "
                "return, or build another fit (with its own model and optimizer) for "
                "parallel work. Nothing was run or changed."
            )

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()


def paced_every(every: int, seconds_per_step: float | None, seconds: float) -> int:
    """Steps between a loop's host calls for a progress bar alone: the multiple of
    ``every`` about ``seconds`` long at the last call's speed (``every`` when unknown).
    A bar redraws about ten times a second, so reaching the host at every multiple of
    ``every`` would only cost time."""
    if not seconds_per_step:
        return every
    return every * max(1, min(int(seconds / (seconds_per_step * every)), 2**30 // every))


class CallbackErrors:
    """The first exception a notification raised during a call, kept until the call's
    loop has finished (a loop on the device does not wait for the host), then re-raised
    as it is; later notifications of that call are skipped."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.step = 0  # the step of the notification that raised it

    def clear(self) -> None:
        self.error = None

    def deliver(self, notify: Callable[[Any, Any], None], step: Any, loss: Any) -> None:
        """``notify(step, loss)`` unless an earlier one failed; its exception is kept."""
        if self.error is not None:
            return
        try:
            notify(step, loss)
        except BaseException as e:  # noqa: BLE001 - re-raised by `reraise`
            self.error, self.step = e, int(step)

    def reraise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def with_state(error: BaseException, state: Any, step: int) -> BaseException:
    """``error`` (a callback's, in a backend whose fit returns its state rather than
    updating it in place) carrying the state its call reached: ``error.state``, the
    updates up to ``step`` applied, as a plain loop stopped there would hold them (an
    attribute of that name the error already has is left, and the note says so)."""
    if getattr(error, "state", None) is None:
        error.state = state  # type: ignore[attr-defined]
        where = "error.state"
    else:
        where = "nowhere (the error already has a `state` attribute)"
    error.add_note(
        f"stepfuse: the fit's state after update {step} (the callback's step), the updates "
        f"up to it applied, is {where}; the state passed to the call is unchanged."
    )
    return error


class _Drawer:
    """The thread that redraws the bars of running calls, about ten times a second.

    One thread serves every call and is kept between calls: starting one per call, and
    its first TensorFlow read (TF sets up each thread on first use), cost ~0.3-0.8 ms a
    call here, ~0.5% of a 100,000-step seed call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held while drawing: `hide` waits for a drawing to end
        self._shown: list = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def show(self, notifier: Notifier) -> None:
        with self._lock:
            self._shown.append(notifier)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="stepfuse-progress", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def hide(self, notifier: Notifier) -> None:
        """Stop drawing ``notifier``; when this returns, no drawing of it is under way."""
        with self._lock:
            if notifier in self._shown:
                self._shown.remove(notifier)

    def _run(self) -> None:
        while True:
            with self._lock:
                interval = min((n._interval for n in self._shown), default=None)
            if interval is None:  # nothing to draw: sleep until a call shows a bar
                self._wake.wait()
                self._wake.clear()
                continue
            time.sleep(interval)
            with self._lock:
                for notifier in list(self._shown):
                    try:
                        notifier._draw()
                    except Exception:  # noqa: BLE001 - a bar that cannot be read is no longer drawn
                        self._shown.remove(notifier)


_DRAWER = _Drawer()
if hasattr(os, "register_at_fork"):  # a forked child has no drawer thread, and maybe a held lock
    os.register_at_fork(after_in_child=lambda: globals().update(_DRAWER=_Drawer()))


class Notifier:
    """The host side of in-loop notifications: the user's callback and/or a progress bar.

    ``notifier(step, loss)`` is what a backend calls from inside its loop: the callback
    runs there and then, while the bar only keeps the pair; stepfuse's drawing thread
    draws the latest pair about ten times a second. The loop's host calls thus never
    wait on drawing (measured on the seed with JAX: ~15 us per bar update and ~1 ms per
    redraw, both holding the interpreter lock the loop's next host call needs).
    Use as a context manager around one call so the bar is closed whatever happens.
    """

    def __init__(self, opts: Options, start_step: int, n: int, label: str = "stepfuse"):
        self.callback = opts.callback
        self.start, self.n = start_step, n
        self._bar: Bar | None = None
        self._latest: tuple[Any, Any] = (math.nan, math.nan)
        self._read: Callable[[], Any] = lambda: self._latest
        self._interval = 0.1
        self._watched = False
        self._final: tuple[Any, Any] | None = None  # (step, loss) given by `done`
        self._shown = False
        if opts.progress:
            from .bar import Bar

            self._bar = Bar(label, total=n)
            self._task = self._bar.task

    def __enter__(self) -> Notifier:
        if self._bar is not None:
            self._bar.live.start(refresh=False)  # first drawn by the thread (~0.5 ms a drawing)
            _DRAWER.show(self)
            self._shown = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._shown:
            _DRAWER.hide(self)
            self._shown = False
            self._show(self._final if self._final is not None else self._read())
        if self._bar is not None:
            self._bar.stop()

    def watch(self, read: Callable[[], Any], interval: float = 0.1) -> None:
        """Draw the bar from ``read() -> (step, loss)``, every ``interval`` seconds, until
        the ``with`` block ends.

        For a bar alone (no ``callback``) a backend may publish its progress where a
        thread can read it, rather than call the host from its loop at all. A second
        ``watch`` is ignored.
        """
        if not self._watched:
            self._read, self._interval, self._watched = read, interval, True

    def _draw(self) -> None:
        assert self._bar is not None  # only bars are drawn
        self._show(self._read())
        self._bar.refresh()

    def _show(self, value: tuple[Any, Any]) -> None:
        assert self._bar is not None
        step, loss = value
        if step == step:  # NaN before the first notification
            # never backwards: `done` may be ahead of the last notification
            completed = max(self._bar.tasks[0].completed, int(step) - self.start)
            self._bar.update(self._task, completed=completed, loss=float(loss))

    def done(self, applied: int, loss: Any = None) -> None:
        """Show the updates the call applied when it returned normally (the bar otherwise
        rests on the last multiple of ``every``); the last loss is shown on exit: ``loss``
        if given (the loss before the last update), else the last one notified or read."""
        if self._bar is not None:
            self._bar.update(self._task, completed=int(applied))
            if loss is not None:
                self._final = (self.start + int(applied), loss)

    def __call__(self, step: Any, loss: Any) -> None:
        if self._bar is not None:
            self._latest = (step, loss)
        if self.callback is not None:
            self.callback(int(step), float(loss))


_set_handler: Callable[[int, Any], Any] = importlib.import_module("_signal").signal
"""``signal.signal`` without its conversion of handlers to enums and back."""


class deferred_interrupts:  # noqa: N801 - used as a function: ``with deferred_interrupts():``
    """Hold back Ctrl-C (SIGINT) while a backend writes one step's results into the user's
    objects, and raise it once they are consistent again (parameters, optimizer state and
    step counter all at the same step). Outside the main thread, signals cannot arrive
    there anyway, and this does nothing.

    A class rather than a generator, on ``_signal`` directly (``signal.signal`` converts
    handlers to enums and back): entering and leaving costs ~1 us rather than ~7, which
    a fused call of one step pays once per program call.
    """

    __slots__ = ("caught", "active", "previous")

    def __enter__(self) -> None:
        self.active = threading.current_thread() is threading.main_thread()
        if self.active:
            self.caught: list[int] = []
            self.previous: Any = _set_handler(signal.SIGINT, self._catch)

    def _catch(self, signum: int, frame: Any) -> None:
        self.caught.append(signum)

    def __exit__(self, *exc: object) -> None:
        if not self.active:
            return
        previous = self.previous
        _set_handler(signal.SIGINT, previous)
        if self.caught and previous != signal.SIG_IGN:  # an ignored Ctrl-C stays ignored
            if callable(previous):
                previous(signal.SIGINT, None)
            else:
                raise KeyboardInterrupt
