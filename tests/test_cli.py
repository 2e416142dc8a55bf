"""The command line: `stepfuse demo` per installed backend, `stepfuse bench --quick`, bad input."""

import json
import math
import re
import subprocess
import sys
import time

import pytest
from helpers import slow_params

from stepfuse.cli import main
from stepfuse.demo import available_backends

DEFAULT_CHUNK_IN_CI = True  # the main job and the bench as users run them (conftest)


# The torch demo compiles three programs (about a minute of CI): it runs with --runslow, as
# does the tf/tf1 minibatch demo; `stepfuse demo` with no --backend (the README's) runs JAX.
@pytest.mark.parametrize(
    "backend",
    slow_params(available_backends(), {"torch"}),
)
def test_demo_passes_its_check_and_writes_json_and_plot(backend, tmp_path, capsys):
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    code = main(
        [
            "demo",
            "--backend",
            backend,
            "--calls",
            "4",
            "--timing-steps",
            "200",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["check_passed"] is True and data["backend"] == backend
    assert len(data["one_step"]) == 12 and len(data["n_step"]) == 4
    assert data["one_step"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert data["n_step"] == pytest.approx(data["one_step"][::3], rel=1e-6)
    assert data["fused_us_per_step"] > 0 and data["stepwise_us_per_step"] > 0
    assert png.stat().st_size > 1000
    out = capsys.readouterr().out
    # one line each, piped too (rich cut them at 80 columns where stdout is no terminal)
    assert re.search(r"check: row k of the 3-step table .* PASSED \(max \|diff\| \S+\)", out)
    assert re.search(r"time per step: fused .* faster fused", out)


def test_demo_with_the_stale_gradient_fails_its_check(tmp_path):
    out = tmp_path / "demo.json"
    code = main(
        [
            "demo",
            "--backend",
            available_backends()[0],
            "--calls",
            "3",
            "--timing-steps",
            "100",
            "--stale-gradient",
            "--json",
            str(out),
        ]
    )
    assert code == 1
    assert json.loads(out.read_text())["check_passed"] is False


@pytest.mark.parametrize(
    "backend",
    slow_params(available_backends(), {"tf", "tf1", "torch"}),
)
def test_demo_with_minibatches_passes_its_check_and_the_stale_gradient_fails_it(backend):
    """``--batch-size``: every step takes its own minibatch (a shuffled Epochs), and the
    N-step calls still equal the one-step calls; the stale-gradient aid still fails."""
    from stepfuse.demo import run_seed

    full = run_seed(backend, 3, 4, timing_steps=20)
    r = run_seed(backend, 3, 4, timing_steps=20, batch_size=10)
    assert r.check_passed, (r.max_abs_diff, r.one_step, r.n_step)
    assert r.batch_size == 10 and len(r.one_step) == 12
    # (the first loss is ln 2 on any data: the kernel of ones gives both classes one logit)
    assert r.one_step[1] != pytest.approx(full.one_step[1], abs=1e-4)
    assert not run_seed(
        backend, 3, 4, timing_steps=20, batch_size=10, stale_gradient=True
    ).check_passed


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["demo", "--batch-size", "0"], "--batch-size"),
        (["demo", "--batch-size", "51"], "--batch-size 51"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--steps", "x"], "--steps"),
        (["demo", "--backend", "mxnet"], "unknown backend"),
        (["demo", "--plot", "/nonexistent-folder/plot.png"], "--plot"),
        (["demo", "--lr", "-1"], "--lr"),
        (["demo", "--lr", "inf"], "--lr must be a finite number"),
        (["demo", "--plot", "out.xyz"], "ending in .png"),
        (["demo", "--plot", "/proc/plot.png"], "cannot write there"),
        (["demo", "--plot", ""], "an empty file name"),
        (["demo", "--json", ""], "an empty file name"),
        (["bench", "--backends", "caffe"], "unknown backend"),
        (["bench", "--sizes", "wide", "--steps", "100"], "nothing to time"),
        (["demo", "--plot", "same.png", "--json", "same.png"], "the same file"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_command_line_is_one_line_and_exit_2(argv, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "stepfuse.cli", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


def test_backend_not_installed_is_reported(monkeypatch, capsys):
    import stepfuse.cli as cli

    monkeypatch.setattr(cli, "available_backends", lambda: ["jax"])
    assert main(["demo", "--backend", "torch"]) == 2
    assert "not installed" in capsys.readouterr().err


# One backend a run. CI runs jax's; the torch row compiles its fits and torch.compile's
# (about two minutes of CI), the tf row traces Keras' loops and the tf1 row builds its
# N-copies graphs (over a minute each): they run with --runslow.
@pytest.mark.parametrize(
    "backend",
    slow_params(available_backends(), {"torch", "tf", "tf1"}),
)
def test_bench_quick_has_every_contender_of_every_backend(backend, tmp_path):
    out = tmp_path / "bench.json"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "stepfuse.cli", "bench", "--quick", "--backends", backend]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    import importlib

    from stepfuse.bench.__main__ import MODULES

    module = importlib.import_module(MODULES[backend])
    assert {r["backend"] for r in results} == {backend}
    for size in ("seed", "mlp"):
        got = {r["contender"] for r in results if r["problem"] == size}
        assert got == set(module.CONTENDERS), (backend, size, got)
    assert all(r["us_per_step"] > 0 for r in results)
    print(f"bench --quick --backends {backend} took {elapsed:.0f} s")


# The torch row compiles the CNN's program (about two minutes of CI): it runs with --runslow.
@pytest.mark.parametrize(
    "backend, sizes",
    [pytest.param("torch", ["cnn"], marks=pytest.mark.slow), ("tf", ["cnn"])],
    ids=["torch", "tf"],
)
def test_bench_model_rows_report_each_fits_mode(backend, sizes, tmp_path):
    """The real-model rows at their smallest (N = 1): every contender of the model size,
    and the stepfuse rows carry the mode their fit ran in (a fit that fell back to
    stepwise must not read as fused). One torch compile (the cnn fit's)."""
    import importlib

    from stepfuse.bench.__main__ import MODULES

    if backend not in available_backends():
        pytest.skip(f"{backend} is not installed")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "stepfuse.bench", "--backend", backend, "--sizes", *sizes]
    proc = subprocess.run(
        [*cmd, "--steps", "1", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    module = importlib.import_module(MODULES[backend])
    assert {r["problem"] for r in results} == set(sizes)
    assert [r["contender"] for r in results] == list(module.MODEL_CONTENDERS)
    for r in results:
        assert r["us_per_step"] > 0 and r["steps"] == 1
        if r["contender"].startswith("stepfuse"):
            assert r["mode"].split(",")[0] in ("fused", "stepwise"), r
        else:
            assert r["mode"] == "", r
    assert "mode" in proc.stdout  # the table's column
    if backend == "tf":  # no random ops in the cnn: the XLA fit stays XLA-compiled
        assert [r["mode"] for r in results][:2] == ["fused", "fused, no XLA"]


# The torch rows compile a fit and the TF rows trace Keras' loops (--runslow); JAX's take
# seconds.
@pytest.mark.parametrize(
    "backend", ["jax"] + [pytest.param(b, marks=pytest.mark.slow) for b in ("tf", "torch")]
)
def test_bench_data_rows_have_every_contender_and_the_fused_mode(backend, tmp_path):
    """``--sizes data-small``: the Epochs fit against its framework's minibatch loops,
    side by side; the stepfuse row says the fit ran fused."""
    from stepfuse.bench import data

    if backend not in available_backends():
        pytest.skip(f"{backend} is not installed")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "stepfuse.bench", "--backend", backend, "--sizes", "data-small"]
        + ["--steps", "256", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [r["contender"] for r in results] == list(data.CONTENDERS[backend])
    assert all(r["problem"] == "data-small" and r["us_per_step"] > 0 for r in results)
    assert results[0]["mode"].split(",")[0] == "fused", results[0]


def test_matplotlib_missing_is_a_usage_error_before_the_run(monkeypatch, capsys):
    import stepfuse.demo

    def run_seed(*args, **kwargs):
        raise AssertionError("the demo ran before --plot was checked")

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(stepfuse.demo, "run_seed", run_seed)  # refused up front, not after the run
    assert main(["demo", "--plot", "out.png"]) == 2
    assert "pip install 'stepfuse[plot]'" in capsys.readouterr().err


def test_stale_gradient_note_is_printed(tmp_path, capsys):
    main(
        [
            "demo",
            "--backend",
            available_backends()[0],
            "--calls",
            "2",
            "--timing-steps",
            "10",
            "--stale-gradient",
        ]
    )
    assert "[stale gradient: the first gradient applied N times]" in capsys.readouterr().out


def test_python_dash_m_stepfuse_is_the_command():
    proc = subprocess.run(
        [sys.executable, "-m", "stepfuse", "demo", "--steps", "0"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--steps" in proc.stderr


def test_stop_prints_its_name():
    from stepfuse import Stop

    assert str(Stop.NONFINITE) == f"{Stop.NONFINITE}" == "Stop.NONFINITE" and Stop.NONFINITE == 2
