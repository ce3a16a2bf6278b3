"""The extraction engine: batched forward passes over one shard, tensors kept on the device until one
copy per batch, chunk writing overlapped with compute, resumable, and out-of-memory tolerant.

Per batch: right-pad the rows (real tokens first, so a causal model's real positions never see the
padding), run the truncated backbone once, gather the real tokens of every captured layer into one
flat ``[tokens, layers, hidden]`` tensor in the storage dtype *on the device*, and copy it to the
host once (pinned memory, non-blocking). With fp8 storage the states are quantised on the device
too, so the copy is half as big. Per-token NaN/Inf flags travel with the batch, so screening them
costs no synchronisation. A background thread turns batches into chunks while the next batch computes.

Batches are cut one at a time from the pending samples, longest first, in the shape `BatchShaper`
gives (batch_shape.py): the user's numbers, or with ``auto`` the fastest shape a short probe on the
shard's own first batches found.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import torch

from hsx_dagster.core.extraction.backbone import Backbone
from hsx_dagster.core.extraction.batch_run import run_batch
from hsx_dagster.core.extraction.batch_shape import BUDGET_FRACTION, BatchShaper, Shape
from hsx_dagster.core.extraction.batch_shape_summary import BatchShapeSummary
from hsx_dagster.core.extraction.batching import Batch, LengthOrder, plan_batches
from hsx_dagster.core.extraction.host_path import HostPath
from hsx_dagster.core.extraction.progress import Progress, TimeLeft, progress_logger
from hsx_dagster.core.extraction.replay import Replay, covered, plan_replays
from hsx_dagster.core.extraction.timing import LapTimer
from hsx_dagster.core.settings import ExtractionSettings
from hsx_dagster.core.storage.chunk_writer import ChunkWriter, StagedBatch
from hsx_dagster.core.storage.cpu_account import CpuAccount
from hsx_dagster.core.storage.format import STORAGE_DTYPES
from hsx_dagster.core.storage.shard_store import ShardStore

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 5.0


@dataclass
class ExtractionReport:
    shard: str
    samples_total: int
    samples_skipped: int  # already committed by an earlier run
    samples: int  # extracted by this run
    tokens: int
    computed_tokens: int
    batches: int
    chunks: list[str]
    bytes_written: int
    elapsed_s: float
    forward_s: float
    oom_splits: int
    final_max_batch_tokens: int
    peak_memory_bytes: int
    device: str
    quarantined: list[dict]  # samples set aside by this run, with the reason
    final_batch_size: int = 0  # rows cap in use at the end
    batch_shape: BatchShapeSummary | None = None  # how the shape was chosen (None: nothing was extracted)
    host_cpu_s: dict[str, float] = field(default_factory=dict)  # CPU-seconds by part (cpu_account.py)
    process_cpu_s: float = 0.0  # the process's CPU time over the extraction (the parts add up to it)
    direct_io: str = ""  # how chunk files were written, in words (direct_io.py)
    chunks_direct: int = 0  # of this run's chunks, written with O_DIRECT

    @property
    def host_cpu_s_per_gb(self) -> dict[str, float]:
        """CPU-seconds per GB stored by this run, by part."""
        gb = self.bytes_written / 1e9
        return {part: round(seconds / gb, 4) for part, seconds in self.host_cpu_s.items()} if gb else {}

    @classmethod
    def nothing_to_do(cls, shard: str, samples_total: int, device: torch.device) -> ExtractionReport:
        return cls(shard, samples_total, samples_total, 0, 0, 0, 0, [], 0, 0.0, 0.0, 0, 0, 0, str(device), [])

    @classmethod
    def from_dict(cls, data: dict) -> ExtractionReport:
        """A report as `to_dict` wrote it (complete.json's ``last_run``)."""
        fields = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        shape = fields.get("batch_shape")
        fields["batch_shape"] = BatchShapeSummary.from_dict(shape) if shape else None
        return cls(**fields)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def padding_efficiency(self) -> float:
        return self.tokens / self.computed_tokens if self.computed_tokens else 1.0

    @property
    def forward_share(self) -> float:
        return self.forward_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def probe_share(self) -> float:
        """Time lost to the batch shape probes' slower shapes, as a share of the run."""
        lost = self.batch_shape.probe_overhead_s if self.batch_shape else 0.0
        return lost / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "batch_shape": self.batch_shape.to_dict() if self.batch_shape else {},
            "samples_per_s": round(self.samples_per_s, 2),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "padding_efficiency": round(self.padding_efficiency, 4),
            "forward_share": round(self.forward_share, 4),
            "probe_share": round(self.probe_share, 4),
            "host_cpu_s_per_gb": self.host_cpu_s_per_gb,
        }


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def extract_shard(
    shard: str,
    samples: pa.Table,
    backbone: Backbone,
    store: ShardStore,
    extraction: ExtractionSettings,
    metadata: dict[str, str],
    *,
    pad_token_id: int = 0,
    probe_budget: float = BUDGET_FRACTION,
    progress_every_s: float = PROGRESS_EVERY_S,
    log_line: Callable[[str], None] | None = None,
    pending: np.ndarray | None = None,
    on_batch_progress: Callable[[Progress], None] | None = None,
) -> ExtractionReport:
    """Extract every sample of ``samples`` (columns sample_id, input_ids, loss_mask, num_tokens) that
    the store has not committed yet (``pending``, a row mask, when the caller has it already), shaped,
    stored and screened as ``extraction`` says; ``metadata`` goes into every chunk's header.
    ``probe_budget``: the share of the run the batch shape probes may cost. ``log_line`` takes the run's
    messages (default: the log). ``on_batch_progress`` gets a `Progress` after every batch, in place of the
    progress line logged every ``progress_every_s``. Returns what this run did."""
    log_line, started = log_line or log.info, time.perf_counter()
    device = next(backbone.model.parameters()).device
    storage_dtype = STORAGE_DTYPES[extraction.storage_dtype]
    _reset_peak_memory(device)
    rows = _Rows.of(samples, store, pending)
    if rows.to_extract < rows.total:
        log_line(f"{shard}: resuming, {rows.total - rows.to_extract} of {rows.total} samples already committed")
    lengths = rows.lengths[rows.todo]
    order = LengthOrder(lengths)
    shaper = BatchShaper(extraction.batch_size, extraction.max_batch_tokens, device, order,
                         budget_fraction=probe_budget, log_line=log_line, shard=shard)  # fmt: skip
    retry: deque[Batch] = deque()  # pieces of a batch that ran out of memory, run before the next cut
    timer, counts = LapTimer(device), _Counts()
    show_progress = on_batch_progress or progress_logger(log_line, progress_every_s, shaper)
    time_left = TimeLeft(order, retry, shaper, lengths)

    def run(table_rows: np.ndarray, keep: np.ndarray | None, measured: bool) -> StagedBatch:
        staged = writer.stage(rows.ids[table_rows].tolist(), rows.lengths[table_rows].tolist(), keep)
        try:
            run_batch(backbone, table_rows, rows.input_ids, rows.loss_mask, staged, storage_dtype, pad_token_id, timer,
                       measured, cpu)  # fmt: skip
        except BaseException:
            writer.abandon(staged)
            raise
        return staged

    def progress_after_batch() -> None:
        show_progress(
            Progress(
                shard=shard, samples_done=counts.samples, samples_total=rows.to_extract, tokens_done=counts.tokens,
                tokens_total=rows.tokens_to_extract, bytes_written=writer.bytes_written,
                elapsed_s=time.perf_counter() - started, forward_s=timer.total(), device=str(device),
                samples_resumed=rows.total - rows.to_extract, loop_left_s=time_left.left_s,
                after_loop_s=writer.flush_s(),
            )
        )  # fmt: skip

    cpu = CpuAccount.started()
    with cpu.thread("main_loop"), HostPath(store, backbone.info, extraction, metadata, device, cpu) as host:
        writer = host.writer
        _replay(rows.replays, run, writer, counts, time_left, progress_after_batch, shard, device, log_line)
        while retry or len(order):
            host.size_threads()
            batch, shape, measured = _next_batch(retry, shaper, order)
            try:
                staged = run(rows.todo[list(batch.rows)], None, measured)
            except Exception as error:  # only out-of-memory is recoverable here
                pieces = _split_after_out_of_memory(error, shard, batch, shape, shaper, lengths, device, log_line)
                retry.extendleft(reversed(pieces))
                counts.oom_splits += 1
                continue
            _record_shape(shaper, shape, batch, timer)
            writer.submit(staged)
            del staged  # its ring may be replaced by the next stage (a larger batch): hold no reference to it
            counts.add(len(batch.rows), batch.real_tokens, batch.computed_tokens)
            time_left.after(batch)
            progress_after_batch()
    report = _report_of(shard, rows.total, rows.to_extract, counts, writer, timer, shaper, device, started)
    return _with_host_figures(report, cpu, host.direct_io, store.chunks_direct)


