"""The command line: ``stepfuse demo`` (the seed's experiment) and ``stepfuse bench``."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import NoReturn

from .demo import BACKENDS, SeedResult, available_backends

__all__ = ["main"]


class UsageError(Exception):
    """A bad command line: reported in one line with exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        raise UsageError(message)


def _positive_int(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be a whole number >= 1, got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lr must be a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"--lr must be a finite number > 0, got {text}")
    return value


def _writable(path: str | None, flag: str) -> None:
    """Refuse, before anything runs, a path the run could not write at its end."""
    if path is None:
        return
    if not path.strip():
        raise UsageError(
            f"{flag} {path!r}: an empty file name; give a file path, e.g. {flag} out"
            + (".png" if flag == "--plot" else ".json")
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a folder; give a file path")
    existed = os.path.exists(path)
    try:  # os.access says yes to root even where the file system says no (/sys, /proc)
        with open(path, "a"):
            pass
    except OSError as e:
        raise UsageError(
            f"{flag} {path}: cannot write there ({e.strerror}); pick a writable file path"
        ) from None
    if not existed:
        os.unlink(path)


def _outputs(plot: str | None, json_path: str | None) -> None:
    """``--plot`` and ``--json``, checked before the run: two writable files, the plot a PNG."""
    if plot and json_path and os.path.abspath(plot) == os.path.abspath(json_path):
        raise UsageError(f"--plot and --json are the same file ({plot}); give each its own")
    _plottable(plot)
    _writable(json_path, "--json")


def _plottable(path: str | None) -> None:
    """``--plot``: matplotlib installed and a PNG file name, checked before the run."""
    if path is None:
        return
    if path.strip() and not path.lower().endswith(".png"):
        raise UsageError(f"--plot {path}: the plot is a PNG; give a file name ending in .png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'stepfuse[plot]'") from None
    _writable(path, "--plot")


def _backend(name: str | None, flag: str = "--backend") -> str:
    installed = available_backends()
    if name is None:
        if not installed:
            raise UsageError("no backend installed: pip install 'stepfuse[jax]' (or [tf], [torch])")
        return installed[0]
    if name not in BACKENDS:
        raise UsageError(f"{flag} {name}: unknown backend; choose from {', '.join(BACKENDS)}")
    if name not in installed:
        extra = "tf" if name == "tf1" else name
        raise UsageError(f"{flag} {name}: not installed; pip install 'stepfuse[{extra}]'")
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stepfuse", description="Run many optimizer steps inside one compiled call."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser(
        "demo", help="the seed's experiment: 1 vs N steps per call, checked and timed"
    )
    demo.add_argument("--backend", help=f"one of {', '.join(BACKENDS)} (default: first installed)")
    demo.add_argument(
        "--steps", type=_positive_int("--steps"), default=3, help="steps per fused call (3)"
    )
    demo.add_argument("--calls", type=_positive_int("--calls"), default=10, help="fused calls (10)")
    demo.add_argument("--lr", type=_positive_float, default=0.01, help="SGD learning rate (0.01)")
    demo.add_argument(
        "--timing-steps",
        type=_positive_int("--timing-steps"),
        default=2000,
        help="steps of the fused call that is timed (2000)",
    )
    demo.add_argument(
        "--batch-size",
        type=_positive_int("--batch-size"),
        help="a minibatch of this many of the 50 points at every step, reshuffled each epoch "
        "(stepfuse.Epochs); default: all of them",
    )
    demo.add_argument("--plot", help="write a PNG of both loss curves")
    demo.add_argument("--json", help="write the numbers as JSON")
    demo.add_argument(
        "--stale-gradient",
        action="store_true",
        help="teaching aid: apply each call's first gradient N times (the check then fails)",
    )

    bench = sub.add_parser("bench", help="the side-by-side benchmark matrix")
    bench.add_argument(
        "--backends", nargs="+", help=f"from {', '.join(BACKENDS)} (default: installed)"
    )
    bench.add_argument(
        "--sizes",
        nargs="+",
        choices=("seed", "mlp", "wide", "cnn", "lstm", "data-small", "data-mnist"),
        help="problem sizes (real models: cnn for torch and tf, lstm for torch; data "
        "streams: data-small and data-mnist for jax, tf and torch)",
    )
    bench.add_argument("--steps", nargs="+", type=_positive_int("--steps"), help="values of N")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a small matrix (seed and mlp, N = 10 and 100), about a minute and a half",
    )
    bench.add_argument("--json", help="write all results as JSON")
    bench.add_argument("--plot", help="write a PNG: us/step against N per contender (log-log)")
    return parser


