import importlib.util
import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))

import pytest  # noqa: E402


@pytest.fixture
def benchmark_script():
    """``load(name)``: the module ``benchmarks/<name>.py``, for tests that run a script's
    ``main`` on its smallest settings."""

    def load(name: str):
        path = pathlib.Path(__file__).parent.parent / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (full sweeps; CI runs a sample of them)",
    )


# The files that take longest, longest first (about as many seconds of one worker in a run
# of the whole suite on a 2-core CPU, 2026-12-05: test_torch 380, test_jax 310, test_tf
# 275, test_torch_models 250, the conformance suite 200, test_tf_v1 180, test_data_torch
# 170, test_devices_torch 170, test_reliability_tf 150, test_data_tf1 140): the two workers (``--dist loadfile``, in
# this order: ``--no-loadscope-reorder``) start with them and end on short files, not on
# one long file while the other worker has nothing left.
LONGEST_FIRST = (
    "test_torch.py",
    "test_jax.py",
    "test_tf.py",
    "test_torch_models.py",
    "test_conformance.py",
    "test_tf_v1.py",
    "test_data_torch.py",
    "test_devices_torch.py",
    "test_reliability_tf.py",
    "test_data_tf1.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable)
    if config.getoption("--runslow") or os.environ.get("STEPFUSE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (or STEPFUSE_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
