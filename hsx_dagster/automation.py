"""Declarative automation: `drafter_dataset` follows by itself once every shard is in.

Its condition, evaluated by the sensor `hsx_automation` while the daemon runs (`make ui`,
`dagster dev`, or `dagster-daemon` beside the webserver):

- a `hidden_states` shard was materialized since `drafter_dataset` was last requested or updated;
- every shard is materialized, each one more recently than `drafter_dataset` (`ShardsNewerThanTarget`);
- no shard's blocking check failed on its latest materialization;
- no shard and no `drafter_dataset` run is in progress.

So re-extracting every shard (after new inputs, another model, other layers) rebuilds the dataset
once, after the last shard, never from a mix of old and new shards. The same sensor observes the
inputs (`conversations`, `target_model`) on their cron, so an edited input shows as stale.

`ShardsNewerThanTarget` is plain Python (the instance's event log, compared by storage id), so the
sensor evaluates it in the code server (`use_user_code_server=True`).
"""

from __future__ import annotations

from dagster import (
    AssetKey,
    AssetRecordsFilter,
    AssetSelection,
    AutomationCondition,
    AutomationConditionSensorDefinition,
    AutomationContext,
    AutomationResult,
    DefaultSensorStatus,
)

from hsx_dagster.asset_keys import DRAFTER_DATASET, INPUTS
from hsx_dagster.dagster_internals import latest_materialization_ids


class ShardsNewerThanTarget(AutomationCondition):
    """True when every partition of every materializable dependency is materialized after the target's latest
    materialization (or the target was never materialized)."""

    @property
    def description(self) -> str:
        return "every upstream partition materialized, each after this asset's latest materialization"

    @property
    def name(self) -> str:
        return "shards_newer_than_target"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        instance = context.asset_graph_view.instance
        target = context.key
        assert isinstance(target, AssetKey)
        latest = instance.fetch_materializations(AssetRecordsFilter(asset_key=target), limit=1).records
        since = latest[0].storage_id if latest else -1
        ready = True
        for parent in context.asset_graph.get(target).parent_keys:
            if context.asset_graph.get(parent).is_external:  # observed inputs: not materialized, not waited for
                continue
            partitions_def = context.asset_graph.get(parent).partitions_def
            if partitions_def is None:
                records = instance.fetch_materializations(AssetRecordsFilter(asset_key=parent), limit=1).records
                ready &= bool(records) and records[0].storage_id > since
                continue
            keys = partitions_def.get_partition_keys(dynamic_partitions_store=instance)
            by_partition = latest_materialization_ids(instance, parent, keys)
            ready &= all(by_partition.get(key, -1) > since for key in keys)
        true_subset = context.candidate_subset if ready else context.get_empty_subset()
        return AutomationResult(context=context, true_subset=true_subset)


def shard_checks_failed() -> AutomationCondition:
    return AutomationCondition.any_deps_match(
        AutomationCondition.any_checks_match(AutomationCondition.check_failed(), blocking_only=True)
    ).with_label("a shard's blocking check failed")


def drafter_condition() -> AutomationCondition:
    return (
        AutomationCondition.any_deps_updated()
        .ignore(AssetSelection.assets(*INPUTS))
        .since_last_handled()
        .with_label("a shard updated since last handled")
        & ShardsNewerThanTarget()
        & ~shard_checks_failed()
        & ~AutomationCondition.any_deps_in_progress()
        & ~AutomationCondition.in_progress()
    ).with_label("every shard newer, none failing or running")


def build_automation_sensor() -> AutomationConditionSensorDefinition:
    return AutomationConditionSensorDefinition(
        "hsx_automation",
        target=AssetSelection.assets(DRAFTER_DATASET, *INPUTS),
        default_status=DefaultSensorStatus.RUNNING,
        use_user_code_server=True,  # ShardsNewerThanTarget is Python: evaluated where the code is
        minimum_interval_seconds=30,
        description="drafter_dataset once every shard is newer than it; input observations on their cron.",
    )
