"""One read of a chunk for every check: its sha256, its safetensors header, and its small tensors.

The file is read once, front to back, in large blocks, with the next block read on a second thread while the
current one is hashed (both release the GIL), so a check runs at about the speed of a plain ``sha256sum``. The
header (tensor names, dtypes, shapes, offsets, metadata) and the small per-token and per-sample tensors
(``input_ids``, ``loss_mask``, ``offsets``, ``sample_ids``) are copied out of the blocks as they pass; the states
are only hashed: what the numerics checks need of them was recorded when the chunk was written (chunk_stats.py),
and the checksum proves the bytes are still those.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open

READ_BLOCK = 8 * 2**20
SMALL_TENSORS = ("input_ids", "loss_mask", "offsets", "sample_ids")
NUMPY_DTYPES = {"I64": np.int64, "I32": np.int32, "U8": np.uint8, "I16": np.int16, "U16": np.uint16}
MAX_HEADER = 100 * 2**20  # safetensors' own limit


@dataclass
class ScannedChunk:
    """What one read of a chunk found. ``error`` is set when it is missing or its header cannot be parsed."""

    path: Path
    sha256: str | None = None
    size: int = 0
    tensors: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # name -> (dtype, shape)
    metadata: dict[str, str] = field(default_factory=dict)
    small: dict[str, np.ndarray] = field(default_factory=dict)
    error: str | None = None


def scan_chunk(path: Path) -> ScannedChunk:
    """Read ``path`` once: hash every byte, parse the header, keep the small tensors."""
    scanned = ScannedChunk(Path(path))
    try:
        handle = open(path, "rb", buffering=0)  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        scanned.error = "missing"
        return scanned
    with handle:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        digest = hashlib.sha256()
        entries, data_start = _read_header(handle, digest, scanned)
        wanted = {name: bytearray(_span(entry)) for name, entry in entries.items() if name in SMALL_TENSORS}
        scanned.size = data_start + _hash_rest(handle, digest, entries, wanted)
    scanned.sha256 = digest.hexdigest()
    for name, data in wanted.items():
        dtype = NUMPY_DTYPES.get(entries[name]["dtype"])
        if dtype is not None and len(data) % np.dtype(dtype).itemsize == 0:
            scanned.small[name] = np.frombuffer(bytes(data), dtype=dtype)
    return scanned


def _read_header(handle, digest, scanned: ScannedChunk) -> tuple[dict, int]:
    """The tensor entries of the header (recording dtypes, shapes, metadata in ``scanned``) and where data starts."""
    prefix = handle.read(8)
    digest.update(prefix)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < length <= MAX_HEADER:
        scanned.error = "unreadable safetensors header (bad length)"
        return {}, len(prefix)
    raw = handle.read(length)
    digest.update(raw)
    try:
        header = json.loads(raw)
        metadata = header.pop("__metadata__", None) or {}
        entries = {name: entry for name, entry in header.items() if _span(entry) >= 0}
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        scanned.error = f"unreadable safetensors header ({type(exc).__name__}: {exc})"
        return {}, 8 + len(raw)
    scanned.metadata = {str(k): str(v) for k, v in metadata.items()}
    scanned.tensors = {name: (entry["dtype"], list(entry["shape"])) for name, entry in entries.items()}
    return entries, 8 + length


def _span(entry) -> int:
    start, end = entry["data_offsets"]
    return int(end) - int(start)


def _hash_rest(handle, digest, entries: dict, wanted: dict[str, bytearray]) -> int:
    """Hash what follows the header, block by block, the next block read while this one is hashed; copy the
    ``wanted`` tensors' bytes out as they pass. Returns the bytes read."""
    ranges: list[tuple[str, int, int]] = [
        (name, int(entries[name]["data_offsets"][0]), int(entries[name]["data_offsets"][1])) for name in wanted
    ]
    buffers = (bytearray(READ_BLOCK), bytearray(READ_BLOCK))
    position = 0
    with ThreadPoolExecutor(1, thread_name_prefix="hsx-chunk-read") as reader:
        pending = reader.submit(handle.readinto, buffers[0])
        turn = 0
        while count := pending.result():
            block = memoryview(buffers[turn])[:count]
            turn ^= 1
            pending = reader.submit(handle.readinto, buffers[turn])
            digest.update(block)
            for name, start, end in ranges:
                low, high = max(start, position), min(end, position + count)
                if low < high:
                    wanted[name][low - start : high - start] = block[low - position : high - position]
            position += count
    return position


def read_verified_chunk(path: Path, sha256: str, small: tuple[str, ...] = ("offsets", "sample_ids")) -> ScannedChunk:
    """What a scan finds in a chunk the checks verified whole and that has not changed since (verified.json): its
    header and the ``small`` tensors (memory-mapped reads of those only), the recorded checksum taken as its own.
    Its states are not read. ``error`` is set when the file cannot be opened as safetensors."""
    scanned = ScannedChunk(Path(path), sha256=sha256)
    try:
        scanned.size = os.stat(path).st_size
        with safe_open(str(path), framework="np") as chunk:
            scanned.metadata = {str(k): str(v) for k, v in (chunk.metadata() or {}).items()}
            for name in chunk.keys():  # noqa: SIM118 (not a mapping)
                view = chunk.get_slice(name)
                scanned.tensors[name] = (view.get_dtype(), list(view.get_shape()))
            scanned.small = {name: chunk.get_tensor(name) for name in small if name in scanned.tensors}
    except FileNotFoundError:
        scanned.error = "missing"
    except Exception as exc:  # changed after all (a header that does not parse): named, and read whole next time
        scanned.error = f"unreadable safetensors header ({type(exc).__name__}: {exc})"
    return scanned
