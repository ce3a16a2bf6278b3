"""Functions over 80 lines and modules over 450, in the package and the benchmarks (the project's size rules).

    .venv/bin/python -m hsx_dagster_tests.support.code_size     # every one, each with its written reason if it has one

A function may run longer with a reason written in a comment that starts ``# long:`` on the lines right above
its ``def`` (or its decorators); a module (a data table, a table of declarations) with one at column 0 before
its first import. test_layout.py holds
the package to these rules, except the files other work in progress owns (`IN_PROGRESS`).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass

from hsx_dagster_tests.support.paths import REPO

ROOTS = ("hsx_dagster", "benchmarks")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450
REASON = "# long:"
# Files that work in progress restructures may be listed here while it lasts; none is now.
IN_PROGRESS: tuple[str, ...] = ()


@dataclass(frozen=True)
class Oversize:
    path: str  # relative to the repository
    name: str  # function (qualified by its class) or "" for the module itself
    lines: int
    reason: str | None

    def __str__(self) -> str:
        what = f"{self.path}:{self.name}" if self.name else self.path
        return f"{what} {self.lines} lines" + (f" ({self.reason})" if self.reason else "")


def _reason(lines: list[str], first: int) -> str | None:
    """The ``# long:`` comment on the lines right above line ``first`` (1-based), if any."""
    k = first - 2
    while k >= 0 and lines[k].strip().startswith("#"):
        if lines[k].strip().startswith(REASON):
            return lines[k].strip()[len(REASON) :].strip()
        k -= 1
    return None


def _module_reason(lines: list[str]) -> str | None:
    """The ``# long:`` comment at column 0 before the module's first import, if any."""
    for line in lines:
        if line.startswith(("import ", "from ")):
            return None
        if line.startswith(REASON):
            return line[len(REASON) :].strip()
    return None


def oversized(roots: tuple[str, ...] = ROOTS) -> list[Oversize]:
    found = []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            lines = text.split("\n")
            relative = str(path.relative_to(REPO))
            if len(lines) - 1 > MAX_MODULE_LINES:
                found.append(Oversize(relative, "", len(lines) - 1, _module_reason(lines)))
            tree = ast.parse(text)
            for node, owner in _functions(tree):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                size = node.end_lineno - first + 1  # type: ignore[operator]
                if size > MAX_FUNCTION_LINES:
                    name = f"{owner}.{node.name}" if owner else node.name
                    found.append(Oversize(relative, name, size, _reason(lines, first)))
    return found


def _functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, ""
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield item, node.name


def in_progress(path: str) -> bool:
    return any(path == owned or (owned.endswith("/") and path.startswith(owned)) for owned in IN_PROGRESS)


if __name__ == "__main__":
    for item in oversized():
        print(item, "[work in progress elsewhere]" if in_progress(item.path) else "")
    sys.exit(0)