@dataclass
class _Rows:
    """The shard's samples as the loop reads them, and what this run extracts of them: the rows of ``todo`` (in the
    table) in batches cut as they come, and the batches to run again exactly as they first ran (replay.py)."""

    ids: np.ndarray
    lengths: np.ndarray
    input_ids: pa.ListArray
    loss_mask: pa.ListArray
    todo: np.ndarray
    replays: list[Replay]

    @classmethod
    def of(cls, samples: pa.Table, store: ShardStore, pending: np.ndarray | None) -> _Rows:
        ids = samples.column("sample_id").to_numpy()
        pending = store.pending_mask(ids) if pending is None else np.asarray(pending, dtype=bool)
        replays = plan_replays(store.directory, ids, pending)
        todo = np.flatnonzero(pending & ~covered(replays, len(ids)))
        columns = (samples.column(name).combine_chunks() for name in ("input_ids", "loss_mask"))
        lengths = samples.column("num_tokens").to_numpy().astype(np.int64)
        input_ids, loss_mask = columns
        return cls(ids, lengths, input_ids, loss_mask, todo, replays)

    @property
    def total(self) -> int:
        return len(self.ids)

    @property
    def to_extract(self) -> int:
        return len(self.todo) + sum(int(replay.keep.sum()) for replay in self.replays)

    @property
    def tokens_to_extract(self) -> int:
        replayed = sum(int(self.lengths[replay.rows[replay.keep]].sum()) for replay in self.replays)
        return int(self.lengths[self.todo].sum()) + replayed


