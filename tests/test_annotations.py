"""Every public function and method of the package is fully annotated.

"Public": a name in a module's ``__all__`` (functions, and the public methods of
classes, ``__init__`` and ``__call__`` included) for the root package, the core and
every backend. ``__init__`` may leave out its ``-> None``. A parameter without an annotation, or a function without a return
annotation, fails with its qualified name.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = [
    "stepfuse",
    "stepfuse._core",
    "stepfuse.jax",
    "stepfuse.tf",
    "stepfuse.tf.v1",
    "stepfuse.torch",
    "stepfuse.demo",
    "stepfuse.cli",
    "stepfuse.bench",
    "stepfuse.problems",
]


def _unannotated(fn, where: str) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    missing = [
        f"{where}({name})"
        for name, p in sig.parameters.items()
        if name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
    ]
    if sig.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
        missing.append(f"{where} -> ?")
    return missing


def _public_functions(module):
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if inspect.isfunction(obj) and obj.__module__.startswith("stepfuse"):
            yield f"{module.__name__}.{name}", obj
        elif inspect.isclass(obj) and obj.__module__.startswith("stepfuse"):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr not in ("__init__", "__call__"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member) and member.__module__.startswith("stepfuse"):
                    yield f"{obj.__module__}.{obj.__qualname__}.{attr}", member


@pytest.mark.parametrize("name", MODULES)
def test_public_functions_are_fully_annotated(name):
    try:
        module = importlib.import_module(name)
    except ImportError as e:  # a backend whose framework is not installed
        pytest.skip(f"{name}: {e}")
    missing = [m for where, fn in _public_functions(module) for m in _unannotated(fn, where)]
    assert not missing, "not annotated: " + ", ".join(missing)


def test_the_check_finds_a_missing_annotation():
    def f(a, b: int):
        return a

    assert _unannotated(f, "f") == ["f(a)", "f -> ?"]
