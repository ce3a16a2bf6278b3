"""How a core subpackage declares its public API: ``__all__`` plus a lazy ``__getattr__``.

Each subpackage's ``__init__`` names what the rest of the pipeline may import from it (module by module, so a
reader sees where each name lives) and loads a module only when one of its names is first used: importing
``hsx_dagster.core.storage.format`` must not pull in torch, and ``from hsx_dagster import DrafterDataset`` must
load the reader alone. The same names are imported under ``TYPE_CHECKING`` for mypy; the layering test checks that
both lists agree and that every name resolves.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """`__all__`, `__getattr__` and `__dir__` for `package`, whose `exports` map a submodule to the names it offers."""
    home = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home))

    return sorted(home), __getattr__, __dir__
