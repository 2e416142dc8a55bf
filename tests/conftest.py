import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
# JAX's persistent compilation cache, in a directory of this run (set here, before JAX is
# imported; the pytest-xdist workers and the subprocesses inherit it): tests compile the
# same programs again (a fit per test, a fit per Hypothesis example). test_jax.py with
# test_properties_jax.py took 175 s with it and 190 s without, one process each, empty
# cache at the start.
_JAX_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _JAX_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="stepfuse-jax-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

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


def pytest_unconfigure(config):
    if _JAX_CACHE is not None:  # (only the process that made it: workers inherit the path)
        shutil.rmtree(_JAX_CACHE, ignore_errors=True)


def pytest_configure(config):
    if config.getoption("--runslow"):  # (read as well where a test's setup is built at import:
        os.environ["STEPFUSE_SLOW"] = "1"  # helpers.examples)


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
    if _slow(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (or STEPFUSE_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _slow(config) -> bool:
    return config.getoption("--runslow") or os.environ.get("STEPFUSE_SLOW") == "1"


_DEFAULT_CHUNK: dict[str, int] = {}  # stepfuse.torch's own TINY_CHUNK, before any patch


@pytest.fixture(scope="module", autouse=True)
def tiny_chunk_of_one_in_ci(request):
    """In CI (not with --runslow), torch fits of a tiny model run 1 step a loop iteration
    instead of the default `TINY_CHUNK` (4), except in the modules that set
    ``DEFAULT_CHUNK_IN_CI = True`` (the CLI's demo and bench and the README's examples run
    as users run them) and in tests marked ``default_chunk``. A chunk of 4 compiles the
    same step 4 times: the data guide's two programs took 109 s at the default and 33 s at
    1, the eval fixture 77 s and 23 s. What a chunk longer than one step changes (stops
    and call ends inside an iteration, the discarded steps) is the subject of the tests
    that pass ``chunk=2`` (the conformance suite, test_torch's reference runs); --runslow
    runs every test at the default. Subprocesses (the DDP ranks) keep the default.
    (Module scope, and autouse: it is in place before the module's own fixtures.)"""
    plan = sys.modules.get("stepfuse.torch._plan")
    if (
        plan is None
        or _slow(request.config)
        or getattr(request.module, "DEFAULT_CHUNK_IN_CI", False)
    ):
        yield
        return
    _DEFAULT_CHUNK.setdefault("tiny", plan.TINY_CHUNK)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "TINY_CHUNK", 1)
        yield


@pytest.fixture(autouse=True)
def default_chunk(request):
    """A test marked ``default_chunk`` sees stepfuse.torch's own `TINY_CHUNK`."""
    plan = sys.modules.get("stepfuse.torch._plan")
    if plan is None or "default_chunk" not in request.keywords or "tiny" not in _DEFAULT_CHUNK:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "TINY_CHUNK", _DEFAULT_CHUNK["tiny"])
        yield
