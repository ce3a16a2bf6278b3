"""Taking chunks out of a shard's index: damaged ones are set aside, ones that hold no current sample are deleted.

A chunk leaves in three steps, each safe to be interrupted:

1. a line in ``removed_chunks.jsonl`` records the chunk (name and sha256), why it leaves, and where it goes
   (``set_aside/<name>.<sha256 prefix>`` for a damaged chunk, kept for inspection; nowhere for a chunk whose
   samples all left the inputs: its bytes are reclaimed);
2. the file is moved aside or deleted;
3. the index is rewritten without it (atomically).

`finish_removals` redoes steps 2 and 3 for every logged chunk the index still lists, so a crash anywhere in
between is completed by the next run or check of the shard: nothing committed is lost, and a chunk never
counts as committed once its removal was logged. Its samples are then pending: the next shard run extracts
exactly those again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hsx_dagster.core.storage.atomic import append_lines, read_lines, write_atomic
from hsx_dagster.core.storage.format import REMOVED_CHUNKS_FILE, SET_ASIDE_DIR, SHARD_INDEX_FILE
from hsx_dagster.core.storage.shard_records import ChunkRecord, read_index

NO_CURRENT_SAMPLES = "no_current_samples"  # every sample of the chunk left the inputs: deleted


@dataclass(frozen=True)
class RemovedChunk:
    """One chunk taken out of the index: why, and where its file went (None: deleted)."""

    chunk: str
    sha256: str
    samples: int
    reason: str
    detail: str
    kept_as: str | None
    at: float


def remove_chunks(directory: Path, removals: Sequence[tuple[ChunkRecord, str, str]]) -> list[ChunkRecord]:
    """Take ``removals`` (record, reason, detail) out of the shard's index; the caller holds the shard's lock.
    Chunks removed for `NO_CURRENT_SAMPLES` are deleted, every other one is moved to ``set_aside/``.
    Returns the index that is left."""
    directory = Path(directory)
    now = time.time()
    entries = [
        RemovedChunk(
            chunk=record.chunk,
            sha256=record.sha256,
            samples=record.samples,
            reason=reason,
            detail=detail,
            kept_as=None if reason == NO_CURRENT_SAMPLES else f"{SET_ASIDE_DIR}/{record.chunk}.{record.sha256[:12]}",
            at=now,
        )
        for record, reason, detail in removals
    ]
    if entries:
        append_lines(directory / REMOVED_CHUNKS_FILE, [asdict(entry) for entry in entries])
    return finish_removals(directory)


def finish_removals(directory: Path) -> list[ChunkRecord]:
    """Complete every logged removal the index still shows (a crash between the steps); the index left."""
    directory = Path(directory)
    logged = {(entry.chunk, entry.sha256): entry for entry in read_removed(directory)}
    records = read_index(directory)
    leaving = [record for record in records if (record.chunk, record.sha256) in logged]
    if not leaving:
        return records
    for record in leaving:
        path, entry = directory / record.chunk, logged[(record.chunk, record.sha256)]
        if not path.exists():
            continue  # moved or deleted before a crash, or the chunk that went missing
        if entry.kept_as is None:
            path.unlink()
        else:
            (directory / SET_ASIDE_DIR).mkdir(exist_ok=True)
            os.replace(path, directory / entry.kept_as)
    kept = [record for record in records if (record.chunk, record.sha256) not in logged]
    write_atomic(directory / SHARD_INDEX_FILE, "".join(json.dumps(asdict(r)) + "\n" for r in kept).encode())
    return kept


def read_removed(directory: Path) -> list[RemovedChunk]:
    return [RemovedChunk(**entry) for entry in read_lines(Path(directory) / REMOVED_CHUNKS_FILE)]
