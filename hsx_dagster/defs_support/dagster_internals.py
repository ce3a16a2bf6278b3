"""Every use of Dagster's private API, in one place: the seam an upgrade of Dagster is checked at.

Private here means a ``dagster._...`` import, an underscored name, or the instance's
``event_log_storage``: none is part of Dagster's documented API, and any release may change them.
The rest of the pipeline uses Dagster's public API only, and these functions where none serves:

- launching a run of a job *in its code location*, straight through the instance's run launcher
  (`hsx_dagster.launch`). Dagster's public ways either run the job in the calling process without
  its code location (`execute_job`: the job's page and the partition's runs then never list it),
  need a webserver (the GraphQL client) or queue the run for the daemon (`dagster job launch`,
  `instance.submit_run` with the default queued coordinator);
- the concurrency pool's limit row (`hsx_dagster.defs_support.pools`): Dagster creates it lazily, which races on
  PostgreSQL (dagster-io/dagster#33552), and only its storage can create it ahead of time;
- the check evaluations per partition and the latest materialization per partition that the retry
  sensor and the automation condition read;
- a backfill requested by a sensor (`RunRequest.for_asset_graph_subset` takes an `AssetGraphSubset`,
  which Dagster keeps private), and the partitions of the backfills still running;
- the tag that carries an observation's data version (the input sensor records observations without a run).

The private calls only tests make (the stale status the UI shows, pool rows set and deleted, a sensor's backfill
submitted by hand) are in hsx_dagster_tests/support/dagster_internals.py, checked on the same releases.

`CHECKED_ON` lists the Dagster releases these were checked on; hsx_dagster_tests/test_seams.py fails
naming this module when another release is installed, so an upgrade is a conscious act: re-read the
uses below against the new release (and its changelog), then add its version.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dagster import (
    AssetCheckKey,
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    PartitionsDefinition,
    RunRequest,
)
from dagster._cli.job import _create_run
from dagster._cli.workspace.cli_target import (
    WorkspaceOpts,
    get_code_location_from_workspace,
    get_remote_job_from_remote_repo,
    get_remote_repository_from_code_location,
    get_workspace_from_cli_opts,
)
from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
from dagster._core.definitions.data_version import DATA_VERSION_TAG, StaleStatus
from dagster._core.execution.backfill import BulkActionStatus
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._core.storage.event_log.base import PartitionKeyFilter, PoolLimit
from dagster.version import __version__ as DAGSTER_VERSION

CHECKED_ON = ("1.13.27",)

__all__ = [
    "CHECKED_ON",
    "DAGSTER_VERSION",
    "DATA_VERSION_TAG",
    "CodeLocationJob",
    "PoolLimit",
    "StaleStatus",
    "backfill_request",
    "code_location_job",
    "failed_check_target_ids",
    "failed_current_checks",
    "initialize_pool_limit",
    "latest_materialization_ids",
    "partitions_in_running_backfills",
    "pool_limit",
    "pool_limits",
    "supports_pool_limits",
]


# --- runs launched in their code location ---------------------------------------------------


@dataclass
class CodeLocationJob:
    """A job of a code location loaded from a module, as the UI sees it; launches runs of it."""

    instance: DagsterInstance
    workspace: Any
    location: Any
    repository: Any
    job: Any

    def launch(self, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        """Create a run of the job in its code location and hand it to the instance's run launcher (the
        subprocess a launch from the UI gets, without the queue, which needs the daemon); its run id."""
        run = _create_run(
            instance=self.instance,
            code_location=self.location,
            remote_repo=self.repository,
            remote_job=self.job,
            run_config=run_config,
            tags=tags,
            op_selection=None,
            run_id=None,
        )
        self.instance.launch_run(run.run_id, self.workspace)
        return run.run_id


@contextmanager
def code_location_job(instance: DagsterInstance, module: str, job_name: str) -> Iterator[CodeLocationJob]:
    """The job ``job_name`` of the code location ``module`` (e.g. ``hsx_dagster.definitions``), loaded as
    `dagster job launch -m module` loads it, for as long as the block runs."""
    with get_workspace_from_cli_opts(
        instance, version=DAGSTER_VERSION, workspace_opts=WorkspaceOpts(module_name=(module,))
    ) as workspace:
        location = get_code_location_from_workspace(workspace, None)
        repository = get_remote_repository_from_code_location(location, None)
        job = get_remote_job_from_remote_repo(repository, job_name)
        yield CodeLocationJob(instance, workspace, location, repository, job)


# --- the concurrency pool's limit row -------------------------------------------------------


def supports_pool_limits(instance: DagsterInstance) -> bool:
    return bool(instance.event_log_storage.supports_global_concurrency_limits)


def pool_limits(instance: DagsterInstance) -> list[PoolLimit]:
    """Every pool's limit row (name, limit, from_default), as `dagster instance concurrency info` lists them."""
    return list(instance.event_log_storage.get_pool_limits())


