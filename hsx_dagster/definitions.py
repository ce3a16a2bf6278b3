"""The Dagster code location: `hsx_dagster.definitions:defs`.

Settings are read when the definitions load (the number of shard partitions comes from them), so
a bad hsx.yaml fails here with the key named, before any run starts.
"""

from __future__ import annotations

from dagster import Definitions

from hsx_dagster.assets.drafter import drafter_checks, drafter_dataset
from hsx_dagster.assets.hidden_states import build_hidden_states
from hsx_dagster.assets.tokenized import tokenized_dataset, tokenized_dataset_consistent
from hsx_dagster.core.settings import Settings, load_settings
from hsx_dagster.partitions import shard_partitions
from hsx_dagster.resources import GpuResource, HsxSettings
from hsx_dagster.schedules import build_retry_schedule, build_shard_job


def build_definitions(settings: Settings) -> Definitions:
    partitions = shard_partitions(settings)
    shard_job = build_shard_job(partitions, settings.operations.k8s_run_config)
    retry = build_retry_schedule(shard_job, partitions, settings.operations.retry_cron, settings.operations.max_retries)
    return Definitions(
        assets=[tokenized_dataset, build_hidden_states(partitions), drafter_dataset],
        jobs=[shard_job],
        schedules=[retry],
        asset_checks=[tokenized_dataset_consistent, *drafter_checks],
        resources={
            "settings": HsxSettings(path=str(settings.source)),
            "gpu": GpuResource.from_settings(settings),
        },
    )


defs = build_definitions(load_settings())
