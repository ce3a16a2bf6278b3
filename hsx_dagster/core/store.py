"""Crash-safe, resumable storage of one shard's hidden states: safetensors chunks plus an index.

Layout of ``<output_dir>/hidden_states/<shard>/``::

    chunk-000000.safetensors   flat, token-major, unpadded tensors of many samples:
                                 input_ids int32 [T], loss_mask uint8 [T],
                                 hidden_states [T, L, H] (storage dtype),
                                 final_hidden_states [T, H] (optional),
                                 *_scales [T, (L,) H / block] (float8_e4m3 only: see quantization.py),
                                 offsets int64 [n + 1] (sample k = rows offsets[k]:offsets[k+1]),
                                 sample_ids int64 [n]
    index.jsonl                one line per committed chunk: name, samples, tokens, bytes, sha256, ids
    quarantine.jsonl           samples set aside with a reason (NaN/Inf states, nan_policy: quarantine)
    shard.json                 what the shard was made from (model, layers, dtypes, input); refuses mixing
    complete.json              written once every sample of the shard is committed

A chunk is written to a temporary name, flushed to disk, renamed into place, and only then
recorded in the index (also flushed). The index is the truth: at start-up, temporaries and chunk
files that never reached the index are removed, so a crash at any moment loses at most the chunk
being written, and a re-run skips every committed sample. An exclusive lock on ``shard.lock``
(released by the kernel when the process dies) keeps two runs of one shard from both writing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from hsx_dagster.core.quantization import FP8_DTYPE, SCALES_SUFFIX, dequantize

FORMAT = "hsx-hidden-states"
FORMAT_VERSION = 1
INDEX_FILE = "index.jsonl"
QUARANTINE_FILE = "quarantine.jsonl"
SHARD_FILE = "shard.json"
COMPLETE_FILE = "complete.json"
LOCK_FILE = "shard.lock"
CHUNK_PATTERN = "chunk-{:06d}.safetensors"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float8_e4m3": FP8_DTYPE}
STATE_TENSORS = ("hidden_states", "final_hidden_states")
NAN_POLICIES = ("fail", "quarantine")


ON_MISMATCH = ("refuse", "start_over")
# What a changed provenance key means, for the message that refuses to mix.
_PROVENANCE_MEANING = {
    "tokenized_sha256": "the shard's tokenized samples changed: re-tokenized with other inputs, dataset settings or shard count",
    "config_sha256": "the model's config.json changed",
    "weights_index_sha256": "the model's weights changed",
    "model_path": "model.path",
    "layer_ids": "model.layers",
    "include_final": "model.include_final",
    "storage_dtype": "extraction.storage_dtype",
    "compute_dtype": "extraction.compute_dtype, or another kind of device",
}
log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """The shard's output cannot be used as asked (held by another run, made from other inputs, ...)."""


class NonFiniteStatesError(RuntimeError):
    """Extracted states hold NaN or Inf; the message names the samples and layers."""


@dataclass(frozen=True)
class ChunkRecord:
    chunk: str
    samples: int
    tokens: int
    bytes: int
    sha256: str
    sample_ids: list[int]


@dataclass(frozen=True)
class QuarantineRecord:
    sample_id: int
    reason: str
    detail: str


@dataclass
class HostBatch:
    """One extracted batch on the host, samples in the order of ``sample_ids``.

    ``tensors`` are token-major (row k of each belongs to the same token): input_ids int32 [T],
    loss_mask uint8 [T], hidden_states [T, L, H], and optionally final_hidden_states [T, H] and the
    fp8 scales. ``nonfinite`` [T, slots] flags tokens whose states hold NaN or Inf, per layer slot.
    """

    sample_ids: list[int]
    lengths: list[int]
    tensors: dict[str, torch.Tensor]
    nonfinite: torch.Tensor | None = None
    ready: object | None = None  # a CUDA event to wait on before reading the host tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def without(self, drop: set[int]) -> HostBatch:
        """The batch minus the samples at positions ``drop``."""
        keep_samples = [k not in drop for k in range(len(self.sample_ids))]
        keep_tokens = torch.repeat_interleave(torch.tensor(keep_samples), torch.tensor(self.lengths))
        return HostBatch(
            sample_ids=[i for i, keep in zip(self.sample_ids, keep_samples) if keep],
            lengths=[n for n, keep in zip(self.lengths, keep_samples) if keep],
            tensors={name: tensor[keep_tokens] for name, tensor in self.tensors.items()},
        )

    def nonfinite_samples(self, slot_names: Sequence[str]) -> dict[int, str]:
        """Position in the batch -> which layers hold NaN/Inf, for the samples that have any."""
        if self.nonfinite is None or not bool(self.nonfinite.any()):
            return {}
        found, start = {}, 0
        for position, length in enumerate(self.lengths):
            bad_slots = self.nonfinite[start : start + length].any(dim=0)
            if bool(bad_slots.any()):
                tokens = int(self.nonfinite[start : start + length].any(dim=1).sum())
                layers = ", ".join(name for name, bad in zip(slot_names, bad_slots.tolist()) if bad)
                found[position] = f"NaN or Inf in {tokens} of {length} tokens ({layers})"
            start += length
        return found


