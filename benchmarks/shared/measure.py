"""What one timed run records: wall and CPU seconds, the process's peak RSS during the run, bytes on disk."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STAT = Path("/proc/stat")
_TICK = os.sysconf("SC_CLK_TCK")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else None


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark (VmHWM) to the current RSS (Linux >= 4.0), so the peak of
    one run can be read in a process that ran others before it. False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else None


def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (every process, kernel included) since boot."""
    try:
        fields = [int(x) for x in _STAT.read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _TICK  # user nice system idle iowait irq softirq steal


@dataclass
class Run:
    seconds: float
    cpu_seconds: float  # this process, all threads: about threads x seconds when nothing else competes
    rss_start_bytes: int | None
    peak_rss_bytes: int | None  # None where the peak cannot be reset between runs
    others_cores: float | None  # cores other processes kept busy meanwhile: noise from outside the run
    result: object = None

    @property
    def peak_rss_growth_bytes(self) -> int | None:
        if self.peak_rss_bytes is None or self.rss_start_bytes is None:
            return None
        return self.peak_rss_bytes - self.rss_start_bytes


def timed(function: Callable[[], object]) -> Run:
    resettable = reset_peak_rss()
    rss_start = rss_bytes()
    busy_start = busy_cpu_seconds()
    cpu_start = time.process_time()
    started = time.perf_counter()
    result = function()
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_start
    busy_end = busy_cpu_seconds()
    others = None if busy_start is None or busy_end is None else max(0.0, busy_end - busy_start - cpu_seconds) / seconds
    return Run(
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        rss_start_bytes=rss_start,
        peak_rss_bytes=peak_rss_bytes() if resettable else None,
        others_cores=others,
        result=result,
    )


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def tree_bytes(path: Path) -> int:
    """Bytes of every file under ``path``: what the run left on disk."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def mib(value: float | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)
