"""Functions over 80 lines and modules over 450, in the package and the benchmarks (the project's size rules).

    .venv/bin/python -m hsx_dagster_tests.code_size     # every one, each with its written reason if it has one

A function may run longer with a reason written in a comment that starts ``# long:`` on the lines right above
its ``def`` (or its decorators); data tables are modules of constants and are not counted. test_layout.py holds
the package to these rules, except the files other work in progress owns (`IN_PROGRESS`).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("hsx_dagster", "benchmarks")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450
REASON = "# long:"
# Files other work in progress restructures now (#24 living dataset, #25 operator's view, #22 export): their
# owners bring them within the rules; the list printed by this module shows what is left after the merges.
IN_PROGRESS = (
    "hsx_dagster/core/extraction/shard_run.py",
    "hsx_dagster/core/storage/shard_store.py",
    "hsx_dagster/core/storage/chunk_writer.py",
    "hsx_dagster/core/storage/shard_checks.py",
    "hsx_dagster/core/dataset/checks.py",
    "hsx_dagster/core/dataset/assembly.py",
    "hsx_dagster/core/dataset/reader.py",
    "hsx_dagster/core/inputs/tokenization.py",
    "hsx_dagster/assets/hidden_states.py",
    "hsx_dagster/assets/shard_checks.py",
    "hsx_dagster/checks.py",
    "hsx_dagster/report.py",
    "hsx_dagster/schedules.py",
    "hsx_dagster/automation.py",
    "hsx_dagster/launch.py",
    "hsx_dagster/core/export/",
)


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


def oversized(roots: tuple[str, ...] = ROOTS) -> list[Oversize]:
    found = []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            lines = text.split("\n")
            relative = str(path.relative_to(REPO))
            if len(lines) - 1 > MAX_MODULE_LINES:
                found.append(Oversize(relative, "", len(lines) - 1, None))
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
