"""One file per row of a drafter dataset (SpecForge's ``.ckpt``, speculators' ``file`` layout), written by a pool of
workers, each batch of files made durable by one sync, every file atomic, a re-run writing only the missing ones.

A worker writes each file of its batch under a hidden temporary name, then makes the batch durable at once
(``syncfs`` of the file system: one flush of the journal for the batch, where an fsync per file costs a journal
commit per file: 3 ms a file on this project's disk, 50 minutes at 10^6 files), then renames the files to their names
and fsyncs each folder once. So a file exists under its name only once its bytes are on disk: a crash leaves whole
files and temporaries, and a re-run skips the whole files and writes the rest (a temporary is written again).

Workers are processes (``spawn``: none inherits the threads of a Dagster step), one per core the process may use:
rendering a row is mostly Python (index lookup, slicing, pickling) that holds the GIL. Measured on this project's
2-core machine, quiet, on the 20,000 files of the scale run's SpecForge export (benchmarks/cpu/export_pool.py): one
process 22.0 s, two threads 19.6 s, two processes 17.0 s with their start (each imports torch: a few seconds), so
exports of fewer than IN_PROCESS_BELOW rows are written in-process. ``kind="thread"`` is there to measure again.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import torch

from hsx_dagster.core.dataset.reader import DrafterDataset
from hsx_dagster.core.storage.files import fsync_path

ROWS_PER_BATCH = 256  # files made durable by one sync
IN_PROCESS_BELOW = 4096  # rows: fewer are not worth the worker processes' start
# Rows read between two closes of the dataset's chunks: a row's reads fault in (and read ahead) MBs of its chunk's
# mapping, resident until the chunk is let go (measured: 256 rows held 250 MB per worker at the peak, 32 rows 90 MB;
# reopening a chunk costs a header read)
CLOSE_EVERY_ROWS = 32
POOL_KINDS = ("process", "thread", "inline")


class RowWriter(Protocol):
    """What one row's file holds and where it goes; picklable (sent to worker processes)."""

    @property
    def drafter_dir(self) -> Path: ...

    def path(self, row: int) -> Path: ...

    def write(self, sample: dict, handle: BinaryIO) -> None: ...


@dataclass(frozen=True)
class PoolResult:
    written: int  # files written by this call
    kept: int  # files already whole (an interrupted run's)
    workers: int
    kind: str


def default_workers() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def write_rows(
    writer: RowWriter,
    indices: np.ndarray,
    *,
    workers: int | None = None,
    kind: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> PoolResult:
    """File ``writer.path(row)`` for every row, from dataset sample ``indices[row]``; rows already whole are kept.
    ``progress(done, total)`` after each batch."""
    workers = workers or default_workers()
    if kind == "auto":
        kind = "inline" if len(indices) < IN_PROCESS_BELOW or workers == 1 else "process"
    if kind not in POOL_KINDS:
        raise ValueError(f"kind must be one of {POOL_KINDS} or auto, not {kind!r}")
    batches = [
        (start, np.asarray(indices[start : start + ROWS_PER_BATCH], dtype=np.int64))
        for start in range(0, len(indices), ROWS_PER_BATCH)
    ]
    written = kept = done = 0
    with _executor(kind, workers) as pool:
        for result in _bounded(pool, writer, batches, 2 * workers):
            written, kept, done = written + result[0], kept + result[1], done + result[0] + result[1]
            if progress:
                progress(done, len(indices))
    _datasets.value = None  # in-process: the chunks it opened are closed with it
    return PoolResult(written, kept, 1 if kind == "inline" else workers, kind)


def _bounded(pool: Executor, writer: RowWriter, batches: list, in_flight: int) -> Iterator[tuple[int, int]]:
    """Each batch's (written, kept) as it finishes; at most ``in_flight`` batches submitted at once (bounded memory)."""
    pending: set[Future] = set()
    for start, indices in batches:
        if len(pending) >= in_flight:
            finished, pending = wait(pending, return_when="FIRST_COMPLETED")
            yield from (future.result() for future in finished)
        pending.add(pool.submit(write_batch, writer, start, indices))
    for future in pending:
        yield future.result()


class _Inline(Executor):
    def submit(self, fn, /, *args, **kwargs):
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller by result()
            future.set_exception(exc)
        return future


def _executor(kind: str, workers: int) -> Executor:
    if kind == "process":
        return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_one_thread)
    if kind == "thread":
        return ThreadPoolExecutor(workers, thread_name_prefix="hsx-export")
    return _Inline()


def _one_thread() -> None:
    torch.set_num_threads(1)  # one core per worker process: the pool is the parallelism


_datasets = threading.local()


def _dataset(drafter_dir: Path) -> DrafterDataset:
    """The dataset, opened once per worker process or thread (its open chunks are its own)."""
    cached = getattr(_datasets, "value", None)
    if cached is None or cached.path != Path(drafter_dir):
        cached = DrafterDataset(drafter_dir)
        _datasets.value = cached
    return cached


def write_batch(writer: RowWriter, start: int, indices: np.ndarray) -> tuple[int, int]:
    """Rows ``start`` .. ``start + len(indices) - 1``: each missing file written under a temporary name, the batch
    synced once, then renamed into place. Returns (written, kept)."""
    dataset = _dataset(writer.drafter_dir)
    temporaries: list[tuple[Path, Path]] = []
    # A row's tensors are small: an OpenMP team per op only spins (768 rows in-process: 12.8 s with 2 threads on
    # the busy 2-core machine, 3.4 s with one). The setting is per thread (OpenMP): the caller's own is put back.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for row, index in enumerate(indices.tolist(), start):
            final = writer.path(row)
            if final.exists():
                continue  # written whole by an earlier run
            if row % CLOSE_EVERY_ROWS == 0:
                dataset.close()  # the chunk pages mapped (and read ahead) for the rows so far are let go
            final.parent.mkdir(parents=True, exist_ok=True)
            temporary = final.with_name(f".{final.name}.tmp")
            temporaries.append((temporary, final))
            with open(temporary, "wb") as handle:
                writer.write(dataset[index], handle)
        if temporaries:
            _durable([temporary for temporary, _ in temporaries])
            for temporary, final in temporaries:
                os.replace(temporary, final)
            for folder in {final.parent for _, final in temporaries}:
                fsync_path(folder)
    except BaseException:
        for temporary, _ in temporaries:
            with contextlib.suppress(OSError):
                temporary.unlink()
        raise
    finally:
        dataset.close()  # the chunks' mapped pages read for this batch are not held through the whole export
        torch.set_num_threads(threads)
    return len(temporaries), len(indices) - len(temporaries)


_syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None) if os.name == "posix" else None


def _durable(paths: list[Path]) -> None:
    """Every byte of ``paths`` on disk: one ``syncfs`` of their file system (Linux), else an fsync per file."""
    if _syncfs is not None:
        handle = os.open(paths[0], os.O_RDONLY)
        try:
            if _syncfs(handle) == 0:
                return
        finally:
            os.close(handle)
    for path in paths:
        handle = os.open(path, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def dataset_indices(dataset: DrafterDataset, sample_ids: np.ndarray) -> np.ndarray:
    """The dataset index of each of ``sample_ids`` (the index is sorted by sample id), without a dict per sample."""
    ids = dataset.sample_ids_array
    positions = np.searchsorted(ids, sample_ids)
    found = (positions < len(ids)) & (ids[np.minimum(positions, len(ids) - 1)] == sample_ids)
    if not found.all():
        missing = np.asarray(sample_ids)[~found][:5].tolist()
        raise KeyError(f"samples {missing} are not in the drafter dataset {dataset.path}")
    return positions
