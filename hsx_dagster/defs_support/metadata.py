"""The Dagster layer's translations: the core's `CheckOutcome` into an `AssetCheckResult`, Arrow
schemas into `TableSchema`s, and figures into metadata people read (units from `core/units.py`).

A check's metadata is shown so its result is visible at a glance: its counts together in one small
table (not one flat-line plot each), sizes with their unit, per-layer errors as a table beside the
tolerance with the worst error as the one number plotted, and no empty entries."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetKey,
    MetadataValue,
    TableColumn,
    TableRecord,
    TableSchema,
)

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.units import format_bytes, format_count


def check_result(
    outcome: CheckOutcome, check_name: str | None = None, asset_key: AssetKey | None = None
) -> AssetCheckResult:
    """``check_name`` and ``asset_key`` name the check when one step evaluates several."""
    return AssetCheckResult(
        check_name=check_name,
        asset_key=asset_key,
        passed=outcome.passed,
        severity=AssetCheckSeverity.ERROR,
        description=outcome.description,
        metadata=check_metadata(outcome.metadata),
    )


def check_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """A check outcome's metadata as people read it (see the module docstring); the core's figures unchanged."""
    entries = dict(metadata)
    shown: dict[str, Any] = {}
    errors, tolerance = entries.pop("max_relative_error", None), entries.pop("tolerance", None)
    if isinstance(errors, dict) and errors:
        shown |= parity_entries(errors, tolerance)
    elif tolerance is not None:
        shown["tolerance"] = f"{tolerance:g}"
    counts = {key: value for key, value in entries.items() if _is_count(key, value)}
    if counts:
        shown["counts"] = table_value(
            [{"what": k.replace("_", " "), "count": format_count(v)} for k, v in counts.items()]
        )
    for key, value in entries.items():
        if key in counts or value in ([], {}, None, ""):
            continue
        if "bytes" in key and isinstance(value, int):
            shown[key.replace("bytes", "size")] = format_bytes(value)
        else:
            shown[key] = metadata_value(value)
    return shown


def parity_entries(errors: dict[str, float], tolerance: float | None) -> dict[str, Any]:
    """Per layer: the largest relative error of the re-extracted samples against the tolerance."""
    rows = [
        {
            "layer": layer,
            "max relative error": f"{error:.2e}",
            "tolerance": f"{tolerance:g}" if tolerance is not None else "",
            "within": "yes" if tolerance is None or error <= tolerance else "NO",
        }
        for layer, error in errors.items()
    ]
    return {"worst relative error": max(errors.values()), "relative error per layer": table_value(rows)}


def _is_count(key: str, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and "bytes" not in key


def metadata_value(value: Any) -> Any:
    """A list of rows with the same columns becomes a table, a dict of scalars a two-column table; other lists
    and dicts JSON; scalars stay."""
    if isinstance(value, list) and value and all(isinstance(row, dict) for row in value):
        columns = list(value[0])
        if all(list(row) == columns for row in value):
            return table_value(value)
    if isinstance(value, dict) and value and all(not isinstance(v, (dict, list)) for v in value.values()):
        return table_value([{"key": str(k), "value": str(v)} for k, v in value.items()])
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return MetadataValue.md("\n".join(f"- {v}" for v in value))
    if isinstance(value, (dict, list)):
        return MetadataValue.json(value)
    return value


def table_value(rows: list[dict[str, Any]]) -> MetadataValue:
    columns = [TableColumn(name, _column_type(rows[0][name])) for name in rows[0]]
    return MetadataValue.table([TableRecord(row) for row in rows], schema=TableSchema(columns=columns))


def _column_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "string"


def arrow_column_schema(schema: pa.Schema, descriptions: dict[str, str] | None = None) -> MetadataValue:
    """The column schema (e.g. `dagster/column_schema`) of a Parquet file written with ``schema``, one of the
    schemas in core/storage/format.py, so the UI shows the columns exactly as written."""
    descriptions = descriptions or {}
    columns = [TableColumn(field.name, str(field.type), description=descriptions.get(field.name)) for field in schema]
    return MetadataValue.table_schema(TableSchema(columns=columns))
