"""One static partition per hidden-state shard: `shard-00`, `shard-01`, ... (count from settings)."""

from __future__ import annotations

from dagster import StaticPartitionsDefinition

from hsx_dagster.core.settings import Settings


def shard_partitions(settings: Settings) -> StaticPartitionsDefinition:
    return StaticPartitionsDefinition(settings.shard_keys)
