"""Crash-safe, resumable storage of one shard's hidden states: safetensors chunks plus an index.

Layout of ``<output_dir>/hidden_states/<shard>/``::

    chunk-000000.safetensors   flat, token-major, unpadded tensors of many samples:
                                 input_ids int32 [T], loss_mask uint8 [T],
                                 hidden_states [T, L, H] (storage dtype),
                                 final_hidden_states [T, H] (optional),
                                 offsets int64 [n + 1] (sample k = rows offsets[k]:offsets[k+1]),
                                 sample_ids int64 [n]
    index.jsonl                one line per committed chunk: name, samples, tokens, bytes, sha256, ids
    shard.json                 what the shard was made from (model, layers, dtypes, input); refuses mixing
    complete.json              written once every sample of the shard is committed

A chunk is written to a temporary name, flushed to disk, renamed into place, and only then
recorded in the index (also flushed). The index is the truth: at start-up, temporaries and chunk
files that never reached the index are removed, so a crash at any moment loses at most the chunk
being written, and a re-run skips every committed sample. An exclusive lock on ``shard.lock``
(released by the kernel when the process dies) keeps two runs of one shard from both writing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

FORMAT = "hsx-hidden-states"
FORMAT_VERSION = 1
INDEX_FILE = "index.jsonl"
SHARD_FILE = "shard.json"
COMPLETE_FILE = "complete.json"
LOCK_FILE = "shard.lock"
CHUNK_PATTERN = "chunk-{:06d}.safetensors"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class StoreError(RuntimeError):
    """The shard's output cannot be used as asked (held by another run, made from other inputs, ...)."""


@dataclass(frozen=True)
class ChunkRecord:
    chunk: str
    samples: int
    tokens: int
    bytes: int
    sha256: str
    sample_ids: list[int]


@dataclass
class HostBatch:
    """One extracted batch on the host, samples in the order of ``sample_ids``."""

    sample_ids: list[int]
    lengths: list[int]
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    hidden_states: torch.Tensor  # [T, L, H]
    final_hidden_states: torch.Tensor | None  # [T, H]
    ready: object | None = None  # a CUDA event to wait on before reading the host tensors

    @property
    def nbytes(self) -> int:
        tensors = [self.input_ids, self.loss_mask, self.hidden_states]
        if self.final_hidden_states is not None:
            tensors.append(self.final_hidden_states)
        return sum(t.numel() * t.element_size() for t in tensors)


