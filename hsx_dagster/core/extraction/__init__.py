"""Extraction: the target's truncated backbone, batch planning, the engine, devices and one shard run end to end."""
