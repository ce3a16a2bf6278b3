"""One shard's output folder: the lock, the provenance check, the clean-up after a crash, and the
index of committed chunks (file names and tensors in format.py).

A chunk is written to a temporary name, flushed to disk, renamed into place, and only then
recorded in the index (also flushed). The index is the truth: at start-up, temporaries and chunk
files that never reached the index are removed, so a crash at any moment loses at most the chunk
being written, and a re-run skips every committed sample. An exclusive lock on the shard's lock
file (released by the kernel when the process dies) keeps two runs of one shard from both writing.
"""

from __future__ import annotations

import json
import logging
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import asdict
from pathlib import Path

import numpy as np

from hsx_dagster.core.settings.choices import OnMismatch
from hsx_dagster.core.storage.atomic import StoreError, append_lines, drop_torn_tail, write_atomic
from hsx_dagster.core.storage.chunk_file import ChunkTensor, write_chunk
from hsx_dagster.core.storage.chunk_removal import NO_CURRENT_SAMPLES, finish_removals, read_removed, remove_chunks
from hsx_dagster.core.storage.cpu_account import CpuAccount
from hsx_dagster.core.storage.files import FileLock
from hsx_dagster.core.storage.format import (
    CHUNK_PATTERN,
    COMPLETE_FILE,
    LOCK_FILE,
    REMOVED_CHUNKS_FILE,
    SHARD_FILE,
    SHARD_INDEX_FILE,
    SHARD_QUARANTINE_FILE,
    SPLIT_BATCHES_FILE,
    chunk_number,
    is_chunk_file,
    is_temporary_file,
)
from hsx_dagster.core.storage.provenance import MEANING as PROVENANCE_MEANING, ShardProvenance
from hsx_dagster.core.storage.shard_records import (  # re-exported: the records a store writes
    ChunkRecord,
    QuarantineRecord,
    ShardTotals,
    read_index,
    read_quarantine,
    record_written,
    shard_totals,
    start_written,
)

__all__ = [
    "ChunkRecord",
    "QuarantineRecord",
    "ShardStore",
    "ShardTotals",
    "read_index",
    "read_quarantine",
    "shard_totals",
]

ON_MISMATCH: tuple[str, ...] = typing.get_args(OnMismatch)
log = logging.getLogger(__name__)


