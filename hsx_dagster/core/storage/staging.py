"""The host memory a shard run's states pass through: one ring of rows per tensor, allocated once and reused.

Each batch reserves a contiguous span of rows; the device copies its states straight into them (pinned memory, so
the copy is asynchronous on a GPU; on the CPU the gather writes there directly), and the chunk writer writes chunk
files from those rows (chunk_file.py) and releases them, oldest first. Nothing is allocated per batch (large
allocations freed and faulted in again batch after batch cost more system time than the copies themselves), and
the memory a run holds is the ring's, whatever the chunk size and the number of batches. Every tensor's rows start on
a page boundary, so chunk files can be written from them with O_DIRECT (atomic.py).

A span never wraps around the end (a batch's rows stay one block of memory); rows left at the end are skipped until
the oldest rows are released. `reserve` waits while the ring is full, which is what holds the device back when
writing falls behind.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hsx_dagster.core.storage.atomic import ALIGN


@dataclass(frozen=True)
class RowSpec:
    """Each row's shape and dtype in one of the ring's tensors."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclass
class Span:
    """Rows ``start:stop`` of a ring, reserved by one batch (``number``: reservations counted from 0)."""

    number: int
    start: int
    stop: int


class StagingRing:
    """``rows`` rows of every tensor in ``specs`` (pinned for a GPU's asynchronous copies when ``pin``)."""

    def __init__(self, specs: dict[str, RowSpec], rows: int, pin: bool = False) -> None:
        if rows < 1:
            raise ValueError("a staging ring needs at least one row")
        self.specs = dict(specs)
        self.rows = rows
        self.buffers = {name: _page_aligned((rows, *spec.shape), spec, pin) for name, spec in specs.items()}
        self._live: deque[Span] = deque()  # reserved and not released yet, oldest first
        self._reserved = 0
        self._changed = threading.Condition()

    @property
    def row_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs.values())

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def views(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``start:stop`` of every tensor (views: writing into them fills the ring)."""
        return {name: buffer[start:stop] for name, buffer in self.buffers.items()}

    def reserve(self, rows: int, waiting: Callable[[], None] | None = None) -> Span:
        """A span of ``rows`` contiguous free rows, waiting until there is one; ``waiting`` is called about once a
        second while it waits (to raise when whoever releases rows has failed, or to ask for rows)."""
        if rows > self.rows:
            raise ValueError(f"{rows} rows do not fit a staging ring of {self.rows}")
        with self._changed:
            while (start := self._free_start(rows)) is None:
                if waiting is not None:
                    waiting()
                self._changed.wait(timeout=1.0)
            span = Span(self._reserved, start, start + rows)
            self._reserved += 1
            self._live.append(span)
            return span

    def release(self, number: int, row: int) -> None:
        """Free every row before ``row`` of span ``number``, and every older span."""
        with self._changed:
            while self._live and self._live[0].number < number:
                self._live.popleft()
            if self._live and self._live[0].number == number:
                oldest = self._live[0]
                oldest.start = max(oldest.start, min(row, oldest.stop))
                if oldest.start == oldest.stop:
                    self._live.popleft()
            self._changed.notify_all()

    @property
    def empty(self) -> bool:
        with self._changed:
            return not self._live

    def _free_start(self, rows: int) -> int | None:
        if not self._live:
            return 0
        tail, head = self._live[0].start, self._live[-1].stop
        if self._live[-1].start < self._live[0].start:  # wrapped: the free rows lie between head and tail
            return head if tail - head >= rows else None
        if self.rows - head >= rows:
            return head
        return 0 if tail >= rows else None


def _page_aligned(shape: tuple[int, ...], spec: RowSpec, pin: bool) -> torch.Tensor:
    """An empty tensor whose first row starts on an ALIGN boundary: O_DIRECT writes take chunk bytes straight from
    the ring (atomic.py), which needs the memory aligned as the file is (a plain allocation is aligned to 64 bytes)."""
    count = shape[0] * spec.nbytes
    raw = torch.empty(count, dtype=torch.uint8, pin_memory=pin)  # pinned memory comes page-aligned: taken as it is
    if raw.data_ptr() % ALIGN:  # (the host allocator rounds sizes up to powers of two: no padding where not needed)
        raw = torch.empty(count + ALIGN, dtype=torch.uint8, pin_memory=pin)  # untouched pages: the first costs nothing
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + count].view(spec.dtype).view(shape)
