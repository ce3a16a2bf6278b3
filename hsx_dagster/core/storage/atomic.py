"""Crash-safe file writes: a whole file appears by rename or not at all, and a JSON-lines log whose
torn last line (a crash while appending) is never read as a record."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path

Buffer = bytes | bytearray | memoryview


class StoreError(RuntimeError):
    """The output cannot be used as asked (held by another run, made from other inputs, full disk, ...)."""


def write_atomic(path: Path, payload: Buffer | Sequence[Buffer]) -> None:
    """Temporary name, flush, fsync, rename, fsync the folder: the file is whole or absent, and a
    failed write (a full disk) leaves no temporary behind. ``payload``: the bytes, or buffers written one after
    another from their own memory (a chunk's pieces: chunk_file.py)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    size = sum(memoryview(part).nbytes for part in parts)
    try:
        with open(temporary, "wb") as handle:
            for part in parts:
                handle.write(part)
            handle.flush()
            os.fsync(handle.fileno())
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
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


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