class ShardStore:
    """One shard's output folder: lock, provenance check, clean-up of a crash, committed chunks."""

    def __init__(
        self,
        directory: Path,
        provenance: ShardProvenance,
        on_mismatch: OnMismatch = "refuse",
        report: Callable[[str], None] | None = None,
        run_id: str = "",
    ) -> None:
        """``run_id``: who commits chunks through this store (a Dagster run's id), so that the checks of that run
        take the digests its writer computed (written.jsonl); empty: none are taken."""
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch must be one of {ON_MISMATCH}, not {on_mismatch!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        lock = FileLock.try_acquire(self.directory / LOCK_FILE)
        if lock is None:
            raise StoreError(f"{self.directory} is being written by another run (lock {LOCK_FILE} is held)")
        self._lock = lock
        self.run_id = run_id
        self.chunks_direct = 0  # chunks this store wrote with O_DIRECT
        try:
            self._check_provenance(provenance, on_mismatch, report or log.warning)
            for name in (SHARD_INDEX_FILE, SHARD_QUARANTINE_FILE, REMOVED_CHUNKS_FILE, SPLIT_BATCHES_FILE):
                drop_torn_tail(self.directory / name)
            self.records = finish_removals(self.directory)  # a removal a crash interrupted is completed first
            self.quarantined = read_quarantine(self.directory)
            self._remove_uncommitted()
            start_written(self.directory)
        except BaseException:
            self.close()
            raise

    def _check_provenance(self, provenance: ShardProvenance, on_mismatch: str, report: Callable[[str], None]) -> None:
        path = self.directory / SHARD_FILE
        if path.is_file():
            existing = json.loads(path.read_text(encoding="utf-8"))
            changed, described = provenance.changes_from(existing)
            if not changed and not described:
                return
            if not changed:  # only the description changed (an older shard, a preset named as its ids): record it
                provenance.write(self.directory)
                return
            current = provenance.to_dict()
            details = "; ".join(
                f"{k}: {_shown(existing.get(k))} -> {_shown(current.get(k))}"
                + (f" ({PROVENANCE_MEANING[k]})" if k in PROVENANCE_MEANING else "")
                for k in changed[:4]
            )
            if on_mismatch != "start_over":
                raise StoreError(
                    f"{self.directory} holds hidden states made differently ({details}). Refusing to mix them. "
                    "To redo this shard from scratch, set extraction.on_mismatch: start_over (in the settings file, "
                    "HSX_EXTRACTION__ON_MISMATCH=start_over, or for one run the run config "
                    "resources.gpu.config.on_mismatch); its committed samples are then deleted"
                )
            self._start_over(details, report)
        provenance.write(self.directory)

    def _start_over(self, details: str, report: Callable[[str], None]) -> None:
        """Delete what the shard holds, index first: once it is gone no chunk counts as committed, so a
        crash part-way leaves nothing a later run could mistake for work done; shard.json goes last."""
        samples: int | str
        try:
            samples = sum(record.samples for record in read_index(self.directory))
        except StoreError:
            samples = "an unreadable number of"
        for name in (COMPLETE_FILE, SHARD_INDEX_FILE, SHARD_QUARANTINE_FILE, SPLIT_BATCHES_FILE):
            (self.directory / name).unlink(missing_ok=True)
        chunks = 0
        for path in self.directory.iterdir():
            if is_chunk_file(path.name) or is_temporary_file(path.name):
                chunks += is_chunk_file(path.name)
                path.unlink()
        report(
            f"{self.directory} was made differently ({details}); extraction.on_mismatch is start_over: deleted "
            f"{chunks} chunks holding {samples} samples, the index and complete.json; redoing the shard"
        )

    def _remove_uncommitted(self) -> None:
        committed = {record.chunk for record in self.records}
        for path in self.directory.iterdir():
            temporary = is_temporary_file(path.name)
            orphan = is_chunk_file(path.name) and path.name not in committed
            if temporary or orphan:
                path.unlink()

    @property
    def done_sample_ids(self) -> set[int]:
        """Committed or quarantined: either way a re-run does not redo them."""
        committed = {sample_id for record in self.records for sample_id in record.sample_ids}
        return committed | {record.sample_id for record in self.quarantined}

    def pending_mask(self, sample_ids: np.ndarray) -> np.ndarray:
        """True where a sample is neither committed nor quarantined: what a run still has to extract."""
        done = self.done_sample_ids
        return ~np.isin(sample_ids, np.fromiter(done, dtype=np.int64, count=len(done)))

    def remove(self, removals: Sequence[tuple[ChunkRecord, str, str]]) -> None:
        """Take chunks out of the index (record, reason, detail): see chunk_removal.py."""
        if removals:
            self.records = remove_chunks(self.directory, removals)

    def reclaim(self, current_ids: np.ndarray) -> list[ChunkRecord]:
        """Delete the chunks none of whose samples is current (all left the inputs); the chunks deleted."""
        current = set(np.asarray(current_ids, dtype=np.int64).tolist())
        gone = [record for record in self.records if not current.intersection(record.sample_ids)]
        self.remove([(record, NO_CURRENT_SAMPLES, "every sample left the inputs") for record in gone])
        return gone

    def next_chunk_name(self) -> str:
        """A name no chunk of this shard had before (removed chunks' names are not reused)."""
        names = [record.chunk for record in self.records] + [entry.chunk for entry in read_removed(self.directory)]
        return CHUNK_PATTERN.format(max((chunk_number(name) for name in names), default=-1) + 1)

    def log_split_batch(self, sample_ids: Sequence[int]) -> None:
        """Record a batch about to be cut into several chunks (its samples in order), before any of them commits:
        a run that redoes some of them forms the same batch again (core/extraction/replay.py)."""
        append_lines(self.directory / SPLIT_BATCHES_FILE, [{"sample_ids": [int(i) for i in sample_ids]}])

    def quarantine(self, records: Sequence[QuarantineRecord]) -> None:
        append_lines(self.directory / SHARD_QUARANTINE_FILE, [asdict(record) for record in records])
        self.quarantined.extend(records)

    def commit(
        self,
        tensors: Sequence[ChunkTensor],
        sample_ids: list[int],
        metadata: dict[str, str],
        stats: dict | None,
        hasher: Executor,
        *,
        direct: bool = False,
        cpu: CpuAccount | None = None,
    ) -> ChunkRecord:
        """Write one chunk atomically, hashed while it is written (chunk_file.py; ``direct``: with O_DIRECT where the
        file system takes it, counted in ``chunks_direct``), then record it in the index (with its write-time
        ``stats``). ``cpu``: where the writing's CPU time is added, by part."""
        cpu = cpu or CpuAccount()
        name = self.next_chunk_name()
        size, sha256, wrote_direct = write_chunk(
            self.directory / name, tensors, metadata, hasher, direct=direct, cpu=cpu
        )
        self.chunks_direct += wrote_direct
        tokens = next(tensor.rows for tensor in tensors if tensor.name == "input_ids")
        record = ChunkRecord(
            chunk=name,
            samples=len(sample_ids),
            tokens=tokens,
            bytes=size,
            sha256=sha256,
            sample_ids=list(sample_ids),
            stats=stats,
        )
        with cpu.part("index_and_records"):
            append_lines(self.directory / SHARD_INDEX_FILE, [asdict(record)])
            self.records.append(record)
            if self.run_id:
                record_written(self.directory, record, self.run_id)
        return record

    def mark_complete(self, summary: dict) -> None:
        write_atomic(self.directory / COMPLETE_FILE, json.dumps(summary, indent=2, sort_keys=True).encode())

    def close(self) -> None:
        self._lock.release()

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "..."
