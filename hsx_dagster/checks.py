"""The one translation of the core's `CheckOutcome` into Dagster's `AssetCheckResult`."""

from __future__ import annotations

from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue

from hsx_dagster.core.check_outcome import CheckOutcome


def check_result(outcome: CheckOutcome) -> AssetCheckResult:
    return AssetCheckResult(
        passed=outcome.passed,
        severity=AssetCheckSeverity.ERROR,
        description=outcome.description,
        metadata={
            key: MetadataValue.json(value) if isinstance(value, (dict, list)) else value
            for key, value in outcome.metadata.items()
        },
    )
