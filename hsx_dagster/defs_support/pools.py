"""The Dagster pool `gpu` that extraction steps run in, and its preparation before shards start.

Dagster creates a pool's limit row lazily, when the first step claims a slot. On PostgreSQL two
shard runs starting together on a fresh instance both try to insert that row; the loser's insert
aborts its transaction, Dagster's fallback update then fails too, and that shard's run dies
(dagster-io/dagster#33552). So the row is created once, ahead of the shards: by the
`tokenized_dataset` step (which every extraction depends on) and by the retry sensor before it
launches shards together. Once the row exists with the instance's default, steps never insert it.
"""

import logging

from dagster import DagsterInstance
from sqlalchemy.exc import SQLAlchemyError

from hsx_dagster.defs_support.dagster_internals import initialize_pool_limit, pool_limit, supports_pool_limits

GPU_POOL = "gpu"


def prepare_pool(
    instance: DagsterInstance, log: logging.Logger | logging.LoggerAdapter, pool: str = GPU_POOL
) -> int | None:
    """Create `pool`'s limit row from the instance's `concurrency.pools.default_limit` if missing.

    Returns the pool's limit (None: the instance does not limit it). Safe to call from several
    processes at once: a process that loses the insert re-reads the row the winner wrote.
    """
    if not supports_pool_limits(instance):
        return None
    default_limit = instance.get_concurrency_config().pool_config.default_pool_limit
    current = pool_limit(instance, pool)
    if current is None:
        if default_limit is None:
            return None
        try:
            initialize_pool_limit(instance, pool)
        except SQLAlchemyError:
            # Another process inserted the row between our read and our insert: its row serves.
            if pool_limit(instance, pool) is None:
                raise
        current = pool_limit(instance, pool)
        limit = current.limit if current else default_limit  # storages without a limits table keep none
        log.info(f"pool `{pool}`: limit {limit} (the instance's default)")
        return limit
    if current.from_default and default_limit is not None and current.limit != default_limit:
        # Dagster re-applies a changed default when a step claims a slot, which fails on PostgreSQL
        # (same issue). An explicit limit is never re-applied, so it is the reliable way to resize.
        log.warning(
            f"pool `{pool}` still holds the earlier default limit {current.limit}, the instance's default is "
            f"now {default_limit}; on PostgreSQL Dagster fails to apply the change when a step starts "
            f"(dagster-io/dagster#33552): run `dagster instance concurrency set {pool} {default_limit}`"
        )
    return current.limit
