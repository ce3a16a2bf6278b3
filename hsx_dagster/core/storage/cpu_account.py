"""Host CPU time by part: where a shard run's CPU-seconds go, so that a regression names its part.

Each part is measured with the CPU clock of the thread that does it (``time.thread_time``), around the code that
does it: the parts of one thread never overlap, so they add up. Each thread the account follows is also measured
whole, and what it did outside its parts is named after it (``writer_loop``, ``main_loop``); the process's CPU time
over the run minus every thread's is what the threads the account does not follow did (PyTorch's pool on a CPU,
Dagster's and Python's own: ``other_threads``). A clock read costs well under a microsecond, and there are a few per
batch and per chunk: always on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# The parts, in the order a batch's bytes meet them. The device's part runs on the calling thread: on a GPU it is
# the launches, on a CPU the work itself.
PART_MEANING = {
    "inputs": "the batch's ids and mask padded and sent to the device (main thread)",
    "forward": "the forward pass (on a GPU: its launches; main thread)",
    "gather_and_copy": "the real tokens gathered, reduced to per-token statistics, fp8, copied into the staging ring "
    "(on a GPU: launches and the asynchronous copy; main thread)",
    "main_loop": "the main thread's batching, progress and waits for ring rows, outside the parts above",
    "copy_wait": "the writer waiting for a batch's device-to-host copy to land",
    "statistics": "per-chunk statistics from the per-token ones, non-finite screening (writer)",
    "serialisation": "the safetensors header and the list of buffers to write (writer)",
    "write": "writing the chunk file (writer)",
    "fsync": "fsync of the chunk, the rename and the folder (writer)",
    "hash": "sha256 of the chunk's bytes from memory (hashing thread)",
    "index_and_records": "the index line (fsynced) and written.jsonl (writer)",
    "writer_loop": "the writer thread's own loop outside the parts above",
    "other_threads": "threads the account does not follow: PyTorch's pool (the forward on a CPU), Dagster, Python",
}
PARTS = tuple(PART_MEANING)


class CpuAccount:
    """CPU-seconds per part, added from any thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._by_thread: dict[int, float] = {}
        self._lock = threading.Lock()
        self._process_start: float | None = None
        self.process_s = 0.0  # the process's CPU time between `start` and `stop`

    def add(self, part: str, seconds: float) -> None:
        with self._lock:
            self.seconds[part] = self.seconds.get(part, 0.0) + seconds
            ident = threading.get_ident()
            self._by_thread[ident] = self._by_thread.get(ident, 0.0) + seconds

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """The calling thread's CPU time inside the block, added to ``name``."""
        started = time.thread_time()
        try:
            yield
        finally:
            self.add(name, time.thread_time() - started)

    @contextmanager
    def thread(self, rest: str) -> Iterator[None]:
        """The calling thread's whole CPU time inside the block: its parts as measured, the remainder under ``rest``."""
        ident = threading.get_ident()
        started = time.thread_time()
        with self._lock:
            before = self._by_thread.get(ident, 0.0)
        try:
            yield
        finally:
            total = time.thread_time() - started
            with self._lock:
                measured = self._by_thread.get(ident, 0.0) - before
            self.add(rest, max(total - measured, 0.0))

    def start(self) -> None:
        self._process_start = time.process_time()

    @classmethod
    def started(cls) -> CpuAccount:
        """An account whose run begins now (the process's CPU time is counted from here)."""
        account = cls()
        account.start()
        return account

    def stop(self) -> None:
        """The run is over: what the process spent beyond the followed threads goes to ``other_threads``."""
        if self._process_start is None:
            return
        self.process_s = time.process_time() - self._process_start
        followed = sum(seconds for part, seconds in self.seconds.items() if part != "other_threads")
        self.seconds["other_threads"] = max(self.process_s - followed, 0.0)

    def per_gb(self, stored_bytes: int) -> dict[str, float]:
        """CPU-seconds per GB stored of every part (0 when nothing was stored)."""
        gb = stored_bytes / 1e9
        return {part: round(seconds / gb, 4) if gb else 0.0 for part, seconds in self.seconds.items()}
