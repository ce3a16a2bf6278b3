"""Shard keys (`shard-00`, `shard-01`, ...): the partition keys of `hidden_states` and the names of the shard folders
under output_dir, so only well-formed ones may reach the file system."""

from __future__ import annotations

import re

from hsx_dagster.core.settings.errors import SettingsError

SHARD_KEY = re.compile(r"shard-\d{2,}")


def shard_keys(count: int) -> list[str]:
    """`shard-00`, `shard-01`, ...; wider numbers only when there are more than 100 shards."""
    width = max(2, len(str(count - 1)))
    return [f"shard-{index:0{width}d}" for index in range(count)]


def check_shard_key(key: str) -> str:
    """Shard keys name files and folders under output_dir: anything but shard-NN could escape it."""
    if not isinstance(key, str) or not SHARD_KEY.fullmatch(key):
        raise SettingsError(
            f"{key!r} is not a shard key (shard-00, shard-01, ...); shard keys name folders under output_dir"
        )
    return key
