"""stepfuse.tf over several devices: a model and optimizer created under a
MirroredStrategy of two logical CPU devices. The fit runs each step's batch split over the
replicas and equals the same fit on one device with the whole batch (fixed batch, Epochs,
Batches, with record_every / callback / eval_fn, stepwise); a non-finite step on one
replica is refused on all; bad input is refused before anything changes.

The devices must be configured before TensorFlow initialises, so the checks run in one
fresh process (tests/devices_tf_worker.py), whose results each test reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepfuse import Stop

pytest.importorskip("tensorflow")

WORKER = Path(__file__).with_name("devices_tf_worker.py")
# float32, the reductions split over two replicas: a few ulps of the losses' scale
TOL = 1e-5


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(WORKER)], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", ["fixed", "epochs", "batches", "iterator", "options", "stepwise"])
def test_two_replicas_equal_one_device_on_the_whole_batch(results: dict, case: str) -> None:
    row = results[case]
    assert row["mode"] == "fused"
    assert row["plan_xla"] is False
    assert "MirroredStrategy" in row["plan_reason"] or "iterator" in row["plan_reason"]
    assert row["steps"] == row["steps_one_device"] and sum(row["steps"]) > 0
    assert row["stops"] == row["stops_one_device"] == [int(Stop.STEPS)] * len(row["stops"])
    assert row["loss_gap"] <= TOL * max(1.0, row["loss_scale"])
    assert row["state_gap"] <= TOL


def test_record_every_callbacks_and_evaluations_match_one_device(results: dict) -> None:
    row = results["options"]
    assert row["notes"] == row["notes_one_device"] == [2, 4, 6]
    assert row["note_gap"] <= TOL * max(1.0, row["loss_scale"])
    assert row["eval_steps"] == row["eval_steps_one_device"] == [3, 6]
    assert row["eval_gap"] <= TOL * max(1.0, row["loss_scale"])


def test_a_nonfinite_step_on_one_replica_is_refused_on_all(results: dict) -> None:
    row = results["nonfinite"]
    assert row["stop"] == int(Stop.NONFINITE) and row["steps"] == 0
    assert row["unchanged"] == 0.0 and row["fit_step"] == 2
    assert row["replica_copies_gap"] == 0.0


def test_a_batch_the_replicas_cannot_split_is_refused_before_anything_runs(
    results: dict,
) -> None:
    row = results["uneven"]
    assert row["error"] is not None, "7 rows over 2 replicas ran"
    assert "`batch`" in row["error"] and "2 replicas" in row["error"]
    assert "7 rows" in row["error"] and "multiple of 2" in row["error"]
    assert row["unchanged"] == 0.0 and row["fit_step"] == 0


def test_a_dataset_of_unknown_rows_is_refused_naming_drop_remainder(results: dict) -> None:
    row = results["unknown_rows"]
    assert row["error"] is not None, "a batch of unknown rows ran over 2 replicas"
    assert "unknown number of rows" in row["error"] and "drop_remainder=True" in row["error"]
    assert row["fit_step"] == 0


def test_an_optimizer_from_outside_the_scope_is_refused(results: dict) -> None:
    error = results["optimizer_outside"]["error"]
    assert error is not None and "`optimizer`" in error and "scope()" in error
