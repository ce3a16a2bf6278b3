"""The sensors: automation.py (`drafter_dataset` when every shard is done, input observation) and retries.py
(`retry_failed_shards`: failed shards re-run as one backfill per tick, within a per-shard budget)."""
