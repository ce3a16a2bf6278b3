"""What every store does with files: hold an exclusive lock, hash a file as it streams, swap a folder in whole.

- `FileLock`: an exclusive ``flock`` on a lock file, taken without waiting; the kernel drops it when the
  process exits, however it exits, so a killed run never leaves it held. Shard folders, GPUs, the regeneration
  store and each shard run's registration on its host (counted with `FileLock.is_held`) hold one. A filesystem
  that refuses ``flock`` (Lustre mounted without ``-o flock``, some NFS set-ups) raises `LockRefusedError` naming
  the folder, not a bare OSError.
- `file_sha256`: a file's sha256, read in blocks (memory stays flat whatever the file's size).
- `swap_in_dir`: a finished folder replaces the old one by rename; `staging_dir_for` names the folder it is
  built in, beside the target, and `remove_leftovers` clears what a crashed run left there.
- `atomic_output`: a file written as a stream (Arrow, Parquet) that appears whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pyarrow as pa

HASH_BLOCK = 16 * 2**20
# What a filesystem without flock support answers (ENOSYS: Lustre without -o flock; ENOLCK: NFS without a lock
# manager; EOPNOTSUPP: FUSE and others); any of them means no lock can ever be held there.
LOCK_REFUSALS = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP}


class LockRefusedError(OSError):
    """The filesystem holding a lock file does not support ``flock``."""


class FileLock:
    """An exclusive lock on ``path``, held until `release` (or the process ends)."""

    def __init__(self, path: Path, handle: IO[str]) -> None:
        self.path = path
        self._handle = handle

    @classmethod
    def try_acquire(cls, path: Path) -> FileLock | None:
        """The lock, or None when another process holds it (never waits)."""
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held for the lock's lifetime)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        except OSError as exc:
            handle.close()
            if exc.errno not in LOCK_REFUSALS:
                raise
            raise LockRefusedError(
                exc.errno,
                f"{Path(path).parent}: this filesystem refuses file locks (flock: {os.strerror(exc.errno)}), so "
                f"{Path(path).name} cannot be locked. Mount it with locking (Lustre: -o flock) or use a folder on a "
                "local disk",
            ) from None
        return cls(Path(path), handle)

    def record_holder(self, text: str) -> None:
        """Write who holds the lock into the lock file, for the message another process gets."""
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(text)
        self._handle.flush()

    def move_to(self, path: Path) -> None:
        """Rename the lock file, the lock still held (it is on the open file, not on its name)."""
        os.replace(self.path, path)
        self.path = Path(path)

    @staticmethod
    def is_held(path: Path) -> bool:
        """Whether some process holds the lock on ``path`` now (a shared lock tried without waiting, then dropped);
        `LockRefusedError` where the filesystem refuses locks."""
        with open(path, encoding="utf-8") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            except OSError as exc:
                if exc.errno in LOCK_REFUSALS:
                    raise LockRefusedError(exc.errno, f"{path}: this filesystem refuses file locks") from None
                raise
        return False

    @staticmethod
    def holder(path: Path) -> str:
        """What the holder of the lock on ``path`` wrote about itself ('' when nothing)."""
        try:
            return Path(path).read_text(encoding="utf-8").strip()
        except OSError:
            return ""

    @property
    def held(self) -> bool:
        return not self._handle.closed

    def release(self) -> None:
        if not self._handle.closed:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def staging_dir_for(target: Path) -> Path:
    """A fresh folder name beside ``target`` to build its replacement in (``<name>.tmp-<random>``)."""
    return target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")


def swap_in_dir(new: Path, target: Path) -> None:
    """Put the finished folder ``new`` in place of ``target``; the old one is removed only after the swap."""
    old = None
    if target.exists():
        old = target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(target: Path) -> None:
    """Staging and superseded folders that a crashed run left beside ``target``."""
    for pattern in (f"{target.name}.tmp-*", f"{target.name}.old-*"):
        for leftover in target.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[pa.NativeFile]:
    """Arrow's output stream onto ``path``, for writers that stream (no bytes object of the whole file): written
    under a temporary name, fsynced, renamed, the folder fsynced; an error leaves no file and no temporary."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with pa.OSFile(str(temporary), "wb") as sink:
            yield sink
        fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    fsync_path(path.parent)


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder``, 0 when it does not exist (os.scandir: one stat per file, no Path object
    per file). A file or folder removed while it is read (a chunk set aside, a temporary file renamed) is skipped."""
    total, todo = 0, [str(folder)]
    while todo:
        try:
            with os.scandir(todo.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            todo.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
        except (FileNotFoundError, NotADirectoryError):
            continue
    return total


def fsync_path(path: Path) -> None:
    """A file's or folder's data and metadata on disk (a folder: the names created or renamed in it)."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
