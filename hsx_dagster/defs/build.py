"""The pipeline's `Definitions`, built from the settings: which assets and checks (regeneration, exports), the
number of shard partitions, the run tags for Kubernetes or Ray, and each asset's code version."""

from __future__ import annotations

import warnings

from dagster import AssetsDefinition, BetaWarning, Definitions, PreviewWarning, with_source_code_references

from hsx_dagster.core.fingerprints import code_versions
from hsx_dagster.core.settings import Settings
from hsx_dagster.defs.assets.drafter import drafter_dataset
from hsx_dagster.defs.assets.exports import export_assets
from hsx_dagster.defs.assets.hidden_states import build_hidden_states
from hsx_dagster.defs.assets.inputs import build_input_assets
from hsx_dagster.defs.assets.regenerated import with_regeneration
from hsx_dagster.defs.assets.tokenized import tokenized_dataset
from hsx_dagster.defs.checks import (
    build_shard_checks,
    drafter_checks,
    regeneration_checks,
    tokenized_dataset_consistent,
)
from hsx_dagster.defs.jobs import build_observe_job, build_shard_job, ray_gpu_run_tags, shard_run_tags
from hsx_dagster.defs.partitions import shard_partitions
from hsx_dagster.defs.resources import GeneratorResource, GpuResource, HsxSettings
from hsx_dagster.defs.sensors.automation import build_automation_sensor, build_input_sensor
from hsx_dagster.defs.sensors.retries import build_retry_sensor


def build_definitions(settings: Settings) -> Definitions:
    with warnings.catch_warnings():
        # Partitioned checks, code references and the user-code automation sensor are marked beta/preview;
        # their use here is tested (test_shard_checks.py, test_automation.py, test_browser.py).
        warnings.simplefilter("ignore", BetaWarning)
        warnings.simplefilter("ignore", PreviewWarning)
        return _build_definitions(settings)


def _build_definitions(settings: Settings) -> Definitions:
    partitions = shard_partitions(settings)
    operations = settings.operations
    # the shard job's runs and the retry backfills' runs
    run_tags = shard_run_tags(operations.k8s_run_config, operations.ray_run_config)
    # drafter_dataset's run asks Ray for a GPU only while its parity check loads the model
    drafter_tags = ray_gpu_run_tags(operations.ray_run_config) if settings.drafter.parity_samples else {}
    shard_job = build_shard_job(partitions, run_tags)
    retry = build_retry_sensor(partitions, operations.retry_every_s, operations.max_retries, run_tags)
    tokenization = with_regeneration(settings, tokenized_dataset)  # regenerated_conversations with regenerate.enabled
    return Definitions(
        assets=with_source_code_references(
            [
                *build_input_assets(),
                *with_code_versions(
                    # the exports are materialized only when asked (export.speculators / export.specforge, or selected)
                    [*tokenization, build_hidden_states(partitions), drafter_dataset, *export_assets],
                    settings,
                ),
            ]
        ),
        jobs=[shard_job, build_observe_job()],
        sensors=[build_automation_sensor(drafter_tags), build_input_sensor(), retry],
        asset_checks=[
            tokenized_dataset_consistent,
            *regeneration_checks(settings),
            *build_shard_checks(partitions),
            *drafter_checks,
        ],
        resources={
            "settings": HsxSettings(path=str(settings.source)),
            "gpu": GpuResource.from_settings(settings),
            "generator": GeneratorResource.from_settings(settings),
        },
    )


def with_code_versions(assets: list[AssetsDefinition], settings: Settings) -> list[AssetsDefinition]:
    """Each asset's code version: its format version and the settings that shape it (core/fingerprints.py), so
    the UI marks what follows a change of layers, dtype or dataset options stale."""
    versions = code_versions(settings)
    return [
        asset.map_asset_specs(
            lambda spec: spec.replace_attributes(
                code_version=versions.get(spec.key.to_user_string(), spec.code_version)
            )
        )
        for asset in assets
    ]
