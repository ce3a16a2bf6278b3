"""Markdown tables for the benchmark reports."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path


def cell(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence], digits: int | Sequence[int] = 2) -> str:
    """Text columns left-aligned, numbers right-aligned; ``digits`` after the point, one for all
    columns or one per column."""
    places = [digits] * len(headers) if isinstance(digits, int) else list(digits)
    numeric = [all(isinstance(row[k], (int, float)) or row[k] is None for row in rows) for k in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cell(value, places[k]) for k, value in enumerate(row)) + " |" for row in rows]
    return "\n".join(lines)


def write_results(stem: Path, results: dict, markdown: str) -> None:
    """``<stem>.json`` and ``<stem>.md``; the Markdown is printed too (the CPU benchmark's test reads it there)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    stem.with_suffix(".md").write_text(markdown, encoding="utf-8")
    print(markdown)
    print(f"written: {stem}.json, {stem}.md", file=sys.stderr)