def _print_demo(r: SeedResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    data = "" if r.batch_size is None else f", minibatches of {r.batch_size} (stepfuse.Epochs)"
    table = Table(
        title=f"seed perceptron, {r.backend}: loss before each call (SGD lr={r.lr}{data})"
    )
    table.add_column("step", justify="right")
    table.add_column("1 step per call", justify="right")
    table.add_column(f"{r.steps} steps per call", justify="right")
    for i, loss in enumerate(r.one_step):
        k, rem = divmod(i, r.steps)
        table.add_row(str(i), f"{loss:.6f}", f"{r.n_step[k]:.6f}" if rem == 0 else "")
    console.print(table)
    verdict = "PASSED" if r.check_passed else "FAILED"
    console.print(
        f"check: row k of the {r.steps}-step table == row {r.steps}*k of the 1-step table: "
        f"[bold]{verdict}[/bold] (max |diff| {r.max_abs_diff:.2e})"
        + ("  \\[stale gradient: the first gradient applied N times]" if r.stale_gradient else ""),
        soft_wrap=True,  # (one line in a log too: a pipe gets rich's 80 columns)
    )
    console.print(
        f"time per step: fused {r.fused_us_per_step:.2f} us, one step per call "
        f"{r.stepwise_us_per_step:.2f} us -> [bold]{r.speedup:.1f}x[/bold] faster fused",
        soft_wrap=True,
    )


def _plot_demo(r: SeedResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(len(r.one_step)), r.one_step, "o-", ms=3, label="1 step per call")
    ax.plot(
        [k * r.steps for k in range(len(r.n_step))],
        r.n_step,
        "s",
        ms=7,
        mfc="none",
        label=f"{r.steps} steps per call (fused)",
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(
        f"stepfuse demo ({r.backend}): {'check passed' if r.check_passed else 'CHECK FAILED'}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def _demo(args: argparse.Namespace) -> int:
    import dataclasses

    from .demo import run_seed

    backend = _backend(args.backend)
    _outputs(args.plot, args.json)
    if args.batch_size is not None and args.batch_size > 50:
        raise UsageError(f"--batch-size {args.batch_size}: the seed has 50 points; give 1..50")
    r = run_seed(
        backend,
        args.steps,
        args.calls,
        args.lr,
        stale_gradient=args.stale_gradient,
        timing_steps=args.timing_steps,
        batch_size=args.batch_size,
    )
    _print_demo(r)
    if args.plot is not None:
        _plot_demo(r, args.plot)
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump({**dataclasses.asdict(r), "speedup": r.speedup}, f, indent=2)
    return 0 if r.check_passed else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench._timing import Result, print_table

    backends = (
        [_backend(b, "--backends") for b in dict.fromkeys(args.backends)]
        if args.backends
        else available_backends()
    )
    if not backends:
        raise UsageError("no backend installed: pip install 'stepfuse[jax]' (or [tf], [torch])")
    _outputs(args.plot, args.json)
    sizes = args.sizes or (["seed", "mlp"] if args.quick else ["seed", "mlp", "wide"])
    steps = args.steps or ([10, 100] if args.quick else [1, 10, 100, 1000, 10_000])
    from .bench.problems import MAX_STEPS

    if not any(n <= MAX_STEPS[size] for size in sizes for n in steps):
        limits = ", ".join(f"{size} at most {MAX_STEPS[size]}" for size in sizes)
        raise UsageError(
            f"--steps {' '.join(map(str, steps))}: no size runs that many steps "
            f"({limits}); nothing to time"
        )
    results: list[Result] = []
    for backend in backends:  # each backend in its own process
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.json")
            cmd = [
                sys.executable,
                "-m",
                "stepfuse.bench",
                "--backend",
                backend,
                "--json",
                out,
                "--sizes",
                *sizes,
                "--steps",
                *map(str, steps),
            ] + (["--quick"] if args.quick else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
                print(f"stepfuse bench: {backend} failed: {tail[0]}", file=sys.stderr)
                continue
            with open(out) as f:
                results += [Result(**r) for r in json.load(f)["results"]]
    print_table(results, title="stepfuse bench (x stepfuse = contender us/step / stepfuse us/step)")
    if args.json is not None:
        from .bench._timing import write_json

        write_json(results, args.json, command="stepfuse bench " + " ".join(sys.argv[2:]))
    if args.plot is not None and results:
        from .bench._plot import plot_results

        plot_results(results, args.plot)
    return 0 if results else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stepfuse`` command."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up log is noise here
    try:
        args = build_parser().parse_args(argv)
        code = _demo(args) if args.command == "demo" else _bench(args)
    except UsageError as e:
        print(f"stepfuse: error: {e}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
