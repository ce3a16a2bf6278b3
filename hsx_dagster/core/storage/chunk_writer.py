"""The chunk writer: batches staged in host memory become chunk files on a background thread, so the device works
on the next batch meanwhile; samples whose states hold NaN or Inf fail the run or are quarantined (nan_policy).

Per byte of states the host does one write and one hash (chunk_file.py) and nothing else: the device has already
copied the batch into the staging ring (staging.py) in the stored layout, and has reduced it to per-token sums,
sums of squares and non-finite flags (computed where the states are, before the copy). The writer only adds those
up per chunk (a chunk's statistics, kept in its index record for the numerics checks: chunk_stats.py) and screens
the flags.

Chunks hold whole batches and at most ``chunk_bytes``: only a batch larger than that is cut, between samples, into
several chunks (a single sample larger than a chunk makes a chunk of its own). Chunks that end between batches are
what makes a resumed run bit-identical to an uninterrupted one: the samples it redoes form the same batches again.

The host memory a run holds is the ring's: at most the larger of `MIN_HOST_BYTES` and three of the largest batch,
whatever ``chunk_bytes`` is; a larger ``chunk_bytes`` gives chunks as large as that allows.
"""

from __future__ import annotations

import queue
import threading
import time
import typing
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hsx_dagster.core.settings.choices import NanPolicy
from hsx_dagster.core.storage.atomic import StoreError
from hsx_dagster.core.storage.chunk_file import ChunkTensor
from hsx_dagster.core.storage.chunk_stats import STAT_TENSORS, chunk_statistics_of, nonfinite_samples
from hsx_dagster.core.storage.cpu_account import CpuAccount
from hsx_dagster.core.storage.shard_store import ChunkRecord, QuarantineRecord, ShardStore
from hsx_dagster.core.storage.staging import RowSpec, Span, StagingRing

NAN_POLICIES: tuple[str, ...] = typing.get_args(NanPolicy)
MIN_HOST_BYTES = 1_500_000_000  # host memory a run may always hold for staging (and three batches when larger)
RING_SHARE = 0.9  # of that, for the ring: the rest is left for the writer's own small arrays
_FLUSH = "flush"  # asks the writer thread to commit its pending chunk now


class NonFiniteStatesError(RuntimeError):
    """Extracted states hold NaN or Inf; the message names the samples and layers."""


@dataclass
class StagedBatch:
    """One batch's rows in the staging ring: samples in the order of ``sample_ids``, token-major."""

    sample_ids: list[int]
    lengths: list[int]
    ring: StagingRing
    span: Span
    ready: Any = None  # a CUDA event to wait on before the host reads the rows
    keep: list[bool] | None = None  # which samples to store (a batch run again stores only its pending ones)

    @property
    def views(self) -> dict[str, torch.Tensor]:
        return self.ring.views(self.span.start, self.span.stop)

    @property
    def tokens(self) -> int:
        return self.span.stop - self.span.start


@dataclass
class _Run:
    """Rows ``start:stop`` of a ring that go into the pending chunk, reserved by spans ``first..last``."""

    ring: StagingRing
    first: int
    last: int
    start: int
    stop: int


@dataclass
class _Pending:
    runs: list[_Run] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    rows: int = 0

    def add(self, batch: StagedBatch, row: int, length: int, sample_id: int) -> None:
        last = self.runs[-1] if self.runs else None
        if last is not None and last.ring is batch.ring and last.stop == row:
            last.stop, last.last = row + length, batch.span.number
        else:
            self.runs.append(_Run(batch.ring, batch.span.number, batch.span.number, row, row + length))
        self.sample_ids.append(sample_id)
        self.lengths.append(length)
        self.rows += length


