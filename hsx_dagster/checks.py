"""The Dagster layer's translations: the core's `CheckOutcome` into an `AssetCheckResult`, Arrow
schemas into `TableSchema`s, and byte counts into metadata people read."""

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
from hsx_dagster.core.extraction.size_estimate import format_bytes


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
        metadata={key: metadata_value(value) for key, value in outcome.metadata.items()},
    )


def metadata_value(value: Any) -> Any:
    """A list of rows with the same columns becomes a table; other lists and dicts JSON; scalars stay."""
    if isinstance(value, list) and value and all(isinstance(row, dict) for row in value):
        columns = list(value[0])
        if all(list(row) == columns for row in value):
            return table_value(value)
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


def sized(key: str, count: int) -> dict[str, Any]:
    """A byte count as a number (to plot and compare) and beside it the same size for people."""
    return {key: count, f"{key}_readable": format_bytes(count)}
