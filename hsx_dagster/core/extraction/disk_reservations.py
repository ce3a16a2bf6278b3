"""What the other running shards will still write, so that each shard's free-disk check counts it.

Sixty-four shards starting together on one shared filesystem all see the same free space; each alone fits,
together they do not. So a running shard keeps a record under ``<output_dir>/disk_reservations/``: the bytes
it estimated it still had to write and how much its folder held then. Another shard reads the records and
counts, for each, what that shard has not written yet (the estimate less what its folder grew by since).

A record is held under an exclusive ``flock`` by the process that wrote it, so a record whose lock can be
taken belongs to a run that is gone (killed, its node lost: the kernel or the file server dropped the lock)
and is removed instead of counted. Paths in a record are relative to the records' folder: nodes may mount the
shared output folder at other paths.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hsx_dagster.core.storage.files import FileLock, folder_bytes

RESERVATIONS_DIR = "disk_reservations"


@dataclass(frozen=True)
class PendingWrite:
    """Another running shard and the bytes it will still write."""

    shard: str
    host: str
    pid: int
    remaining: int


class DiskReservation:
    """This run's record, held (and so counted by the others) until `release`."""

    def __init__(self, path: Path, lock: FileLock) -> None:
        self.path = path
        self._lock = lock

    def release(self) -> None:
        if self._lock.held:
            self.path.unlink(missing_ok=True)
            self._lock.release()

    def __enter__(self) -> DiskReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def reserve(records_dir: Path, shard: str, shard_dir: Path, needed: int) -> DiskReservation:
    """Record that ``shard`` (its folder ``shard_dir``) will still write about ``needed`` bytes."""
    records_dir.mkdir(parents=True, exist_ok=True)
    host, pid = socket.gethostname(), os.getpid()
    path = records_dir / f"{shard}.{host}.{pid}.json"  # this process's own name: nobody else locks it
    lock = FileLock.try_acquire(path)
    if lock is None:
        raise RuntimeError(f"{path} is locked by another process with this process's host and pid")
    record = {
        "shard": shard,
        "host": host,
        "pid": pid,
        "since": time.time(),
        "needed": needed,
        "shard_dir": os.path.relpath(shard_dir, records_dir),
        "bytes_at_start": folder_bytes(shard_dir),
    }
    lock.record_holder(json.dumps(record))
    return DiskReservation(path, lock)


def pending_writes(records_dir: Path, own: DiskReservation | None = None) -> list[PendingWrite]:
    """What the other live runs will still write; records of runs that are gone are removed."""
    if not records_dir.is_dir():
        return []
    pending = []
    for path in sorted(records_dir.glob("*.json")):
        if own is not None and path == own.path:
            continue
        lock = FileLock.try_acquire(path)
        if lock is not None:  # its writer no longer holds it: a run that died
            path.unlink(missing_ok=True)
            lock.release()
            continue
        try:
            record = json.loads(FileLock.holder(path))
            written = folder_bytes(records_dir / record["shard_dir"]) - int(record["bytes_at_start"])
            remaining = max(0, int(record["needed"]) - max(0, written))
            pending.append(PendingWrite(record["shard"], record["host"], int(record["pid"]), remaining))
        except (ValueError, KeyError, TypeError):  # being written this instant: its writer counts ours instead
            continue
    return pending
