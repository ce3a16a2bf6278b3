"""A shard run's share of its host's cores, when several shard runs share one host.

Every shard run on a box (one per GPU) would otherwise start PyTorch's pool with a thread per core: eight runs make
eight times too many threads, which spin against each other (eight shards of a tiny target launched at once on a
2-core machine, each with PyTorch's default pool, ran at about 3k tokens/s together, where one alone ran at 28.9k).

Each run registers in a per-host folder (``extraction.device_lock_dir``/runs): a file it holds an ``flock`` on, which
the kernel releases however the process ends. A run counts the registrations that are still held, and its share is
the cores it may run on (its CPU affinity, which a scheduler such as Ray, Slurm or Kubernetes may have narrowed)
divided by that count, at least one. It counts again every `RECOUNT_S` seconds, so shares follow runs as they start
and end. Where the folder's filesystem refuses ``flock``, a run cannot see the others and takes every core (said in
the log).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path

from hsx_dagster.core.storage.files import FileLock, LockRefusedError

log = logging.getLogger(__name__)

RECOUNT_S = 5.0
RUNS_DIR = "runs"


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else every core)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class HostShare:
    """This run's registration on the host and its current share of the cores (``fixed``: a number from the
    settings, which wins)."""

    def __init__(self, lock_dir: Path, fixed: int | None = None, cores: int | None = None) -> None:
        self.fixed = fixed
        self.cores = cores or usable_cores()
        self.folder = Path(lock_dir) / RUNS_DIR
        # named after the host too: a folder shared by several hosts by mistake still counts this host's runs only
        self._prefix = f"run-{socket.gethostname()}-"
        self._lock: FileLock | None = None
        self._counted_at = -RECOUNT_S
        self._runs = 1
        if fixed is None:
            self._lock = self._register()

    def threads(self) -> int:
        """The threads this run should use now: the fixed number, or its share of the cores."""
        if self.fixed is not None:
            return self.fixed
        now = time.monotonic()
        if self._lock is not None and now - self._counted_at >= RECOUNT_S:
            self._counted_at = now
            self._runs = max(1, self._count())
        return max(1, self.cores // self._runs)

    @property
    def runs(self) -> int:
        """Shard runs on this host at the last count (this one included)."""
        return self._runs

    def close(self) -> None:
        if self._lock is not None:
            self._lock.path.unlink(missing_ok=True)
            self._lock.release()
            self._lock = None

    def _register(self) -> FileLock | None:
        """A registration file held under flock; made under a temporary name and renamed once locked, so another
        run counting at that moment never takes it for a dead one's."""
        temporary = self.folder / f".new-{uuid.uuid4().hex}"
        lock = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            lock = FileLock.try_acquire(temporary)  # a fresh name: None (held by another) cannot happen
            if lock is None:
                return None
            lock.record_holder(f"{socket.gethostname()} pid {os.getpid()}\n")
            lock.move_to(self.folder / f"{self._prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}.lock")
        except (LockRefusedError, PermissionError) as exc:
            if lock is not None:
                lock.release()
            temporary.unlink(missing_ok=True)
            log.warning("%s: cannot register this shard run (%s); it takes all %d cores", self.folder, exc, self.cores)
            return None
        return lock

    def _count(self) -> int:
        """Registrations still held; a dead run's file is removed on the way."""
        live = 0
        for path in self.folder.glob(f"{self._prefix}*.lock"):
            try:
                if FileLock.is_held(path):
                    live += 1
                else:
                    path.unlink(missing_ok=True)  # nobody holds it: its run is gone
            except OSError:
                continue
        return live
