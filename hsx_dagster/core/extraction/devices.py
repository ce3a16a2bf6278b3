"""One run per GPU: a shard run claims a device before it loads the model.

A claim is an exclusive `flock` on ``<lock_dir>/gpu-<physical id>.lock``. The kernel releases it when the
process exits, however it exits, so a killed run never leaves a device locked. The shard's own
device (``devices[shard_index % n]``) is tried first, then any other free one; when none is free
the run waits up to ``wait_s`` and then fails with a message naming who holds each device.
The CPU is never locked: runs on the CPU share it.

The lock is keyed by the physical GPU (its UUID), not by the name the process sees: a scheduler (Ray,
Kubernetes, Slurm) that gives each run one GPU sets CUDA_VISIBLE_DEVICES, so every such run sees its GPU as
``cuda:0``; keyed by that name, two runs on one node (or every run, with a shared lock folder) would collide.
Where the scheduler already keeps runs apart, ``claim="scheduler"`` takes no lock at all (no lock folder
needed, e.g. when the only shared filesystem refuses flock), and the run's metadata says so.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hsx_dagster.core.storage.files import FileLock, LockRefusedError

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"  # what Ray, Kubernetes' device plugin and Slurm set for a run
CLAIMS = ("lock", "scheduler")


class DeviceBusyError(RuntimeError):
    """No device of the list was free within the wait."""


class DeviceClaimError(RuntimeError):
    """The claim cannot be made as the settings ask (a lock folder without flock, no scheduler)."""


def visible_gpus() -> int:
    import torch  # only where GPUs are counted: claiming a lock needs no torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_uuid(index: int) -> str | None:
    """The UUID of the visible GPU ``index`` as the driver reports it (``GPU-...``, the same string nvidia-smi
    prints and CUDA_VISIBLE_DEVICES accepts); None where there is no such GPU or the build cannot tell."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except (AttributeError, RuntimeError, AssertionError):  # an older torch, a ROCm build, no driver
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def physical_gpu_id(
    index: int,
    *,
    uuid_of: Callable[[int], str | None] = gpu_uuid,
    visible: str | None = None,
    host: str | None = None,
) -> str:
    """Which physical GPU the visible GPU ``index`` is: its UUID, else what CUDA_VISIBLE_DEVICES (``visible``,
    default the environment's) names at that position on this host, else the index on this host."""
    uuid = uuid_of(index)
    if uuid:
        return uuid
    visible = os.environ.get(VISIBLE_DEVICES_ENV) if visible is None else visible
    host = host or socket.gethostname()
    entries = [entry.strip() for entry in (visible or "").split(",") if entry.strip()]
    if index < len(entries):
        entry = entries[index]
        return entry if entry.startswith(("GPU-", "MIG-")) else f"{host}-gpu{entry}"
    return f"{host}-gpu{index}"


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
    _lock: FileLock | None  # None: the CPU (and Apple's mps) are shared, never locked; or the scheduler's claim
    how: str = field(default="")  # the claim in words, for the run's metadata

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> DeviceClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def _scheduler_note(visible: str | None) -> str:
    return f"; {VISIBLE_DEVICES_ENV}={visible} set by the scheduler" if visible else ""


