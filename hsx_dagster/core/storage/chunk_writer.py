"""The chunk writer: batches become safetensors chunks on a background thread, so the next batch
computes meanwhile; samples whose states hold NaN or Inf fail the run or are quarantined (nan_policy)."""

from __future__ import annotations

import queue
import threading
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hsx_dagster.core.choices import NanPolicy
from hsx_dagster.core.storage.atomic import StoreError
from hsx_dagster.core.storage.chunk_stats import chunk_statistics
from hsx_dagster.core.storage.shard_store import ChunkRecord, QuarantineRecord, ShardStore

NAN_POLICIES: tuple[str, ...] = typing.get_args(NanPolicy)


class NonFiniteStatesError(RuntimeError):
    """Extracted states hold NaN or Inf; the message names the samples and layers."""


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
    ready: Any = None  # a CUDA event to wait on before reading the host tensors

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
        nan_policy: NanPolicy = "fail",
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
        self.bytes_submitted = 0  # host bytes of the batches handed over
        self.bytes_flushed = 0  # ... of those written into committed chunks, in write_s seconds
        self.write_s = 0.0
        self._queue: queue.Queue[HostBatch | None] = queue.Queue(maxsize=queue_depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hsx-chunk-writer", daemon=True)
        self._thread.start()

    def submit(self, batch: HostBatch) -> None:
        self._raise_if_failed()
        self.bytes_submitted += batch.nbytes
        while True:
            try:
                self._queue.put(batch, timeout=1.0)
                return
            except queue.Full:
                self._raise_if_failed()

    def flush_s(self) -> float:
        """About how long writing what is handed over and not written yet will take, at the pace of the chunks
        written so far; 0 before the first chunk (nothing measured yet)."""
        if not self.bytes_flushed:
            return 0.0
        return max(self.bytes_submitted - self.bytes_flushed, 0) * self.write_s / self.bytes_flushed

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
        # fights the forward pass for the cores and slows it down. The
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
                f"{self.store.directory.name}: the extracted states of {len(bad)} sample(s) hold NaN or Inf "
                f"({listed}). "
                "Check the model and compute_dtype (float16 overflows where bfloat16 does not), or set "
                "extraction.nan_policy: quarantine to set such samples aside and go on"
            )
        records = [QuarantineRecord(batch.sample_ids[k], "non_finite_states", detail) for k, detail in bad.items()]
        self.store.quarantine(records)
        self.quarantined.extend(records)
        return batch.without(set(bad))

    def _write(self, batches: Sequence[HostBatch]) -> None:
        started = time.perf_counter()
        lengths = [length for batch in batches for length in batch.lengths]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        sample_ids = [sample_id for batch in batches for sample_id in batch.sample_ids]
        tensors = {name: torch.cat([b.tensors[name] for b in batches]) for name in batches[0].tensors}
        tensors["offsets"] = offsets
        tensors["sample_ids"] = torch.tensor(sample_ids, dtype=torch.int64)
        # computed here, once, while the states are in memory: the numerics checks add these up (chunk_stats.py)
        stats = chunk_statistics(tensors, offsets, sample_ids)
        record = self.store.commit(tensors, sample_ids, self.metadata, stats)
        self.bytes_written += record.bytes
        self.committed.append(record)
        self.bytes_flushed += sum(batch.nbytes for batch in batches)
        self.write_s += time.perf_counter() - started
