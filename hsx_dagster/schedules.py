"""`retry_failed_shards`: re-run each failed `hidden_states` shard, alone, within a retry budget.

Every tick it reads the partition status of `hidden_states` from the instance and requests one run
per failed shard that has no run queued or in progress. A shard is failed when its latest run
failed, or when one of its blocking shard checks failed on its latest materialization (a damaged
chunk, a missing sample, NaN states). A re-run resumes from the shard's last
committed chunk, so a retry never redoes finished work. Retries are counted per shard (runs this
schedule launched since the shard's last successful materialization); past `max_retries` the
schedule stops retrying that shard and says so. A materialization whose blocking checks failed
is not a success.

Dagster 1.13's scheduler launches a schedule's run requests as runs: a backfill request
(`RunRequest.for_asset_graph_subset`) is carried out by the sensor daemon only, so each retry is a
run of `hidden_states_shard` tagged with its attempt and reason, and each tick's log says which
shards it retried, why, and how many retries each has left.

`observe_inputs` observes the inputs (`conversations`, `target_model`) so their versions are known
before anything is made from them; `make demo` runs it first.
"""

import datetime
import json
from collections.abc import Sequence
from pathlib import Path

import yaml
from dagster import (
    AssetCheckKey,
    AssetPartitionStatus,
    AssetRecordsFilter,
    AssetSelection,
    DagsterRunStatus,
    DefaultScheduleStatus,
    RunRequest,
    RunsFilter,
    ScheduleEvaluationContext,
    SkipReason,
    StaticPartitionsDefinition,
    define_asset_job,
    schedule,
)

from hsx_dagster.asset_keys import HIDDEN_STATES, INPUTS
from hsx_dagster.assets.shard_checks import SHARD_CHECKS
from hsx_dagster.dagster_internals import failed_check_target_ids, failed_current_checks
from hsx_dagster.pools import prepare_pool

RETRY_SHARD_TAG = "hsx/retry-of-shard"
RETRY_ATTEMPT_TAG = "hsx/retry-attempt"
RETRY_REASON_TAG = "hsx/retry-reason"
ACTIVE = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]


def build_shard_job(partitions_def: StaticPartitionsDefinition, k8s_run_config: Path | None = None):
    """The job that runs one shard; on Kubernetes its `dagster-k8s/config` tag gives each run one GPU."""
    tags = {}
    if k8s_run_config is not None:
        tags["dagster-k8s/config"] = json.dumps(yaml.safe_load(k8s_run_config.read_text(encoding="utf-8")))
    return define_asset_job(
        "hidden_states_shard",
        selection=AssetSelection.assets(HIDDEN_STATES),
        partitions_def=partitions_def,
        tags=tags,
        description="One hidden_states shard per run (one run per GPU).",
    )


def build_observe_job():
    """Observes the inputs; run before tokenizing so every output records the input versions it was made from."""
    return define_asset_job(
        "observe_inputs",
        selection=AssetSelection.assets(*INPUTS),
        description="Observe the conversation files and the model directory (content hashes).",
    )


def build_retry_schedule(shard_job, partitions_def: StaticPartitionsDefinition, cron: str, max_retries: int):
    @schedule(
        name="retry_failed_shards",
        cron_schedule=cron,
        job=shard_job,
        default_status=DefaultScheduleStatus.RUNNING,
        description=f"Re-runs each failed hidden_states shard (latest run failed, or a blocking check failed on it), "
        f"one run per shard, at most {max_retries} times since its last success. Each tick's log names the shards "
        "it retried, why, and the retries each has left; the hidden_states table shows retries used.",
    )
    def retry_failed_shards(context: ScheduleEvaluationContext):
        instance = context.instance
        shards = partitions_def.get_partition_keys()
        statuses = instance.get_status_by_partition(HIDDEN_STATES, shards, partitions_def) or {}
        check_failed = failed_shard_checks(instance, shards)
        failed = [
            shard for shard in shards if statuses.get(shard) == AssetPartitionStatus.FAILED or shard in check_failed
        ]
        if not failed:
            return SkipReason("no failed hidden_states shard")
        requests, busy, exhausted = plan_retries(instance, context.log, failed, check_failed, max_retries)
        if exhausted:
            context.log.warning(
                f"retry budget of {max_retries} used up for {', '.join(exhausted)}: not retrying; "
                "look at their last run's error, fix it, and launch them by hand"
            )
        if requests:
            prepare_pool(instance, context.log)  # the retried shards may start together (see hsx_dagster/pools.py)
            return requests
        reasons = []
        if busy:
            reasons.append(f"already queued or running: {', '.join(busy)}")
        if exhausted:
            reasons.append(f"retry budget ({max_retries}) used up: {', '.join(exhausted)}")
        return SkipReason("; ".join(reasons))

    return retry_failed_shards


def plan_retries(
    instance, log, failed: Sequence[str], check_failed: dict[str, list[str]], max_retries: int
) -> tuple[list[RunRequest], list[str], list[str]]:
    """One run request per failed shard that is not running and has retries left; (requests, busy, exhausted).
    Each retry is logged on the tick with why and how many retries the shard has left."""
    requests, busy, exhausted = [], [], []
    for shard in failed:
        if instance.get_runs_count(RunsFilter(tags={"dagster/partition": shard}, statuses=ACTIVE)):
            busy.append(shard)
            continue
        since = _last_success(instance, shard)
        attempts = _retries_since(instance, shard, since)
        if attempts >= max_retries:
            exhausted.append(shard)
            continue
        attempt = attempts + 1
        why = f"check {', '.join(check_failed[shard])} failed" if shard in check_failed else "its latest run failed"
        log.info(f"{shard}: retry {attempt} of {max_retries} ({why}); {max_retries - attempt} left after it")
        requests.append(
            RunRequest(
                partition_key=shard,
                # Unique per attempt and per success epoch, so a tick never launches a duplicate.
                run_key=f"retry-{shard}-{int(since.timestamp()) if since else 0}-{attempt}",
                tags={RETRY_SHARD_TAG: shard, RETRY_ATTEMPT_TAG: str(attempt), RETRY_REASON_TAG: why},
            )
        )
    return requests, busy, exhausted


def failed_shard_checks(instance, shards: Sequence[str]) -> dict[str, list[str]]:
    """Shard -> its blocking checks whose latest evaluation failed on the shard's latest materialization."""
    keys = [AssetCheckKey(HIDDEN_STATES, name) for name in SHARD_CHECKS]
    failed: dict[str, list[str]] = {}
    for shard, name in failed_current_checks(instance, keys, shards):
        failed.setdefault(shard, []).append(name)
    return {shard: sorted(names) for shard, names in failed.items()}


def retries_used(instance, shard: str) -> int:
    """Runs this schedule launched for ``shard`` since its last success."""
    return _retries_since(instance, shard, _last_success(instance, shard))


def _retries_since(instance, shard: str, since: datetime.datetime | None) -> int:
    return instance.get_runs_count(RunsFilter(tags={RETRY_SHARD_TAG: shard}, created_after=since))


def _last_success(instance, shard: str, lookback: int = 100):
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