def pool_limit(instance: DagsterInstance, pool: str) -> PoolLimit | None:
    return next((limit for limit in pool_limits(instance) if limit.name == pool), None)


def initialize_pool_limit(instance: DagsterInstance, pool: str) -> None:
    """Create ``pool``'s row with the instance's default limit (what Dagster does when a step first claims it)."""
    instance.event_log_storage.initialize_concurrency_limit_to_default(pool)


# --- what the retry sensor and the automation condition read -------------------------------


def failed_current_checks(
    instance: DagsterInstance, keys: Sequence[AssetCheckKey], partitions: Sequence[str]
) -> list[tuple[str, str]]:
    """(partition, check name) for every check of ``keys`` whose latest evaluation failed on the partition's
    latest materialization."""
    return [
        (info.partition_key, info.check_key.name)
        for info in instance.event_log_storage.get_asset_check_partition_info(keys, partition_keys=list(partitions))
        if info.partition_key is not None
        and info.latest_execution_status == AssetCheckExecutionRecordStatus.FAILED
        and info.is_current
    ]


def failed_check_target_ids(instance: DagsterInstance, key: AssetCheckKey, partition: str, limit: int) -> set[int]:
    """Storage ids of the materializations of ``partition`` that check ``key`` failed on (its latest ``limit``
    failed evaluations)."""
    targets = set()
    for record in instance.event_log_storage.get_asset_check_execution_history(
        key,
        limit=limit,
        status={AssetCheckExecutionRecordStatus.FAILED},
        partition_filter=PartitionKeyFilter(key=partition),
    ):
        evaluation = record.evaluation
        if evaluation is not None and evaluation.target_materialization_data is not None:
            targets.add(evaluation.target_materialization_data.storage_id)
    return targets


def latest_materialization_ids(
    instance: DagsterInstance, key: AssetKey, partitions: Sequence[str]
) -> Mapping[str, int]:
    """Partition -> storage id of its latest materialization (partitions never materialized are absent)."""
    return instance.event_log_storage.get_latest_storage_id_by_partition(
        key, DagsterEventType.ASSET_MATERIALIZATION, set(partitions)
    )


# --- what the UI shows ----------------------------------------------------------------------


def backfill_request(
    key: AssetKey, partitions_def: PartitionsDefinition, partition_keys: Sequence[str], tags: Mapping[str, str]
) -> RunRequest:
    """A sensor's request that the sensor daemon submits as one backfill of these partitions of ``key`` (one run
    per partition when the asset has no backfill policy), each run with ``tags``."""
    partitions = partitions_def.empty_subset().with_partition_keys(partition_keys)
    subset = AssetGraphSubset.create_empty_subset()._replace(partitions_subsets_by_asset_key={key: partitions})
    return RunRequest.for_asset_graph_subset(subset, tags=tags)


def partitions_in_running_backfills(instance: DagsterInstance, key: AssetKey, tag: str | None = None) -> set[str]:
    """The partitions of ``key`` that a backfill still in progress targets (its runs may not have started yet);
    ``tag``: only backfills with that tag."""
    partitions: set[str] = set()
    for backfill in instance.get_backfills(status=BulkActionStatus.REQUESTED):
        if tag is not None and tag not in backfill.tags:
            continue
        data = backfill.asset_backfill_data if backfill.is_asset_backfill else None
        if data is not None and key in data.target_subset.partitions_subsets_by_asset_key:
            partitions |= set(data.target_subset.get_partitions_subset(key).get_partition_keys())
    return partitions
