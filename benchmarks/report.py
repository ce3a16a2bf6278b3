"""Markdown tables for the benchmark reports."""

from __future__ import annotations

from collections.abc import Sequence


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
