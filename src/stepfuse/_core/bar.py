"""The progress bar `Notifier` draws: one rich line, laid out without a table.

rich's stock `Progress` lays its columns out as a table, measuring every cell at every
drawing, which costs a call several times what this single line of text does (the frame
drawn when a call ends is paid by the call; numbers: the docs' performance page). The
line shows the same things: label, bar, ``completed/total``, the last loss, time left.
"""

from __future__ import annotations

import math
from typing import Any

from rich.progress import Progress
from rich.text import Text

__all__ = ["Bar"]

_WIDTH = 40  # the bar's most characters (rich's default)


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Bar(Progress):
    """A `rich.progress.Progress` of one task drawn as a single line of ``label``."""

    def __init__(self, label: str, total: int, loss: float = math.nan):
        super().__init__(transient=False, auto_refresh=False)
        self.label = label
        self.task = self.add_task(label, total=total, loss=loss)

    def get_renderables(self) -> Any:
        if not self.tasks:
            return
        task = self.tasks[0]
        total = max(task.total or 0, 1)
        done = task.completed >= total
        counts = f" {int(task.completed)}/{int(total)} loss {task.fields['loss']:.4g} "
        eta = _clock(0 if done else task.time_remaining)
        width = self.console.width - len(self.label) - len(counts) - len(eta) - 2
        width = max(10, min(_WIDTH, width))
        fill = min(width, int(width * task.completed / total))
        yield Text.assemble(
            (self.label, "bold"),
            " ",
            ("━" * fill, "bar.finished" if done else "bar.complete"),
            ("━" * (width - fill), "bar.back"),
            counts,
            (eta, "progress.remaining"),
            no_wrap=True,
            overflow="ellipsis",
        )
