"""stepfuse.jax over several devices: inputs placed with `NamedSharding` over a `Mesh` of 8
fake CPU devices run as one SPMD program. 8-way data parallel (fixed batch, `Batches`,
`Epochs`) and parameters sharded FSDP-style over a 2 x 4 grid equal the one-device fit on
the whole batch; the outputs keep their shardings; the compiled program holds the
gradients' all-reduce; notifications, records and evaluations still come; a dataset split
its minibatches cannot follow is refused before anything runs.

XLA must be told to show 8 CPU devices before JAX initialises, so the checks run in one
fresh process (tests/devices_jax_worker.py), whose results each test reads.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stepfuse import Stop

WORKER = Path(__file__).with_name("devices_jax_worker.py")
# float32 sums split over 8 devices: a few ulps of the losses' and parameters' scale
TOL = 2e-6


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, str(WORKER)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8
    return out


@pytest.mark.parametrize("case", ["fixed", "batches", "epochs", "fsdp"])
def test_eight_devices_equal_one_device_on_the_whole_batch(results: dict, case: str) -> None:
    row = results[case]
    assert row["devices"] == 8
    assert row["steps"] == row["steps_one_device"] and sum(row["steps"]) > 0
    assert row["stops"] == [int(Stop.STEPS)] * len(row["stops"])
    assert row["step"] == sum(row["steps"])
    assert row["loss_gap"] <= TOL * max(1.0, row["loss_scale"])
    assert row["state_gap"] <= TOL
    # one program whatever the calls' steps: `init` places the step count and the
    # optimizer's scalars as a call returns them (the second call compiled again)
    assert row["compiles"] == 1


@pytest.mark.parametrize("case", ["fixed", "batches", "epochs", "fsdp"])
def test_outputs_keep_the_inputs_shardings(results: dict, case: str) -> None:
    assert results[case]["shardings_kept"] is True


def test_the_fsdp_parameters_stay_split_over_the_grid(results: dict) -> None:
    assert results["fsdp"]["param_specs"] == {
        "b1": "P('fsdp',)",
        "w1": "P(None, 'fsdp')",
        "w2": "P('fsdp',)",
    }


@pytest.mark.parametrize("case", ["fixed", "batches", "epochs"])
def test_data_parallel_programs_all_reduce_the_gradients(results: dict, case: str) -> None:
    counts = results[case]["collectives"]
    assert counts["all-reduce"] >= 1
    assert counts["all-to-all"] == 0
    if case != "epochs":  # a fixed or stacked batch: nothing to gather, one all-reduce
        assert counts == {**counts, "all-gather": 0, "reduce-scatter": 0, "all-reduce": 1}
    assert sum(results["fixed"]["collectives_one_device"].values()) == 0


def test_an_epochs_minibatch_is_split_as_its_dataset(results: dict) -> None:
    rows = results["epochs"]["per_device_rows"]
    assert "2" in rows and "16" not in rows  # 16 rows a step, 2 a device


def test_fsdp_gathers_the_parameters_and_reduces_the_gradients(results: dict) -> None:
    counts = results["fsdp"]["collectives"]
    assert counts["all-gather"] >= 1
    assert counts["all-reduce"] + counts["reduce-scatter"] >= 1


def test_notifications_records_and_evaluations_match_one_device(results: dict) -> None:
    row = results["options"]
    assert row["notes"] == row["notes_one_device"] == [3, 6, 9, 12]
    assert row["note_gap"] <= TOL * 10
    assert row["records"] == 6 and row["loss_gap"] <= TOL * 10
    assert row["eval_steps"] == [4, 8, 12] and row["eval_gap"] <= TOL * 10
    assert row["state_gap"] <= TOL and row["shardings_kept"] is True


def test_a_minibatch_the_dataset_split_cannot_follow_is_refused_before_anything_runs(
    results: dict,
) -> None:
    row = results["uneven"]
    assert row["error"] is not None, "batch_size=12 over 8 devices ran"
    assert "`batch_size`" in row["error"] and "got 12" in row["error"]
    assert "multiple of 8" in row["error"] and "'data'" in row["error"]
    assert row["compiles"] == 0 and row["unchanged"] == 0.0 and row["step"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # two more JAX processes compiling (the multi-host guide): --runslow
def test_two_processes_after_distributed_initialize_equal_one_device() -> None:
    """Multi-host use on one machine: two processes of 4 CPU devices each, one mesh of
    8, each process placing its half of the batch (gloo carries the collectives)."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "multihost", str(pid), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for pid in (0, 1)
    ]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
        rows.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["process"] for r in rows] == [0, 1]
    for r in rows:
        assert r["devices"] == 8 and r["local_devices"] == 4
        assert r["steps"] == 12 and r["step"] == 12
        assert r["loss_gap"] <= TOL * 10 and r["state_gap"] <= TOL
    # each notification reaches the host once, in the process of the mesh's first device
    assert rows[0]["notes"] + rows[1]["notes"] == [4, 8, 12]


def test_the_guides_data_parallel_and_fsdp_examples_run_as_written(results: dict) -> None:
    """docs/guides/jax.md's two mesh examples on the 8 devices: 1,000 steps each, and the
    FSDP one's w1 split in 4 over the grid's "fsdp" axis."""
    assert results["guide"] == {"steps": [1000, 1000], "w1_shards": 4}
