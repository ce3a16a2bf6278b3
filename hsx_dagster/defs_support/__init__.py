"""What helps the definitions in `hsx_dagster/defs/` without defining any:

asset_keys.py         the asset keys, declared once
metadata.py           check outcomes into `AssetCheckResult`s, figures and tables into metadata people read
shard_table.py        the per-shard table (the core's rows plus what only the instance knows)
pools.py              the `gpu` concurrency pool, prepared before shards start
dagster_internals.py  every use of Dagster's private API: the seam an upgrade of Dagster is checked at
"""
