"""Crash-safe file writes: a whole file appears by rename or not at all, and a JSON-lines log whose
torn last line (a crash while appending) is never read as a record."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hsx_dagster.core.storage.cpu_account import CpuAccount

Buffer = bytes | bytearray | memoryview
ALIGN = 4096  # O_DIRECT: memory, file offsets and lengths in whole blocks of this (every Linux block size divides it)
BOUNCE_BYTES = 4 * 2**20  # the aligned buffer the unaligned stretches of a direct write go through
DIRECT_MIN = 64 * 2**10  # a stretch shorter than this goes through the bounce buffer even when it lines up
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: writes are buffered
_bounce = threading.local()


class StoreError(RuntimeError):
    """The output cannot be used as asked (held by another run, made from other inputs, full disk, ...)."""


def write_atomic(
    path: Path, payload: Buffer | Sequence[Buffer], *, direct: bool = False, cpu: CpuAccount | None = None
) -> bool:
    """Temporary name, flush, fsync, rename, fsync the folder: the file is whole or absent, and a
    failed write (a full disk) leaves no temporary behind. ``payload``: the bytes, or buffers written one after
    another from their own memory (a chunk's pieces: chunk_file.py). ``direct``: written with O_DIRECT, past the page
    cache (`_write_direct`), or buffered where the file system refuses it; returns whether it was written direct.
    ``cpu``: where the write's and the fsyncs' CPU time are added."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    size = sum(memoryview(part).nbytes for part in parts)
    wrote_direct = False
    try:
        handle = _open_for_writing(temporary, direct and bool(O_DIRECT))
        with handle:
            with _part(cpu, "write"):
                if handle.raw_direct:
                    wrote_direct = _write_direct(handle, parts, size)
                else:
                    for part in parts:
                        handle.write(part)
                    handle.flush()
            with _part(cpu, "fsync"):
                os.fsync(handle.fileno())
        with _part(cpu, "fsync"):
            os.replace(temporary, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(
                f"{path}: no space left on device writing {size:,} bytes; free space under {path.parent} "
                "and run again (what was committed before is kept)"
            ) from exc
        raise
    with _part(cpu, "fsync"):
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    return wrote_direct


@contextlib.contextmanager
def _part(cpu: CpuAccount | None, name: str) -> Iterator[None]:
    if cpu is None:
        yield
    else:
        with cpu.part(name):
            yield


class _Handle:
    """The open temporary file, and whether it was opened with O_DIRECT."""

    def __init__(self, handle, raw_direct: bool) -> None:
        self.handle, self.raw_direct = handle, raw_direct

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()

    def write(self, data) -> int:
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()

    def fileno(self) -> int:
        return self.handle.fileno()

    def truncate(self, size: int) -> None:
        self.handle.truncate(size)


def _open_for_writing(temporary: Path, direct: bool) -> _Handle:
    """The temporary file: unbuffered with O_DIRECT when ``direct`` and the file system takes it (one that refuses
    it, tmpfs for one, says EINVAL), buffered otherwise."""
    if direct:
        try:
            return _Handle(open(temporary, "wb", buffering=0, opener=_direct_opener), True)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return _Handle(open(temporary, "wb"), False)


def _direct_opener(path: str, flags: int) -> int:
    return os.open(path, flags | O_DIRECT, 0o666)


def _write_direct(handle: _Handle, parts: Sequence[Buffer], size: int) -> bool:
    """Write ``parts`` one after another through an O_DIRECT handle: every stretch of a part whose memory lines up
    with its place in the file (the same offset modulo ALIGN: chunk_file.py pads the header so that the states do)
    straight from that memory, in whole blocks; the rest (the header, the small tensors, the edges) through an
    aligned bounce buffer. The last block is padded with zeros and the file cut back to ``size`` before the fsync
    (and so before the rename that commits it). A write the file system refuses (EINVAL) turns the handle into a
    buffered one and the rest is written so. Returns whether every write was direct."""
    bounce = _bounce_buffer()
    state = {"direct": True, "position": 0}  # position: the file offset of bounce[0], a multiple of ALIGN
    filled = 0

    def emit(view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                wrote = handle.write(view[done:])
                if not wrote:
                    raise OSError(errno.EIO, "a write to the temporary file wrote nothing")
                done += wrote
            except OSError as exc:
                if exc.errno != errno.EINVAL or not state["direct"]:
                    raise
                _stop_direct(handle)
                state["direct"] = False
        state["position"] += len(view)

    for part in parts:
        view = memoryview(part).cast("B")
        at = state["position"] + filled
        if len(view) >= DIRECT_MIN and (_address(view) - at) % ALIGN == 0:
            head = -at % ALIGN  # fills the bounce buffer to a block boundary (it holds whole blocks)
            bounce[filled : filled + head] = view[:head]
            emit(bounce[: filled + head])
            filled = 0
            body = (len(view) - head) // ALIGN * ALIGN
            emit(view[head : head + body])
            view = view[head + body :]
        while len(view):
            take = min(len(view), BOUNCE_BYTES - filled)
            bounce[filled : filled + take] = view[:take]
            filled += take
            view = view[take:]
            if filled == BOUNCE_BYTES:
                emit(bounce)
                filled = 0
    if filled:
        padded = -(-filled // ALIGN) * ALIGN
        bounce[filled:padded] = bytes(padded - filled)
        emit(bounce[:padded])
    handle.truncate(size)
    return bool(state["direct"])


def _stop_direct(handle: _Handle) -> None:
    flags = fcntl.fcntl(handle.fileno(), fcntl.F_GETFL)
    fcntl.fcntl(handle.fileno(), fcntl.F_SETFL, flags & ~O_DIRECT)


def _bounce_buffer() -> memoryview:
    """This thread's aligned bounce buffer (anonymous memory is page-aligned), made once."""
    buffer = getattr(_bounce, "buffer", None)
    if buffer is None:
        buffer = _bounce.buffer = memoryview(mmap.mmap(-1, BOUNCE_BYTES))
    return buffer


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def read_lines(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines log; a torn last line (a crash while appending) is not a record."""
    if not path.is_file():
        return []
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(keepends=True)):
        if not line.endswith("\n"):
            break  # the append never finished: what it recorded is redone
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise StoreError(f"{path}: line {number + 1} is not JSON ({exc})") from None
    return entries


def append_lines(path: Path, entries: Sequence[dict]) -> None:
    """Append records and fsync: once this returns they survive a crash."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(entry) + "\n" for entry in entries))
        handle.flush()
        os.fsync(handle.fileno())


def drop_torn_tail(path: Path) -> None:
    """Rewrite a log without a half-appended last line, so the next append starts clean."""
    if path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        write_atomic(path, "".join(json.dumps(entry) + "\n" for entry in read_lines(path)).encode())
