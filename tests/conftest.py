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


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("STEPFUSE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (or STEPFUSE_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
