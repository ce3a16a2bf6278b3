"""Self-healing: a chunk the checks found damaged (checksum, header, samples) or missing is taken out of its
shard's index, moved to ``set_aside/`` with the reason recorded (never deleted), and the shard is no longer
marked complete; its samples are then pending, and the shard's next run (the retry sensor's, or one by hand)
extracts exactly those again. How a chunk leaves the index, crash-safely: chunk_removal.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hsx_dagster.core.storage.chunk_removal import finish_removals, remove_chunks
from hsx_dagster.core.storage.files import FileLock
from hsx_dagster.core.storage.format import COMPLETE_FILE, LOCK_FILE
from hsx_dagster.core.storage.shard_records import ChunkRecord


def reason_of(problems: Sequence[str]) -> str:
    text = " ".join(problems)
    if ": missing" in text:
        return "missing"
    if "checksum differs" in text:
        return "checksum"
    return "header" if "header" in text else "samples"


def set_aside_damaged(
    folder: Path, records: Sequence[ChunkRecord], problems: dict[str, list[str]]
) -> list[ChunkRecord]:
    """Take the chunks named in ``problems`` out of the index (only those still there, unchanged); the chunks set
    aside. Nothing is done while a run holds the shard's lock (it is writing; its own checks follow)."""
    folder = Path(folder)
    lock = FileLock.try_acquire(folder / LOCK_FILE)
    if lock is None:
        return []
    with lock:
        current = {(record.chunk, record.sha256) for record in finish_removals(folder)}
        damaged = [r for r in records if r.chunk in problems and (r.chunk, r.sha256) in current]
        if not damaged:
            return []
        (folder / COMPLETE_FILE).unlink(missing_ok=True)  # first: the shard no longer holds all of its samples
        remove_chunks(folder, [(r, reason_of(problems[r.chunk]), "; ".join(problems[r.chunk])) for r in damaged])
    return damaged
