"""Device time of each batch's forward pass: CUDA events on a GPU, the wall clock elsewhere.

The engine times every batch with a `LapTimer`; the batch shaper reads the `Lap`s to compare shapes.
On a GPU the time is known only once the device has reached the end event, so a `Lap` can be asked
without blocking (the shaper's monitor does, to keep the device queue full).
"""

from __future__ import annotations

import time

import torch


class Lap:
    """The device time of one batch: known at once on a CPU, from two CUDA events on a GPU."""

    def __init__(
        self, seconds: float | None = None, events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    ) -> None:
        self._seconds = seconds
        self._events = events

    def seconds(self, block: bool = True) -> float | None:
        """Seconds; None when ``block`` is false and the device has not finished the batch yet."""
        if self._seconds is None and self._events is not None:
            start, end = self._events
            if not block and not end.query():
                return None
            end.synchronize()
            self._seconds = start.elapsed_time(end) / 1000
        return self._seconds


class LapTimer:
    """Device time of each batch's forward pass, and their total: CUDA events on a GPU (read without a
    synchronisation unless asked), the wall clock on a CPU (synchronised first on Apple's mps)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.laps: list[Lap] = []
        self.last: Lap | None = None

    def start(self, sync: bool = False):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        if sync and self.device.type == "mps":
            torch.mps.synchronize()
        return time.perf_counter()

    def stop(self, started, sync: bool = False) -> Lap:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            lap = Lap(events=(started, end))
        else:
            if sync and self.device.type == "mps":
                torch.mps.synchronize()
            lap = Lap(seconds=time.perf_counter() - started)
        self.laps.append(lap)
        self.last = lap
        return lap

    def total(self) -> float:
        return sum(lap.seconds(block=True) or 0.0 for lap in self.laps)
