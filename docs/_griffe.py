"""Griffe extensions for the API pages (not a page: excluded in mkdocs.yml).

The API pages read stepfuse's source (static analysis keeps what only the source has: the
docstrings of attributes and enum members, the annotations as written). Two extensions
adjust what that gives:

* `RuntimeDocstrings`: a docstring completed at import time (each backend's ``fuse`` gets
  the shared options text where its docstring has an ``{options}`` line) is shown as
  ``help()`` shows it: the imported object's ``__doc__`` replaces the source's when they
  differ.
* `ExportsOnly`: a module with ``__all__`` documents those names only, not the helpers it
  imports from ``stepfuse._core``.
* `DoctestExamples`: an ``Example:`` section (Google style's singular, which griffe reads
  as an admonition of plain text) is read as ``Examples:``, so its ``>>>`` lines render as
  code.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import griffe

logger = griffe.get_logger("stepfuse_docs")


class RuntimeDocstrings(griffe.Extension):
    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        old = func.docstring
        if old is None or func.module.name == "__main__":  # running a __main__ runs the CLI
            return
        try:
            runtime = griffe.dynamic_import(func.path)
        except ImportError as error:
            logger.warning("could not import %s for its docstring: %s", func.path, error)
            return
        doc = inspect.cleandoc(getattr(runtime, "__doc__", None) or "")
        if doc and doc != old.value:
            func.docstring = griffe.Docstring(
                _examples(doc),
                lineno=old.lineno,
                endlineno=old.endlineno,
                parent=func,
                parser=old.parser,
                parser_options=old.parser_options,
            )


class ExportsOnly(griffe.Extension):
    def on_module_members(self, *, mod: griffe.Module, **kwargs: Any) -> None:
        exports = mod.exports
        if exports is None:
            return
        for name, member in list(mod.members.items()):
            if member.is_alias and name not in exports:
                del mod.members[name]


def _examples(text: str) -> str:
    return re.sub(r"^(\s*)Example:\s*$", r"\1Examples:", text, flags=re.M)


class DoctestExamples(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _examples(obj.docstring.value)