def claim_device(
    devices: Sequence[str],
    shard_index: int,
    *,
    owner: str,
    lock_dir: Path,
    wait_s: float = 0.0,
    poll_s: float = 2.0,
    physical_id: Callable[[str], str] | None = None,
) -> DeviceClaim:
    """Lock a free device for this process, preferring the shard's own; ``devices`` are concrete names.
    ``physical_id``: device name -> the physical GPU it is (default `physical_gpu_id`)."""
    if not devices:
        raise ValueError("no devices to claim")
    preferred = shard_index % len(devices)
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    if devices[preferred] in ("cpu", "mps"):
        shared = f"none: {devices[preferred]} is shared by the runs on this node{_scheduler_note(visible)}"
        return DeviceClaim(devices[preferred], None, shared)
    rotated = list(devices[preferred:]) + list(devices[:preferred])
    order = [device for device in rotated if device.startswith("cuda")]  # never fall back to the CPU silently
    identify = physical_id or (lambda device: physical_gpu_id(_index(device)))
    keys = {device: identify(device) for device in order}
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        for device in order:
            lock = _try_lock(lock_dir, keys[device])
            if lock is None:
                continue
            lock.record_holder(
                json.dumps({"owner": owner, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
            )
            how = f"lock on {keys[device]} ({device}{_scheduler_note(visible)}) in {lock_dir}"
            return DeviceClaim(device, lock, how)
        if time.monotonic() >= deadline:
            holders = "; ".join(f"{d} ({keys[d]}): {_holder(lock_dir, keys[d])}" for d in order)
            raise DeviceBusyError(
                f"no free device among {', '.join(order)} after waiting {wait_s:.0f} s ({holders}). "
                "Each GPU runs one shard at a time; wait for a run to finish or raise extraction.device_wait_s"
            )
        time.sleep(poll_s)


def claim_scheduled_device(devices: Sequence[str], shard_index: int, visible: str | None = None) -> DeviceClaim:
    """No lock: the scheduler that set CUDA_VISIBLE_DEVICES gave this run its GPUs and no other run gets them."""
    visible = os.environ.get(VISIBLE_DEVICES_ENV) if visible is None else visible
    if not visible:
        raise DeviceClaimError(
            f"extraction.device_claim is `scheduler` but {VISIBLE_DEVICES_ENV} is not set: no scheduler gave this "
            "run its GPUs, so nothing keeps two runs off one GPU. Launch it through Ray, Kubernetes or Slurm with "
            "one GPU per run, or set extraction.device_claim: lock"
        )
    device = devices[shard_index % len(devices)]
    return DeviceClaim(
        device,
        None,
        f"none: {VISIBLE_DEVICES_ENV}={visible} set by the scheduler, which gives each run its own GPU "
        "(extraction.device_claim: scheduler)",
    )


def _lock_file(lock_dir: Path, key: str) -> Path:
    return lock_dir / f"gpu-{re.sub(r'[^A-Za-z0-9._-]', '-', key)}.lock"


def _try_lock(lock_dir: Path, key: str) -> FileLock | None:
    try:
        return FileLock.try_acquire(_lock_file(lock_dir, key))
    except LockRefusedError as exc:
        raise DeviceClaimError(
            f"extraction.device_lock_dir {lock_dir} is on a filesystem that refuses flock ({exc.strerror}), so "
            "no GPU can be claimed there. Set extraction.device_lock_dir to a folder on a local disk (the default, "
            "/tmp/hsx-dagster-device-locks, is one), or extraction.device_claim: scheduler where Ray, Kubernetes or "
            "Slurm give each run its own GPU"
        ) from None


def _holder(lock_dir: Path, key: str) -> str:
    try:
        info = json.loads(FileLock.holder(_lock_file(lock_dir, key)))
        return f"held by {info['owner']} (pid {info['pid']} on {info['host']})"
    except (ValueError, KeyError, TypeError):
        return "held"


@contextmanager
def device_claim(
    devices: Sequence[str],
    shard_index: int,
    *,
    owner: str,
    lock_dir: Path,
    wait_s: float = 0.0,
    claim: str = "lock",
) -> Iterator[DeviceClaim]:
    """The claim this process holds until the block ends (its ``device``: ``cuda:1``, ``cpu``); ``devices`` as in
    the settings (``auto``, ``cuda``, ``cuda:N``, ``cpu``); ``claim``: extraction.device_claim."""
    candidates = candidate_devices(devices, visible_gpus())
    if claim == "scheduler" and any(device.startswith("cuda") for device in candidates):
        yield claim_scheduled_device(candidates, shard_index)
        return
    with claim_device(candidates, shard_index, owner=owner, lock_dir=Path(lock_dir), wait_s=wait_s) as held:
        yield held


@contextmanager
def claimed_device(
    devices: Sequence[str], shard_index: int, *, owner: str, lock_dir: Path, wait_s: float = 0.0, claim: str = "lock"
) -> Iterator[str]:
    """The concrete device (``cuda:1``, ``cpu``) this process holds until the block ends (`device_claim`)."""
    with device_claim(devices, shard_index, owner=owner, lock_dir=lock_dir, wait_s=wait_s, claim=claim) as held:
        yield held.device