def _replay(replays, run, writer, counts, time_left, progress_after_batch, shard, device, log_line) -> None:
    """Run the logged batches that hold pending samples again, whole, storing only those (replay.py); one the
    device cannot hold any more is halved (the same samples, not the same batches: their last bits may differ)."""
    waiting = deque(replays)
    if waiting:
        log_line(f"{shard}: forming {len(waiting)} batches again that were cut into chunks not all committed")
    while waiting:
        replay = waiting.popleft()
        try:
            staged = run(replay.rows, replay.keep, False)
        except Exception as error:
            if not is_out_of_memory(error) or len(replay.rows) == 1:
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            waiting.extendleft(reversed(replay.halves()))
            counts.oom_splits += 1
            continue
        time_left.shaper.record_unplanned()
        time_left.restart()
        writer.submit(staged)
        lengths = staged.lengths
        del staged  # as in the main loop
        kept = [n for n, k in zip(lengths, replay.keep) if k]
        counts.add(len(kept), sum(kept), len(lengths) * max(lengths))
        progress_after_batch()


def _next_batch(retry: deque[Batch], shaper: BatchShaper, order: LengthOrder) -> tuple[Batch, Shape | None, bool]:
    """The pieces of a batch that ran out of memory first (unplanned, not timed), else the shaper's next cut."""
    if retry:
        return retry.popleft(), None, False
    shape, measured = shaper.next_shape()
    return order.take(shape.batch_size, shape.max_batch_tokens), shape, measured