class ShardStore:
    """One shard's output folder: lock, provenance check, clean-up of a crash, committed chunks."""

    def __init__(self, directory: Path, provenance: dict) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.directory / LOCK_FILE, "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise StoreError(f"{self.directory} is being written by another run (lock {LOCK_FILE} is held)") from None
        try:
            self._check_provenance(provenance)
            self.records = read_index(self.directory)
            self._drop_torn_index_tail()
            self._remove_uncommitted()
        except BaseException:
            self.close()
            raise

    def _check_provenance(self, provenance: dict) -> None:
        path = self.directory / SHARD_FILE
        if path.is_file():
            existing = json.loads(path.read_text(encoding="utf-8"))
            changed = sorted(key for key in set(existing) | set(provenance) if existing.get(key) != provenance.get(key))
            if changed:
                details = "; ".join(f"{k}: {existing.get(k)!r} -> {provenance.get(k)!r}" for k in changed[:4])
                raise StoreError(
                    f"{self.directory} holds hidden states made differently ({details}). Refusing to mix them; "
                    f"delete {self.directory} to start this shard over"
                )
        else:
            write_atomic(path, json.dumps(provenance, indent=2, sort_keys=True).encode())

    def _drop_torn_index_tail(self) -> None:
        """Rewrite the index without a half-appended last line, so the next append starts clean."""
        path = self.directory / INDEX_FILE
        if path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            write_atomic(path, "".join(json.dumps(asdict(r)) + "\n" for r in self.records).encode())

    def _remove_uncommitted(self) -> None:
        committed = {record.chunk for record in self.records}
        for path in self.directory.iterdir():
            temporary = path.name.startswith(".") and ".tmp" in path.name
            orphan = path.name.startswith("chunk-") and path.name not in committed
            if temporary or orphan:
                path.unlink()

    @property
    def done_sample_ids(self) -> set[int]:
        return {sample_id for record in self.records for sample_id in record.sample_ids}

    def commit(self, tensors: dict[str, torch.Tensor], sample_ids: list[int], metadata: dict[str, str]) -> ChunkRecord:
        """Write one chunk atomically, then record it in the index."""
        name = CHUNK_PATTERN.format(len(self.records))
        payload = safetensors_bytes(tensors, metadata=metadata)
        write_atomic(self.directory / name, payload)
        record = ChunkRecord(
            chunk=name,
            samples=len(sample_ids),
            tokens=int(tensors["input_ids"].numel()),
            bytes=len(payload),
            sha256=hashlib.sha256(payload).hexdigest(),
            sample_ids=list(sample_ids),
        )
        with open(self.directory / INDEX_FILE, "a", encoding="utf-8") as index:
            index.write(json.dumps(asdict(record)) + "\n")
            index.flush()
            os.fsync(index.fileno())
        self.records.append(record)
        return record

    def mark_complete(self, summary: dict) -> None:
        write_atomic(self.directory / COMPLETE_FILE, json.dumps(summary, indent=2, sort_keys=True).encode())

    def close(self) -> None:
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ChunkWriter:
    """Writes batches into chunks on a background thread, so the next batch computes meanwhile.

    The queue is bounded: when writing falls behind, `submit` blocks instead of piling host memory
    up. A failure on the writer thread is raised in the caller at the next `submit` or `close`.
    """

    def __init__(self, store: ShardStore, chunk_bytes: int, metadata: dict[str, str], queue_depth: int = 2) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.metadata = metadata
        self.bytes_written = 0
        self.committed: list[ChunkRecord] = []
        self._queue: queue.Queue[HostBatch | None] = queue.Queue(maxsize=queue_depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hsx-chunk-writer", daemon=True)
        self._thread.start()

    def submit(self, batch: HostBatch) -> None:
        self._raise_if_failed()
        while True:
            try:
                self._queue.put(batch, timeout=1.0)
                return
            except queue.Full:
                self._raise_if_failed()

    def close(self) -> list[ChunkRecord]:
        """Flush what is pending into a last chunk and stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_if_failed()
        return self.committed

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StoreError(f"writing hidden states to {self.store.directory} failed: {self._error}") from self._error

    def _run(self) -> None:
        pending: list[HostBatch] = []
        pending_bytes = 0
        try:
            while True:
                batch = self._queue.get()
                if batch is None:
                    break
                if batch.ready is not None:
                    batch.ready.synchronize()  # the device-to-host copy of this batch has landed
                pending.append(batch)
                pending_bytes += batch.nbytes
                if pending_bytes >= self.chunk_bytes:
                    self._write(pending)
                    pending, pending_bytes = [], 0
            if pending:
                self._write(pending)
        except BaseException as exc:  # reported to the caller thread; nothing half-written stays
            self._error = exc
            while True:  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def _write(self, batches: Sequence[HostBatch]) -> None:
        lengths = [length for batch in batches for length in batch.lengths]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        sample_ids = [sample_id for batch in batches for sample_id in batch.sample_ids]
        tensors = {
            "input_ids": torch.cat([b.input_ids for b in batches]),
            "loss_mask": torch.cat([b.loss_mask for b in batches]),
            "hidden_states": torch.cat([b.hidden_states for b in batches]),
            "offsets": offsets,
            "sample_ids": torch.tensor(sample_ids, dtype=torch.int64),
        }
        if batches[0].final_hidden_states is not None:
            tensors["final_hidden_states"] = torch.cat([b.final_hidden_states for b in batches])
        record = self.store.commit(tensors, sample_ids, self.metadata)
        self.bytes_written += record.bytes
        self.committed.append(record)


def read_index(directory: Path) -> list[ChunkRecord]:
    """Committed chunks; a torn last line (a crash while appending) is not a commit."""
    path = Path(directory) / INDEX_FILE
    if not path.is_file():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for number, line in enumerate(lines):
        if not line.endswith("\n"):
            break  # the append never finished: its chunk is an orphan and will be redone
        try:
            records.append(ChunkRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as exc:
            raise StoreError(f"{path}: line {number + 1} is not a chunk record ({exc})") from None
    return records


def totals_of(records: Sequence[ChunkRecord]) -> dict:
    """Samples, tokens, bytes and chunk names over committed chunks."""
    return {
        "samples": sum(r.samples for r in records),
        "tokens": sum(r.tokens for r in records),
        "bytes": sum(r.bytes for r in records),
        "chunks": [r.chunk for r in records],
    }


def shard_totals(directory: Path) -> dict:
    return totals_of(read_index(directory))


def iter_shard_samples(directory: Path) -> Iterator[dict[str, torch.Tensor | int]]:
    """Every committed sample of a shard, in commit order, read through memory-mapped slices."""
    directory = Path(directory)
    for record in read_index(directory):
        with safe_open(str(directory / record.chunk), framework="pt") as chunk:
            offsets = chunk.get_tensor("offsets").tolist()
            sample_ids = chunk.get_tensor("sample_ids").tolist()
            names = set(chunk.keys())
            for k, sample_id in enumerate(sample_ids):
                start, end = offsets[k], offsets[k + 1]
                sample = {
                    "sample_id": sample_id,
                    "input_ids": chunk.get_slice("input_ids")[start:end].to(torch.int64),
                    "loss_mask": chunk.get_slice("loss_mask")[start:end],
                    "hidden_states": chunk.get_slice("hidden_states")[start:end],
                }
                if "final_hidden_states" in names:
                    sample["final_hidden_states"] = chunk.get_slice("final_hidden_states")[start:end]
                yield sample


def write_atomic(path: Path, payload: bytes) -> None:
    """Temporary name, flush, fsync, rename, fsync the folder: the file is whole or absent."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
