"""The reference table of docs/configuration.md, generated from the settings' own declarations.

    python -m hsx_dagster.core.settings.reference docs/configuration.md   # rewrite the table in place

Every key of `Settings`, section by section, with its default and its description as declared in
`hsx_dagster.core.settings`: the table cannot drift from the code
(hsx_dagster_tests/unit/settings/test_settings.py fails when the file's table is not the generated one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from hsx_dagster.core.settings.schema import Settings

COMMAND = "python -m hsx_dagster.core.settings.reference docs/configuration.md"
START = f"<!-- the settings table, generated from hsx_dagster/core/settings/schema.py by `{COMMAND}` -->"
END = "<!-- end of the generated settings table -->"


def rows(model: type[BaseModel] = Settings, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, meaning) for every key, a section's keys in place of the section."""
    found = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += rows(annotation, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        found.append((f"{prefix}{name}", _shown(default), (field.description or "").rstrip(".")))
    return found


def table() -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {meaning} |" for key, default, meaning in rows()]
    return "\n".join(lines)


def with_table(text: str) -> str:
    """``text`` (a Markdown page holding the two markers) with the generated table between them."""
    if START not in text or END not in text:
        raise ValueError(f"the page has no settings table markers ({START} ... {END})")
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table()}\n{END}{after}"


def _shown(value: Any) -> str:
    if value is PydanticUndefined:
        return "(required)"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"{value:g}"
    if isinstance(value, list):
        return f"`[{', '.join(map(str, value))}]`"
    if isinstance(value, dict):
        return f"`{value}`"
    return f"`{value}`"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, help="the Markdown page holding the table's markers")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    updated = with_table(text)
    if updated != text:
        args.page.write_text(updated, encoding="utf-8")
        print(f"{args.page}: settings table regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
