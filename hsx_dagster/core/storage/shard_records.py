"""A shard's records on disk, read back: the index of committed chunks, the quarantined samples, the totals.

The index (``index.jsonl``) is the truth about what a shard holds; `ShardStore` (shard_store.py) writes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hsx_dagster.core.storage.atomic import StoreError, read_lines, write_atomic
from hsx_dagster.core.storage.format import SHARD_INDEX_FILE, SHARD_QUARANTINE_FILE, VERIFIED_FILE, WRITTEN_FILE


@dataclass(frozen=True)
class ChunkRecord:
    chunk: str
    samples: int
    tokens: int
    bytes: int
    sha256: str
    sample_ids: list[int]
    # per-layer statistics computed when the chunk was written (chunk_stats.py); None in older shards
    stats: dict | None = None


@dataclass(frozen=True)
class QuarantineRecord:
    sample_id: int
    reason: str
    detail: str


def read_index(directory: Path) -> list[ChunkRecord]:
    """Committed chunks; a torn last line (a crash while appending) is not a commit."""
    path = Path(directory) / SHARD_INDEX_FILE
    try:
        return [ChunkRecord(**entry) for entry in read_lines(path)]
    except TypeError as exc:
        raise StoreError(f"{path}: not a chunk record ({exc})") from None


def read_quarantine(directory: Path) -> list[QuarantineRecord]:
    return [QuarantineRecord(**entry) for entry in read_lines(Path(directory) / SHARD_QUARANTINE_FILE)]


@dataclass(frozen=True)
class ShardTotals:
    """Samples, tokens, bytes and chunk names over a shard's committed chunks."""

    samples: int
    tokens: int
    bytes: int
    chunks: tuple[str, ...]

    @classmethod
    def of(cls, records: Sequence[ChunkRecord]) -> ShardTotals:
        return cls(
            samples=sum(r.samples for r in records),
            tokens=sum(r.tokens for r in records),
            bytes=sum(r.bytes for r in records),
            chunks=tuple(r.chunk for r in records),
        )

    def to_dict(self) -> dict[str, Any]:
        """As complete.json records them."""
        return {**asdict(self), "chunks": list(self.chunks)}


def shard_totals(directory: Path) -> ShardTotals:
    return ShardTotals.of(read_index(directory))


RACY_NS = 10**9  # a file modified within this long of its verification may share its mtime with what was verified


def record_verified(
    directory: Path,
    records: Sequence[ChunkRecord],
    verified_at_ns: int,
    *,
    tokenized: dict[str, str] | None = None,
    kept: dict | None = None,
) -> None:
    """Note ``records`` as read whole and found as written (by the shard checks that began at ``verified_at_ns``),
    with each file's size, mtime and inode: no check reads them whole again while all three are unchanged.
    ``tokenized``: chunk -> digest of the tokenized shard its ids and masks were found equal to; ``kept``: the
    entries of chunks not read again this time (verified before and unchanged), carried over as they were."""
    entries = {}
    for record in records:
        if kept and record.chunk in kept:
            entries[record.chunk] = dict(kept[record.chunk])
        else:
            try:
                status = os.stat(Path(directory) / record.chunk)
            except FileNotFoundError:
                continue
            entries[record.chunk] = {
                "sha256": record.sha256,
                "size": status.st_size,
                "mtime_ns": status.st_mtime_ns,
                "ino": status.st_ino,
                "verified_at_ns": verified_at_ns,
            }
        if tokenized and record.chunk in tokenized:
            entries[record.chunk]["tokenized"] = tokenized[record.chunk]
    write_atomic(Path(directory) / VERIFIED_FILE, json.dumps(entries, indent=1, sort_keys=True).encode())


def verified_unchanged(directory: Path, record: ChunkRecord, verified: dict | None = None) -> bool:
    """Whether the shard checks found ``record``'s chunk whole and its file has not changed since: the same size,
    mtime and inode (a file replaced by another has another inode), and modified long enough before the check
    began that a later write could not have left the same mtime (file times are coarser than nanoseconds)."""
    if verified is None:
        verified = read_verified(directory)
    entry = verified.get(record.chunk)
    if not isinstance(entry, dict) or entry.get("sha256") != record.sha256:
        return False
    try:
        status = os.stat(Path(directory) / record.chunk)
    except FileNotFoundError:
        return False
    unchanged = (status.st_size, status.st_mtime_ns, status.st_ino) == (
        entry.get("size"),
        entry.get("mtime_ns"),
        entry.get("ino"),
    )
    return unchanged and int(entry.get("verified_at_ns", 0)) - status.st_mtime_ns > RACY_NS


def read_verified(directory: Path) -> dict:
    try:
        data = json.loads((Path(directory) / VERIFIED_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# --- this run's chunks, as its writer hashed them (written.jsonl) ---------------------------------------------------
# The writer hashed a chunk's bytes from memory while it wrote them (chunk_file.py); reading the file back from the
# page cache moments later would prove nothing more about the disk. So the checks of the run that wrote a chunk take
# the writer's digest while the file is the one it wrote: the same size, mtime, ctime and inode as just after the
# commit (a write or a replacement since changes mtime or the inode; resetting the mtime changes the ctime).


def file_identity(path: Path) -> dict[str, int]:
    status = os.stat(path)
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "ctime_ns": status.st_ctime_ns,
            "ino": status.st_ino}  # fmt: skip


def start_written(directory: Path) -> None:
    """A run begins: the chunks earlier runs wrote are not its own (their checks verified them, or hash them)."""
    (Path(directory) / WRITTEN_FILE).unlink(missing_ok=True)


def record_written(directory: Path, record: ChunkRecord, run_id: str) -> None:
    """Note a chunk just committed by run ``run_id`` with its file's identity now. Not fsynced: an entry lost in a
    crash only means the chunk is hashed by the checks."""
    entry = {"chunk": record.chunk, "sha256": record.sha256, "run_id": run_id,
             **file_identity(Path(directory) / record.chunk)}  # fmt: skip
    with open(Path(directory) / WRITTEN_FILE, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")


def read_written(directory: Path, run_id: str | None) -> dict[str, dict]:
    """Chunk -> the writer's entry, for the chunks run ``run_id`` committed (none without a run id)."""
    if not run_id:
        return {}
    try:
        entries = read_lines(Path(directory) / WRITTEN_FILE)
    except StoreError:
        return {}  # an unreadable ledger trusts nothing: every chunk is hashed
    return {entry["chunk"]: entry for entry in entries if isinstance(entry, dict) and entry.get("run_id") == run_id}


def written_unchanged(directory: Path, record: ChunkRecord, written: dict[str, dict]) -> bool:
    """Whether ``record``'s chunk is the file this run's writer committed, with the digest the index records."""
    entry = written.get(record.chunk)
    if entry is None or entry.get("sha256") != record.sha256:
        return False
    try:
        identity = file_identity(Path(directory) / record.chunk)
    except FileNotFoundError:
        return False
    return all(entry.get(key) == value for key, value in identity.items())
