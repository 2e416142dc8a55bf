"""Every Python example in the README runs as written, alone (each defines its own data)."""

import re
from pathlib import Path

import pytest

from stepfuse.demo import available_backends

DEFAULT_CHUNK_IN_CI = True  # the examples as written, at torch's default chunk (conftest)
README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
NEEDS = {
    "stepfuse.jax": "jax",
    "stepfuse.tf.v1": "tf1",
    "stepfuse.tf ": "tf",
    "stepfuse.torch": "torch",
}


def _backend(block):
    for marker, backend in NEEDS.items():
        if marker in block:
            return backend
    raise AssertionError(f"README block uses no backend:\n{block}")


def test_readme_has_an_example_per_backend():
    assert sorted(_backend(b) for b in BLOCKS) == ["jax", "tf", "tf1", "torch"]


@pytest.mark.parametrize("block", BLOCKS, ids=[_backend(b) for b in BLOCKS])
def test_readme_example_runs(block):
    if _backend(block) not in available_backends():
        pytest.skip("backend not installed")
    scope: dict = {}
    exec(compile(block, str(README), "exec"), scope)
    if "trace" in scope:
        assert scope["trace"].steps >= 1


def test_the_results_files_the_docs_cite_are_in_the_repository():
    # Two were left out of git by an ignore pattern: a fresh clone had neither.
    root = README.parent
    texts = [README.read_text(), *(p.read_text() for p in (root / "docs").rglob("*.md"))]
    cited = sorted({m for t in texts for m in re.findall(r"benchmarks/results/[\w.-]+", t)})
    assert cited, "the docs cite no results file"
    missing = [c for c in cited if not (root / c).is_file()]
    assert not missing, missing
