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

import errno
import fcntl
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

RECOUNT_S = 5.0
RUNS_DIR = "runs"
_REFUSED = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


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
        self._handle: IO[str] | None = None
        self._path: Path | None = None
        self._counted_at = -RECOUNT_S
        self._runs = 1
        if fixed is None:
            self._handle = self._register()

    def threads(self) -> int:
        """The threads this run should use now: the fixed number, or its share of the cores."""
        if self.fixed is not None:
            return self.fixed
        now = time.monotonic()
        if self._handle is not None and now - self._counted_at >= RECOUNT_S:
            self._counted_at = now
            self._runs = max(1, self._count())
        return max(1, self.cores // self._runs)

    @property
    def runs(self) -> int:
        """Shard runs on this host at the last count (this one included)."""
        return self._runs

    def close(self) -> None:
        if self._handle is not None and self._path is not None:
            self._path.unlink(missing_ok=True)
            self._handle.close()
            self._handle = None

    def _register(self) -> IO[str] | None:
        """A registration file held under flock; made under a temporary name and renamed once locked, so another
        run counting at that moment never takes it for a dead one's."""
        temporary = self.folder / f".new-{uuid.uuid4().hex}"
        handle = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle = open(temporary, "w", encoding="utf-8")  # noqa: SIM115 (held while the run lives)
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            handle.write(f"{socket.gethostname()} pid {os.getpid()}\n")
            handle.flush()
            path = self.folder / f"{self._prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}.lock"
            os.replace(temporary, path)
        except OSError as exc:
            if handle is not None:
                handle.close()
            temporary.unlink(missing_ok=True)
            if exc.errno not in _REFUSED and not isinstance(exc, PermissionError):
                raise
            log.warning("%s: cannot register this shard run (%s); it takes all %d cores", self.folder, exc, self.cores)
            return None
        self._path = path
        return handle

    def _count(self) -> int:
        """Registrations still held; a dead run's file is removed on the way."""
        live = 0
        for path in self.folder.glob(f"{self._prefix}*.lock"):
            try:
                with open(path, encoding="utf-8") as other:
                    fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    path.unlink(missing_ok=True)  # nobody holds it: its run is gone
            except BlockingIOError:
                live += 1
            except OSError:
                continue
        return live
