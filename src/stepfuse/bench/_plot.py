"""The benchmark plot: microseconds per step against N, one line per contender (log-log).

One panel per problem size; one colour per backend, stepfuse drawn solid and thick, the
other contenders of that backend dashed with their own markers.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._timing import Result

_COLORS = {"jax": "tab:blue", "tf": "tab:orange", "tf1": "tab:green", "torch": "tab:red"}
_MARKERS = "sv^Dx*P"


def plot_results(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({r.problem for r in results}, key=["seed", "mlp", "wide"].index)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, problem in zip(axes[0], panels):
        lines: defaultdict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
        for r in results:
            if r.problem == problem:
                lines[(r.backend, r.contender)].append((r.n or r.steps, r.us_per_step))
        others: defaultdict[str, int] = defaultdict(int)
        for (backend, contender), pts in sorted(lines.items()):
            pts.sort()
            color = _COLORS.get(backend, "gray")
            if contender == "stepfuse":
                style = dict(ls="-", lw=2.5, marker="o")
            else:
                style = dict(ls="--", lw=1, marker=_MARKERS[others[backend] % len(_MARKERS)])
                others[backend] += 1
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color=color,
                ms=4,
                label=f"{backend}: {contender}",
                **style,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N (steps per call)")
        ax.set_ylabel("us per step")
        ax.set_title(problem)
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = min(4, 2 * len(panels))  # two columns fit a 5.5-inch panel's width
    rows = -(-len(labels) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, min(0.5, 0.04 + 0.035 * rows * 4.5 / fig.get_figheight()), 1, 1))
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
