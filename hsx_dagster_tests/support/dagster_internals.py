"""The private Dagster calls only tests make, beside the package's seam (hsx_dagster/defs_support/dagster_internals.py)
and checked on the same releases (its `CHECKED_ON`; test_seams.py fails naming both when another is installed):
the stale status the UI shows, a pool's limit row set or deleted as the CLI and UI do, and a sensor's backfill
request read back and submitted as the sensor daemon does."""

from __future__ import annotations

from collections.abc import Sequence

from dagster import AssetKey, DagsterInstance, Definitions, RunRequest
from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.execution.backfill import PartitionBackfill
from dagster._core.utils import make_new_backfill_id
from dagster._time import get_current_datetime, get_current_timestamp

from hsx_dagster.defs_support.dagster_internals import CHECKED_ON

__all__ = [
    "CHECKED_ON",
    "backfill_partitions",
    "delete_pool_limit",
    "set_pool_limit",
    "stale_status",
    "submit_backfill",
]


def set_pool_limit(instance: DagsterInstance, pool: str, limit: int) -> None:
    """An explicit limit, as `dagster instance concurrency set` writes it."""
    instance.event_log_storage.set_concurrency_slots(pool, limit)


def delete_pool_limit(instance: DagsterInstance, pool: str) -> None:
    """Remove ``pool``'s row, as deleting the pool in the UI does."""
    instance.event_log_storage.delete_concurrency_limit(pool)


def stale_status(
    defs: Definitions, instance: DagsterInstance, keys: Sequence[tuple[AssetKey, str | None]]
) -> list[StaleStatus]:
    """The stale status the UI shows for each (asset, partition), from the same resolver the webserver uses."""
    graph = defs.resolve_asset_graph()
    view = AssetGraphView(
        temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
        instance=instance,
        asset_graph=graph,
    )
    resolver = CachingStaleStatusResolver(instance, graph, loading_context=view)
    return [resolver.get_status(key, partition) for key, partition in keys]


def backfill_partitions(request: RunRequest, key: AssetKey) -> list[str]:
    """The partitions of ``key`` a backfill request (from `backfill_request`) asks for."""
    subset = request.asset_graph_subset
    if subset is None or key not in subset.partitions_subsets_by_asset_key:
        return []
    return sorted(subset.get_partitions_subset(key).get_partition_keys())


def submit_backfill(instance: DagsterInstance, request: RunRequest) -> str:
    """Submit a sensor's backfill request as the sensor daemon does (tests that evaluate a tick themselves); its id."""
    if request.asset_graph_subset is None:
        raise ValueError("not a backfill request (from backfill_request)")
    backfill_id = make_new_backfill_id()
    instance.add_backfill(
        PartitionBackfill.from_asset_graph_subset(
            backfill_id=backfill_id,
            backfill_timestamp=get_current_timestamp(),
            tags=request.tags,
            dynamic_partitions_store=instance,
            asset_graph_subset=request.asset_graph_subset,
            title=None,
            description=None,
            run_config=None,
        )
    )
    return backfill_id