def _record_shape(shaper: BatchShaper, shape: Shape | None, batch: Batch, timer: LapTimer) -> None:
    """Tells the shaper what the batch took; a piece of a split batch (no shape) is not timed."""
    if shape is None:
        shaper.record_unplanned()
    else:
        assert timer.last is not None
        shaper.record(batch, timer.last)


@dataclass
class _Counts:
    """What a run has extracted so far."""

    samples: int = 0
    tokens: int = 0  # real tokens
    computed: int = 0  # tokens the forward passes computed, padding included
    batches: int = 0
    oom_splits: int = 0

    def add(self, samples: int, real_tokens: int, computed_tokens: int) -> None:
        self.samples += samples
        self.tokens += real_tokens
        self.computed += computed_tokens
        self.batches += 1


def _report_of(
    shard: str,
    total: int,
    todo: int,
    counts: _Counts,
    writer: ChunkWriter,
    timer: LapTimer,
    shaper: BatchShaper,
    device: torch.device,
    started: float,
) -> ExtractionReport:
    return ExtractionReport(
        shard=shard,
        samples_total=total,
        samples_skipped=total - todo,
        samples=counts.samples,
        tokens=counts.tokens,
        computed_tokens=counts.computed,
        batches=counts.batches,
        chunks=[record.chunk for record in writer.committed],
        bytes_written=writer.bytes_written,
        elapsed_s=time.perf_counter() - started,
        forward_s=timer.total(),
        oom_splits=counts.oom_splits,
        final_max_batch_tokens=shaper.current.max_batch_tokens,
        peak_memory_bytes=_peak_memory(device),
        device=str(device),
        quarantined=[asdict(record) for record in writer.quarantined],
        final_batch_size=shaper.current.batch_size,
        batch_shape=shaper.summary(),
    )


def _with_host_figures(
    report: ExtractionReport, cpu: CpuAccount, direct_io: str, chunks_direct: int
) -> ExtractionReport:
    """The report with where the host's CPU time went, by part, and how the chunk files were written."""
    cpu.stop()
    report.host_cpu_s = {part: round(seconds, 4) for part, seconds in cpu.seconds.items()}
    report.process_cpu_s = round(cpu.process_s, 4)
    report.direct_io, report.chunks_direct = direct_io, chunks_direct
    return report


def _split_after_out_of_memory(
    error: Exception,
    shard: str,
    batch: Batch,
    shape: Shape | None,
    shaper: BatchShaper,
    lengths: np.ndarray,
    device: torch.device,
    log_line: Callable[[str], None],
) -> list[Batch]:
    """The pieces to run instead of a batch that raised ``error``, under the token budget the shaper lowers;
    any other error, or a single sample that does not fit, is raised."""
    if not is_out_of_memory(error):
        raise error
    if len(batch.rows) == 1:
        raise RuntimeError(
            f"{shard}: out of memory on a single sample of {batch.longest} tokens; "
            "lower dataset.max_length or use a device with more memory"
        ) from error
    if device.type == "cuda":
        torch.cuda.empty_cache()
    budget = shaper.out_of_memory(batch, shape or Shape(len(batch.rows), batch.computed_tokens))
    log_line(
        f"{shard}: out of memory on a batch of {len(batch.rows)} rows x {batch.longest} tokens; "
        f"split it and lowered max_batch_tokens to {budget} for the rest of the run"
    )
    return _split(batch, lengths, budget)


def _split(batch: Batch, lengths: np.ndarray, budget: int) -> list[Batch]:
    """The rows of a failed batch as at least two smaller batches."""
    rows = np.asarray(batch.rows)
    return _plan_rows(rows, lengths, max(1, len(rows) // 2), budget)


def _plan_rows(rows: np.ndarray, lengths: np.ndarray, batch_size: int, budget: int) -> list[Batch]:
    planned = plan_batches(lengths[rows], batch_size, budget)
    return [Batch(tuple(int(rows[i]) for i in b.rows), b.longest, b.real_tokens) for b in planned]


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
