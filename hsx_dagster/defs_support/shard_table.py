"""The per-shard table of `hidden_states` as the Dagster layer shows it: the core's rows from the output
files (`core/dataset/shard_overview.py`) with what only the instance knows added: which shard is
running or being retried, which blocking checks failed on its latest materialization, and how many
retries of the budget `retry_failed_shards` has used on it.
"""

from __future__ import annotations

from dagster import DagsterInstance

from hsx_dagster.core.dataset import ShardRow, shard_rows
from hsx_dagster.core.settings import Settings
from hsx_dagster.defs.sensors.retries import RETRY_TAG, active_shard_runs, failed_shard_checks, retries_used
from hsx_dagster.defs_support.asset_keys import HIDDEN_STATES
from hsx_dagster.defs_support.dagster_internals import partitions_in_running_backfills


def shard_table(instance: DagsterInstance, settings: Settings, exclude_run_id: str | None = None) -> list[ShardRow]:
    """Every shard's row; ``exclude_run_id``: the calling run, which is not "running" in its own table."""
    shards = settings.shard_keys
    rows = shard_rows(settings.hidden_states_dir, shards, settings.tokenized_dir)
    failed = failed_shard_checks(instance, shards)
    budget = settings.operations.max_retries
    retry_backfills = partitions_in_running_backfills(instance, HIDDEN_STATES, tag=RETRY_TAG)
    out = []
    for row in rows:
        active = [run for run in active_shard_runs(instance, row.shard, limit=5) if run.run_id != exclude_run_id]
        state = None
        if any(RETRY_TAG in run.tags for run in active) or (row.shard in retry_backfills and not active):
            state = "retrying"  # its retry run, or the retry backfill that has not started it yet
        elif active:
            state = "running"
        elif row.shard in failed:
            state = "failed check"
        out.append(
            row.with_instance_facts(state, failed.get(row.shard, []), f"{retries_used(instance, row.shard)}/{budget}")
        )
    return out
