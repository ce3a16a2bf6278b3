"""`retry_failed_shards`: a sensor that re-runs the failed `hidden_states` shards as one backfill per tick,
within a retry budget per shard.

Every `operations.retry_every_s` it reads the partition status of `hidden_states` from the instance.
A shard is failed when its latest run failed, or when one of its blocking shard checks failed on
its latest materialization (a damaged chunk, a missing sample, NaN states). The failed shards that
have no run queued or in progress, no retry backfill still running and retries left are submitted
together as one backfill (Overview > Backfills): one run per shard, each with the shard's checks,
resuming from the shard's last committed chunk, so a retry never redoes finished work. Retries are
counted per shard (retry runs since the shard's last successful materialization); past
`max_retries` the sensor stops retrying that shard and says so. A materialization whose blocking
checks failed is not a success.

Why a sensor: Dagster's scheduler launches a schedule's requests as single runs; a backfill request
(`RunRequest.for_asset_graph_subset`) is carried out by the sensor daemon only.
"""

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field

from dagster import (
    AssetCheckKey,
    AssetPartitionStatus,
    AssetRecordsFilter,
    AssetSelection,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunsFilter,
    SensorEvaluationContext,
    SkipReason,
    StaticPartitionsDefinition,
    sensor,
)

from hsx_dagster.defs.checks import SHARD_CHECKS
from hsx_dagster.defs_support.asset_keys import HIDDEN_STATES
from hsx_dagster.defs_support.dagster_internals import (
    backfill_request,
    failed_check_target_ids,
    failed_current_checks,
    partitions_in_running_backfills,
)
from hsx_dagster.defs_support.pools import prepare_pool

RETRY_TAG = "hsx/retry"  # on every retry backfill, so on each of its runs
RETRY_REASONS_TAG = "hsx/retry-reasons"  # each retried shard: its attempt and why
ACTIVE = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]


@dataclass
class RetryPlan:
    """What one tick does with the failed shards."""

    retries: dict[str, str] = field(default_factory=dict)  # shard -> "retry 1 of 3 (its latest run failed)"
    busy: list[str] = field(default_factory=list)  # a run or a retry backfill of it is under way
    exhausted: list[str] = field(default_factory=list)  # no retries left

    def skip_reason(self, max_retries: int) -> str:
        reasons = []
        if self.busy:
            reasons.append(f"already queued or running: {', '.join(self.busy)}")
        if self.exhausted:
            reasons.append(f"retry budget ({max_retries}) used up: {', '.join(self.exhausted)}")
        return "; ".join(reasons)


def build_retry_sensor(
    partitions_def: StaticPartitionsDefinition, every_s: float, max_retries: int, run_tags: dict[str, str]
):
    """``run_tags``: what every shard run carries (a retry runs in a backfill, not in the job `hidden_states_shard`)."""

    @sensor(
        name="retry_failed_shards",
        minimum_interval_seconds=max(int(every_s), 30),
        asset_selection=AssetSelection.assets(HIDDEN_STATES),  # what its backfills may hold
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Re-runs the failed hidden_states shards (latest run failed, or a blocking check failed on it) "
        f"as one backfill per tick, one run per shard, at most {max_retries} times each since its last success. "
        "Each tick's log names the shards it retried, why, and the retries each has left; the hidden_states table "
        "shows retries used.",
    )
    def retry_failed_shards(context: SensorEvaluationContext):
        instance = context.instance
        shards = partitions_def.get_partition_keys()
        statuses = instance.get_status_by_partition(HIDDEN_STATES, shards, partitions_def) or {}
        check_failed = failed_shard_checks(instance, shards)
        failed = [
            shard for shard in shards if statuses.get(shard) == AssetPartitionStatus.FAILED or shard in check_failed
        ]
        if not failed:
            return SkipReason("no failed hidden_states shard")
        plan = plan_retries(instance, failed, check_failed, max_retries)
        if plan.exhausted:
            context.log.warning(
                f"retry budget of {max_retries} used up for {', '.join(plan.exhausted)}: not retrying; "
                "look at their last run's error, fix it, and launch them by hand"
            )
        if not plan.retries:
            return SkipReason(plan.skip_reason(max_retries))
        for shard, retry in plan.retries.items():
            context.log.info(f"{shard}: {retry}")
        prepare_pool(
            instance, context.log
        )  # the retried shards may start together (see hsx_dagster/defs_support/pools.py)
        reasons = "; ".join(f"{shard}: {retry}" for shard, retry in plan.retries.items())
        tags = {**run_tags, RETRY_TAG: "true", RETRY_REASONS_TAG: reasons}
        return backfill_request(HIDDEN_STATES, partitions_def, list(plan.retries), tags)

    return retry_failed_shards


def plan_retries(instance, failed: Sequence[str], check_failed: dict[str, list[str]], max_retries: int) -> RetryPlan:
    """Which failed shards this tick retries, which are busy, which have no retries left."""
    plan = RetryPlan()
    in_backfills = partitions_in_running_backfills(instance, HIDDEN_STATES)
    for shard in failed:
        if shard in in_backfills or active_shard_runs(instance, shard, limit=1):
            plan.busy.append(shard)
            continue
        attempts = retries_used(instance, shard)
        if attempts >= max_retries:
            plan.exhausted.append(shard)
            continue
        why = f"check {', '.join(check_failed[shard])} failed" if shard in check_failed else "its latest run failed"
        left = max_retries - attempts - 1
        plan.retries[shard] = f"retry {attempts + 1} of {max_retries} ({why}); {left} left after it"
    return plan


def active_shard_runs(instance, shard: str, limit: int) -> list:
    """Runs of ``shard`` queued, starting or in progress (at most ``limit``)."""
    return list(instance.get_runs(RunsFilter(tags={"dagster/partition": shard}, statuses=ACTIVE), limit=limit))


def failed_shard_checks(instance, shards: Sequence[str]) -> dict[str, list[str]]:
    """Shard -> its blocking checks whose latest evaluation failed on the shard's latest materialization."""
    keys = [AssetCheckKey(HIDDEN_STATES, name) for name in SHARD_CHECKS]
    failed: dict[str, list[str]] = {}
    for shard, name in failed_current_checks(instance, keys, shards):
        failed.setdefault(shard, []).append(name)
    return {shard: sorted(names) for shard, names in failed.items()}


def retries_used(instance, shard: str) -> int:
    """Retry runs of ``shard`` since its last success."""
    since = _last_success(instance, shard)
    retry_runs = RunsFilter(tags={RETRY_TAG: "true", "dagster/partition": shard}, created_after=since)
    return instance.get_runs_count(retry_runs)


def _last_success(instance, shard: str, lookback: int = 100) -> datetime.datetime | None:
    """When the shard was last materialized with no blocking check failing on it (None if never)."""
    check_failed_targets = set()
    for name in SHARD_CHECKS:
        check_failed_targets |= failed_check_target_ids(instance, AssetCheckKey(HIDDEN_STATES, name), shard, lookback)
    result = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=HIDDEN_STATES, asset_partitions=[shard]), limit=lookback
    )
    for record in result.records:
        if record.storage_id not in check_failed_targets:
            return datetime.datetime.fromtimestamp(record.timestamp, tz=datetime.timezone.utc)
    return None
