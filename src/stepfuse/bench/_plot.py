"""The benchmark plot: microseconds per step against N, one line per contender (log-log)."""

from __future__ import annotations

from collections import defaultdict


def plot_results(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({r.problem for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, problem in zip(axes[0], panels):
        lines = defaultdict(list)
        for r in results:
            if r.problem == problem:
                lines[(r.backend, r.contender)].append((r.steps, r.us_per_step))
        for (backend, contender), pts in sorted(lines.items()):
            pts.sort()
            style = "-" if contender == "stepfuse" or contender.startswith("stepfuse") else "--"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3,
                    label=f"{backend}: {contender}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N (steps per call)")
        ax.set_ylabel("us per step")
        ax.set_title(problem)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
