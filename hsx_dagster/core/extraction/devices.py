"""One run per GPU: a shard run claims a device before it loads the model.

A claim is an exclusive `flock` on ``<lock_dir>/<device>.lock``. The kernel releases it when the
process exits, however it exits, so a killed run never leaves a device locked. The shard's own
device (``devices[shard_index % n]``) is tried first, then any other free one; when none is free
the run waits up to ``wait_s`` and then fails with a message naming who holds each device.
The CPU is never locked: runs on the CPU share it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hsx_dagster.core.storage.files import FileLock


class DeviceBusyError(RuntimeError):
    """No device of the list was free within the wait."""


def visible_gpus() -> int:
    import torch  # only where GPUs are counted: claiming a lock needs no torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def candidate_devices(devices: Sequence[str], cuda_count: int) -> list[str]:
    """Concrete device names: 'auto'/'cuda' expand to every visible GPU ('auto' falls back to the CPU)."""
    names: list[str] = []
    for device in devices:
        if device in ("auto", "cuda"):
            if cuda_count:
                names += [f"cuda:{index}" for index in range(cuda_count)]
            elif device == "cuda":
                raise RuntimeError("extraction.devices asks for 'cuda' but no CUDA device is visible")
            else:
                names.append("cpu")
        else:
            if device.startswith("cuda") and int(device.partition(":")[2] or 0) >= cuda_count:
                raise RuntimeError(f"extraction.devices: {device} is not available on this machine ({cuda_count} GPUs)")
            names.append(device)
    return list(dict.fromkeys(names))  # keep order, drop repeats


@dataclass
class DeviceClaim:
    device: str
    _lock: FileLock | None  # None: the CPU (and Apple's mps) are shared, never locked

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> DeviceClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_device(
    devices: Sequence[str],
    shard_index: int,
    *,
    owner: str,
    lock_dir: Path,
    wait_s: float = 0.0,
    poll_s: float = 2.0,
) -> DeviceClaim:
    """Lock a free device for this process, preferring the shard's own; ``devices`` are concrete names."""
    if not devices:
        raise ValueError("no devices to claim")
    preferred = shard_index % len(devices)
    if devices[preferred] in ("cpu", "mps"):
        return DeviceClaim(devices[preferred], None)
    rotated = list(devices[preferred:]) + list(devices[:preferred])
    order = [device for device in rotated if device.startswith("cuda")]  # never fall back to the CPU silently
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        for device in order:
            lock = FileLock.try_acquire(_lock_file(lock_dir, device))
            if lock is None:
                continue
            lock.record_holder(
                json.dumps({"owner": owner, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
            )
            return DeviceClaim(device, lock)
        if time.monotonic() >= deadline:
            holders = "; ".join(f"{d}: {_holder(lock_dir, d)}" for d in order)
            raise DeviceBusyError(
                f"no free device among {', '.join(order)} after waiting {wait_s:.0f} s ({holders}). "
                "Each GPU runs one shard at a time; wait for a run to finish or raise extraction.device_wait_s"
            )
        time.sleep(poll_s)


def _lock_file(lock_dir: Path, device: str) -> Path:
    return lock_dir / f"{device.replace(':', '-')}.lock"


def _holder(lock_dir: Path, device: str) -> str:
    try:
        info = json.loads(FileLock.holder(_lock_file(lock_dir, device)))
        return f"held by {info['owner']} (pid {info['pid']} on {info['host']})"
    except (ValueError, KeyError, TypeError):
        return "held"


@contextmanager
def claimed_device(
    devices: Sequence[str], shard_index: int, *, owner: str, lock_dir: Path, wait_s: float = 0.0
) -> Iterator[str]:
    """The concrete device (``cuda:1``, ``cpu``) this process holds until the block ends; ``devices``
    as in the settings (``auto``, ``cuda``, ``cuda:N``, ``cpu``)."""
    candidates = candidate_devices(devices, visible_gpus())
    with claim_device(candidates, shard_index, owner=owner, lock_dir=Path(lock_dir), wait_s=wait_s) as claim:
        yield claim.device
