"""Declarative automation: `drafter_dataset` follows by itself once every shard is in.

Its condition, evaluated by the sensor `hsx_automation` while the daemon runs (`make ui`,
`dagster dev`, or `dagster-daemon` beside the webserver):

- a `hidden_states` shard was materialized since `drafter_dataset` was last requested or updated;
- every shard is materialized, each one more recently than `drafter_dataset` (`ShardsNewerThanTarget`);
- no shard's blocking check failed on its latest materialization;
- no shard and no `drafter_dataset` run is in progress.

So re-extracting every shard (after new inputs, another model, other layers) rebuilds the dataset
once, after the last shard, never from a mix of old and new shards.

The sensor `observe_inputs_on_change` looks at the inputs (`conversations`, `target_model`) every
few minutes and records an observation, without a run, only when an input's version changed, so
an edited input shows as stale and the Runs list holds only the runs that make something.

`ShardsNewerThanTarget` is plain Python (the instance's event log, compared by storage id), so the
sensor evaluates it in the code server (`use_user_code_server=True`).
"""

from __future__ import annotations

from dagster import (
    AssetKey,
    AssetObservation,
    AssetRecordsFilter,
    AssetSelection,
    AutomationCondition,
    AutomationConditionSensorDefinition,
    AutomationContext,
    AutomationResult,
    DefaultSensorStatus,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from hsx_dagster.defs.assets.inputs import conversations_observation, model_observation
from hsx_dagster.defs.resources import HsxSettings
from hsx_dagster.defs_support.asset_keys import CONVERSATIONS, DRAFTER_DATASET, INPUTS, TARGET_MODEL
from hsx_dagster.defs_support.dagster_internals import DATA_VERSION_TAG, latest_materialization_ids

OBSERVE_EVERY_S = 300  # how often the input sensor looks; unchanged files are not re-read (core/fingerprints.py)


class ShardsNewerThanTarget(AutomationCondition):
    """True when every partition of every materializable dependency is materialized after the target's latest
    materialization (or the target was never materialized)."""

    @property
    def description(self) -> str:
        return "every upstream partition materialized, each after this asset's latest materialization"

    @property
    def name(self) -> str:
        return "every shard newer than this asset"

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
    ).with_label("all shards in and passing")  # short: the UI cuts a long label


def build_automation_sensor(run_tags: dict[str, str] | None = None) -> AutomationConditionSensorDefinition:
    """``run_tags``: on the runs it requests (on Ray: one GPU for drafter_dataset's parity check)."""
    return AutomationConditionSensorDefinition(
        "hsx_automation",
        run_tags=run_tags or None,
        target=AssetSelection.assets(DRAFTER_DATASET),
        default_status=DefaultSensorStatus.RUNNING,
        use_user_code_server=True,  # ShardsNewerThanTarget is Python: evaluated where the code is
        minimum_interval_seconds=30,
        description="Requests drafter_dataset once every shard is newer than it, none failing or running.",
    )


def build_input_sensor():
    @sensor(
        name="observe_inputs_on_change",
        minimum_interval_seconds=OBSERVE_EVERY_S,
        default_status=DefaultSensorStatus.RUNNING,
        description="Records an observation of conversations or target_model, without a run, when its content "
        "version changed; otherwise skips, naming the versions it saw.",
    )
    def observe_inputs_on_change(context: SensorEvaluationContext, settings: HsxSettings):
        loaded = settings.load()
        events, unchanged = [], []
        for key, observe in ((CONVERSATIONS, conversations_observation), (TARGET_MODEL, model_observation)):
            version, metadata = observe(loaded)
            if last_observed_version(context.instance, key) == version:
                unchanged.append(f"{key.to_user_string()} {version[:12]}")
                continue
            events.append(AssetObservation(key, metadata=metadata, tags={DATA_VERSION_TAG: version}))
        if not events:
            return SkipReason("inputs unchanged: " + ", ".join(unchanged))
        return SensorResult(asset_events=events)

    return observe_inputs_on_change


def last_observed_version(instance, key: AssetKey) -> str | None:
    records = instance.fetch_observations(key, limit=1).records
    return records[0].asset_observation.data_version if records else None