class ChunkWriter:
    """Writes staged batches into chunks on a background thread.

    `stage` reserves a batch's rows (waiting while the ring is full: that is what holds the device back when
    writing falls behind), `submit` hands the filled rows over. A failure on the writer thread is raised in the
    caller at the next `stage`, `submit` or `close`.
    """

    def __init__(
        self,
        store: ShardStore,
        row_specs: dict[str, RowSpec],
        chunk_bytes: int,
        metadata: dict[str, str],
        hasher: Executor,
        *,
        nan_policy: NanPolicy = "fail",
        slot_names: Sequence[str] = (),
        pin_memory: bool = False,
        direct: bool = False,
        cpu: CpuAccount | None = None,
    ) -> None:
        """``direct``: chunk files written with O_DIRECT from the ring (buffered where the file system refuses it);
        ``cpu``: where the writer's and the hashing thread's CPU time are added, by part."""
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, not {nan_policy!r}")
        self.store, self.metadata, self.hasher = store, metadata, hasher
        self.file_specs = dict(row_specs)  # what each chunk stores per token
        self.slot_names = list(slot_names)
        self.specs = {**self.file_specs, **statistics_specs(len(self.slot_names))}  # ... and what the ring carries
        self.chunk_bytes, self.nan_policy, self.pin_memory = chunk_bytes, nan_policy, pin_memory
        self.direct, self.cpu = direct, cpu or CpuAccount()
        self.ring: StagingRing | None = None
        self.batch_rows = 0  # the largest batch the ring is sized for
        self.chunk_rows = 0  # tokens in a full chunk
        self.quarantined: list[QuarantineRecord] = []
        self.committed: list[ChunkRecord] = []
        self.bytes_written = 0
        self.bytes_submitted = 0  # stored bytes of the batches handed over
        self.bytes_flushed = 0  # ... of those written into committed chunks, in write_s seconds
        self.write_s = 0.0
        self._pending = _Pending()
        self._taken: tuple[StagingRing, int, int] | None = None  # ring, span and end of the last batch taken
        self._queue: queue.Queue[StagedBatch | str | None] = queue.Queue()
        self._idle = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hsx-chunk-writer", daemon=True)
        self._thread.start()

    @property
    def file_row_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.file_specs.values())

    def stage(self, sample_ids: Sequence[int], lengths: Sequence[int], keep: np.ndarray | None = None) -> StagedBatch:
        """Rows for a batch of ``lengths`` tokens per sample, to fill (``views``) and then `submit`; ``keep``: which
        samples to store (all by default)."""
        self._raise_if_failed()
        tokens = int(sum(lengths))
        if self.ring is None or tokens > self.batch_rows:
            self._resize(tokens)
        assert self.ring is not None
        span = self.ring.reserve(tokens, waiting=self._waiting)
        return StagedBatch(
            list(sample_ids), list(lengths), self.ring, span, keep=None if keep is None else keep.tolist()
        )

    def submit(self, batch: StagedBatch) -> None:
        self._raise_if_failed()
        self.bytes_submitted += batch.tokens * self.file_row_bytes
        self._queue.put(batch)

    def abandon(self, batch: StagedBatch) -> None:
        """Give back the rows of a batch that will not be filled (its forward pass failed): they are released in
        their turn, after the batches before them are written."""
        self._queue.put(StagedBatch([], [], batch.ring, batch.span))

    def flush_s(self) -> float:
        """About how long writing what is handed over and not written yet will take, at the pace of the chunks
        written so far; 0 before the first chunk (nothing measured yet)."""
        if not self.bytes_flushed:
            return 0.0
        return max(self.bytes_submitted - self.bytes_flushed, 0) * self.write_s / self.bytes_flushed

    def close(self) -> list[ChunkRecord]:
        """Commit what is pending as a last chunk and stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_if_failed()
        return self.committed

    @property
    def host_bytes(self) -> int:
        """The host memory the staging ring holds."""
        return self.ring.nbytes if self.ring is not None else 0

    # --- the caller's side ------------------------------------------------------------------------
    def _resize(self, tokens: int) -> None:
        """A ring for batches of up to ``tokens`` (and some room to grow within the memory floor), once every row
        of the old one is written: the pending chunk is committed first (a shorter chunk, once per resize)."""
        old = self.ring
        if old is not None:
            self._queue.put(_FLUSH)
            while not old.empty:
                self._raise_if_failed()
                time.sleep(0.005)
        row_bytes = sum(spec.nbytes for spec in self.specs.values())
        floor_rows = int(MIN_HOST_BYTES * RING_SHARE) // row_bytes
        # room for two doublings of the batch within the floor: the probe's larger shapes do not resize the ring
        self.batch_rows = max(tokens, min(4 * tokens, floor_rows // 3))
        allowed_rows = max(floor_rows, int(3 * self.batch_rows * row_bytes * RING_SHARE) // row_bytes)
        asked_rows = max(1, self.chunk_bytes // self.file_row_bytes)
        rows = max(min(allowed_rows, asked_rows + 2 * self.batch_rows), 3 * tokens)
        self.chunk_rows = max(1, min(asked_rows, rows - 2 * self.batch_rows))
        old = self.ring = None  # the old ring's memory goes before the new one is allocated
        if self.pin_memory:
            _empty_host_cache()
        self.ring = StagingRing(self.specs, rows, pin=self.pin_memory)

    def _waiting(self) -> None:
        """While `stage` waits for rows: fail with the writer, and when the writer is idle with rows held by a
        pending chunk (the ring can hold less than a chunk and two batches), have it commit that chunk now."""
        self._raise_if_failed()
        if self._idle.is_set() and self._pending.rows and self._queue.empty():
            self._queue.put(_FLUSH)

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, NonFiniteStatesError):
            raise self._error
        if self._error is not None:
            raise StoreError(f"writing hidden states to {self.store.directory} failed: {self._error}") from self._error

    # --- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        with self.cpu.thread("writer_loop"):
            self._loop()

    def _loop(self) -> None:
        try:
            while True:
                self._idle.set()
                item = self._queue.get()
                self._idle.clear()
                if item is None:
                    break
                if item == _FLUSH:
                    self._commit_pending()
                elif isinstance(item, StagedBatch):
                    self._take(item)
            self._commit_pending()
        except BaseException as exc:  # reported to the caller thread; nothing half-written stays
            self._error = exc
            if self.ring is not None:  # unblock a caller waiting for rows
                self.ring.release(2**62, 0)

    def _take(self, batch: StagedBatch) -> None:
        if batch.ready is not None:
            with self.cpu.part("copy_wait"):
                batch.ready.synchronize()  # the device-to-host copy of this batch has landed
        with self.cpu.part("statistics"):
            flags = batch.views["token_nonfinite"].numpy() if batch.sample_ids else np.zeros((0, 1), dtype=bool)
            bad = nonfinite_samples(flags, batch.lengths, self.slot_names)
        bad = {k: detail for k, detail in bad.items() if batch.keep is None or batch.keep[k]}  # others are done
        if bad:
            self._set_aside(batch, bad)
        stored = [k not in bad and (batch.keep is None or batch.keep[k]) for k in range(len(batch.lengths))]
        kept = sum(length for length, store in zip(batch.lengths, stored) if store)
        if self._pending.rows + kept > self.chunk_rows:
            self._commit_pending()  # chunks end between batches: a batch formed again after a crash is the same batch
        if kept > self.chunk_rows and sum(stored) > 1:
            self.store.log_split_batch(batch.sample_ids)  # before a chunk holds a part of it (replay.py)
        row = batch.span.start
        for position, (sample_id, length) in enumerate(zip(batch.sample_ids, batch.lengths)):
            if stored[position]:
                if self._pending.rows and self._pending.rows + length > self.chunk_rows:
                    self._commit_pending()  # only a batch larger than a chunk is cut, between samples
                self._pending.add(batch, row, length, sample_id)
            row += length
        if self._pending.rows >= self.chunk_rows:
            self._commit_pending()
        self._taken = (batch.ring, batch.span.number, batch.span.stop)
        self._release_written()

    def _release_written(self) -> None:
        """Free the rows before the pending chunk's (written, or of samples set aside), or all rows taken so far."""
        if self._pending.runs:
            first = self._pending.runs[0]
            first.ring.release(first.first, first.start)
        elif self._taken is not None:
            ring, number, stop = self._taken
            ring.release(number, stop)
            self._taken = None  # every row taken is released: no reference left to a ring being replaced

    def _set_aside(self, batch: StagedBatch, bad: dict[int, str]) -> None:
        if self.nan_policy == "fail":
            self._commit_pending()  # keep what was extracted fine before this batch
            listed = "; ".join(f"sample {batch.sample_ids[k]}: {detail}" for k, detail in list(bad.items())[:10])
            raise NonFiniteStatesError(
                f"{self.store.directory.name}: the extracted states of {len(bad)} sample(s) hold NaN or Inf "
                f"({listed}). "
                "Check the model and compute_dtype (float16 overflows where bfloat16 does not), or set "
                "extraction.nan_policy: quarantine to set such samples aside and go on"
            )
        records = [QuarantineRecord(batch.sample_ids[k], "non_finite_states", detail) for k, detail in bad.items()]
        self.store.quarantine(records)
        self.quarantined.extend(records)

    def _commit_pending(self) -> None:
        pending = self._pending
        if not pending.runs:
            return
        started = time.perf_counter()
        with self.cpu.part("serialisation"):
            tensors = self._chunk_tensors(pending)
        with self.cpu.part("statistics"):
            stats = chunk_statistics_of(
                [run.ring.views(run.start, run.stop) for run in pending.runs], self.slot_names, pending.rows
            )
        record = self.store.commit(
            tensors, pending.sample_ids, self.metadata, stats, self.hasher, direct=self.direct, cpu=self.cpu
        )
        last = pending.runs[-1]
        self._pending = _Pending()
        last.ring.release(last.last, last.stop)
        self._release_written()
        self.bytes_written += record.bytes
        self.committed.append(record)
        self.bytes_flushed += pending.rows * self.file_row_bytes
        self.write_s += time.perf_counter() - started

    def _chunk_tensors(self, pending: _Pending) -> list[ChunkTensor]:
        """The pending chunk's tensors: its rows of the ring (no copy), its offsets and sample ids."""
        tensors = [
            ChunkTensor(
                name,
                spec.dtype,
                spec.shape,
                tuple(run.ring.buffers[name][run.start : run.stop] for run in pending.runs),
            )
            for name, spec in self.file_specs.items()
        ]
        offsets = np.zeros(len(pending.lengths) + 1, dtype=np.int64)
        np.cumsum(pending.lengths, out=offsets[1:])
        tensors.append(ChunkTensor.whole("offsets", torch.from_numpy(offsets)))
        tensors.append(ChunkTensor.whole("sample_ids", torch.tensor(pending.sample_ids, dtype=torch.int64)))
        return tensors


def _empty_host_cache() -> None:
    """Hand freed pinned memory back (PyTorch keeps it cached for reuse otherwise: an old ring would stay)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)  # torch >= 2.9
    if empty is not None:
        empty()


def statistics_specs(slots: int) -> dict[str, RowSpec]:
    """The per-token reductions the device adds to each batch's rows (chunk_stats.py): carried, never stored."""
    shapes = {"token_sum": torch.float32, "token_sum_of_squares": torch.float32, "token_nonfinite": torch.bool}
    assert tuple(shapes) == STAT_TENSORS
    return {name: RowSpec((slots,), dtype) for name, dtype in shapes.items()}