class ShardStore:
    """One shard's output folder: lock, provenance check, clean-up of a crash, committed chunks."""

    def __init__(
        self,
        directory: Path,
        provenance: dict,
        on_mismatch: str = "refuse",
        report: Callable[[str], None] | None = None,
    ) -> None:
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch must be one of {ON_MISMATCH}, not {on_mismatch!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.directory / LOCK_FILE, "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise StoreError(f"{self.directory} is being written by another run (lock {LOCK_FILE} is held)") from None
        try:
            self._check_provenance(provenance, on_mismatch, report or log.warning)
            self.records = read_index(self.directory)
            self.quarantined = read_quarantine(self.directory)
            for name in (INDEX_FILE, QUARANTINE_FILE):
                _drop_torn_tail(self.directory / name)
            self._remove_uncommitted()
        except BaseException:
            self.close()
            raise

    def _check_provenance(self, provenance: dict, on_mismatch: str, report: Callable[[str], None]) -> None:
        path = self.directory / SHARD_FILE
        if path.is_file():
            existing = json.loads(path.read_text(encoding="utf-8"))
            changed = sorted(key for key in set(existing) | set(provenance) if existing.get(key) != provenance.get(key))
            if not changed:
                return
            details = "; ".join(
                f"{k}: {_shown(existing.get(k))} -> {_shown(provenance.get(k))}"
                + (f" ({_PROVENANCE_MEANING[k]})" if k in _PROVENANCE_MEANING else "")
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
        write_atomic(path, json.dumps(provenance, indent=2, sort_keys=True).encode())

    def _start_over(self, details: str, report: Callable[[str], None]) -> None:
        """Delete what the shard holds, index first: once it is gone no chunk counts as committed, so a
        crash part-way leaves nothing a later run could mistake for work done; shard.json goes last."""
        try:
            samples = sum(record.samples for record in read_index(self.directory))
        except StoreError:
            samples = "an unreadable number of"
        for name in (COMPLETE_FILE, INDEX_FILE, QUARANTINE_FILE):
            (self.directory / name).unlink(missing_ok=True)
        chunks = 0
        for path in self.directory.iterdir():
            if path.name.startswith("chunk-") or (path.name.startswith(".") and ".tmp" in path.name):
                chunks += path.name.startswith("chunk-")
                path.unlink()
        report(
            f"{self.directory} was made differently ({details}); extraction.on_mismatch is start_over: deleted "
            f"{chunks} chunks holding {samples} samples, the index and complete.json; redoing the shard"
        )

    def _remove_uncommitted(self) -> None:
        committed = {record.chunk for record in self.records}
        for path in self.directory.iterdir():
            temporary = path.name.startswith(".") and ".tmp" in path.name
            orphan = path.name.startswith("chunk-") and path.name not in committed
            if temporary or orphan:
                path.unlink()

    @property
    def done_sample_ids(self) -> set[int]:
        """Committed or quarantined: either way a re-run does not redo them."""
        committed = {sample_id for record in self.records for sample_id in record.sample_ids}
        return committed | {record.sample_id for record in self.quarantined}

    def quarantine(self, records: Sequence[QuarantineRecord]) -> None:
        _append_lines(self.directory / QUARANTINE_FILE, [asdict(record) for record in records])
        self.quarantined.extend(records)

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
        _append_lines(self.directory / INDEX_FILE, [asdict(record)])
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

    Samples whose states hold NaN or Inf fail the run (after committing the good samples before
    them), or with ``nan_policy="quarantine"`` are left out and recorded in quarantine.jsonl.
    """

    def __init__(
        self,
        store: ShardStore,
        chunk_bytes: int,
        metadata: dict[str, str],
        queue_depth: int = 2,
        nan_policy: str = "fail",
        slot_names: Sequence[str] = (),
    ) -> None:
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, not {nan_policy!r}")
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.metadata = metadata
        self.nan_policy = nan_policy
        self.slot_names = list(slot_names)
        self.quarantined: list[QuarantineRecord] = []
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
        if isinstance(self._error, NonFiniteStatesError):
            raise self._error
        if self._error is not None:
            raise StoreError(f"writing hidden states to {self.store.directory} failed: {self._error}") from self._error

    def _run(self) -> None:
        # Without this, the writer's first torch op starts a second pool of intra-op threads that
        # fights the forward pass for the cores (measured 2.3x slower forwards on 2 cores). The
        # setting is per thread: the compute thread keeps all of its threads.
        torch.set_num_threads(1)
        pending: list[HostBatch] = []
        pending_bytes = 0
        try:
            while True:
                batch = self._queue.get()
                if batch is None:
                    break
                if batch.ready is not None:
                    batch.ready.synchronize()  # the device-to-host copy of this batch has landed
                batch = self._screen(batch, pending)
                if not batch.sample_ids:
                    continue
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

    def _screen(self, batch: HostBatch, pending: list[HostBatch]) -> HostBatch:
        bad = batch.nonfinite_samples(self.slot_names)
        if not bad:
            return batch
        if self.nan_policy == "fail":
            if pending:  # keep what was extracted fine before this batch
                self._write(pending)
                pending.clear()
            listed = "; ".join(f"sample {batch.sample_ids[k]}: {detail}" for k, detail in list(bad.items())[:10])
            raise NonFiniteStatesError(
                f"{self.store.directory.name}: the extracted states of {len(bad)} sample(s) hold NaN or Inf ({listed}). "
                "Check the model and compute_dtype (float16 overflows where bfloat16 does not), or set "
                "extraction.nan_policy: quarantine to set such samples aside and go on"
            )
        records = [QuarantineRecord(batch.sample_ids[k], "non_finite_states", detail) for k, detail in bad.items()]
        self.store.quarantine(records)
        self.quarantined.extend(records)
        return batch.without(set(bad))

    def _write(self, batches: Sequence[HostBatch]) -> None:
        lengths = [length for batch in batches for length in batch.lengths]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        sample_ids = [sample_id for batch in batches for sample_id in batch.sample_ids]
        tensors = {name: torch.cat([b.tensors[name] for b in batches]) for name in batches[0].tensors}
        tensors["offsets"] = offsets
        tensors["sample_ids"] = torch.tensor(sample_ids, dtype=torch.int64)
        record = self.store.commit(tensors, sample_ids, self.metadata)
        self.bytes_written += record.bytes
        self.committed.append(record)


def read_index(directory: Path) -> list[ChunkRecord]:
    """Committed chunks; a torn last line (a crash while appending) is not a commit."""
    path = Path(directory) / INDEX_FILE
    try:
        return [ChunkRecord(**entry) for entry in _read_lines(path)]
    except TypeError as exc:
        raise StoreError(f"{path}: not a chunk record ({exc})") from None


def read_quarantine(directory: Path) -> list[QuarantineRecord]:
    return [QuarantineRecord(**entry) for entry in _read_lines(Path(directory) / QUARANTINE_FILE)]


def _read_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(keepends=True)):
        if not line.endswith("\n"):
            break  # the append never finished: what it recorded is redone
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise StoreError(f"{path}: line {number + 1} is not JSON ({exc})") from None
    return entries


def _append_lines(path: Path, entries: Sequence[dict]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(entry) + "\n" for entry in entries))
        handle.flush()
        os.fsync(handle.fileno())


def _drop_torn_tail(path: Path) -> None:
    """Rewrite a log without a half-appended last line, so the next append starts clean."""
    if path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        write_atomic(path, "".join(json.dumps(entry) + "\n" for entry in _read_lines(path)).encode())


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


def iter_shard_samples(directory: Path, dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor | int]]:
    """Every committed sample of a shard, in commit order, read through memory-mapped slices;
    states in ``dtype`` (default: as stored, bfloat16 for fp8), see `read_sample`."""
    directory = Path(directory)
    for record in read_index(directory):
        with safe_open(str(directory / record.chunk), framework="pt") as chunk:
            offsets = chunk.get_tensor("offsets").tolist()
            sample_ids = chunk.get_tensor("sample_ids").tolist()
            for k, sample_id in enumerate(sample_ids):
                yield {"sample_id": sample_id, **read_sample(chunk, offsets[k], offsets[k + 1], dtype=dtype)}


def read_sample(chunk, start: int, end: int, dtype: torch.dtype | None = None, raw: bool = False) -> dict[str, torch.Tensor]:
    """Tokens ``start:end`` of an open chunk (memory-mapped slices, nothing else is read).

    States come back in ``dtype``; by default as stored, except fp8, which is de-quantised to
    bfloat16 (exactly: see quantization.py). ``raw=True`` hands fp8 states out as stored with their
    ``*_scales`` beside them, for trainers that de-quantise on their own device.
    """
    names = set(chunk.keys())
    sample = {
        "input_ids": chunk.get_slice("input_ids")[start:end].to(torch.int64),
        "loss_mask": chunk.get_slice("loss_mask")[start:end],
    }
    for name in STATE_TENSORS:
        if name not in names:
            continue
        states = chunk.get_slice(name)[start:end]
        scales_name = name + SCALES_SUFFIX
        if scales_name in names:
            scales = chunk.get_slice(scales_name)[start:end]
            if raw:
                sample[scales_name] = scales
            else:
                states = dequantize(states, scales, dtype or torch.bfloat16)
        if dtype is not None and not raw:
            states = states.to(dtype)
        sample[name] = states
    return sample


def write_atomic(path: Path, payload: bytes) -> None:
    """Temporary name, flush, fsync, rename, fsync the folder: the file is whole or absent, and a
    failed write (a full disk) leaves no temporary behind."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(
                f"{path}: no space left on device writing {len(payload):,} bytes; free space under {path.parent} "
                "and run again (what was committed before is kept)"
            ) from exc
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "..."
