"""One chunk file written straight from the memory its tensors are in, hashed on a second thread while it is written.

A chunk is a safetensors file. safetensors' own writers take each tensor whole and contiguous (``save_file``) or
return the whole file as bytes (``save``); a chunk's tensors here are row ranges of the staging ring (staging.py),
one or more per tensor, so the file is laid out here exactly as safetensors lays it out (its format: an 8-byte
little-endian header length, the JSON header, the tensors' bytes back to back):

- tensors sorted by dtype (widest alignment first, in safetensors' own order), then by name;
- ``data_offsets`` contiguous from 0, the header padded with spaces to a multiple of 8 bytes;
- ``__metadata__`` first, its keys sorted (safetensors writes them in a per-process random order, so its bytes for
  the same chunk differ between runs; these do not).

hsx_dagster_tests/unit/storage/test_chunk_file.py proves a chunk's bytes are those of ``safetensors.torch.save`` for
the same tensors (the metadata's order aside), and every reader opens chunks with safetensors itself, which
validates them.

Per byte of states the host does one write (the kernel's copy into the page cache, or with ``direct`` none: O_DIRECT
writes from the staging ring's memory, atomic.py) and one sha256, on two cores at once: the file is written from the
pieces' memory on the calling thread while the hashing thread reads the same memory (both release the GIL), so a
chunk takes about the longer of the two, not their sum. The sha256 is of the bytes written, from that memory, never a
read-back. For a direct write the header is padded with spaces (safetensors' own padding, only longer) so that the
largest tensor lies in the file at the same offset modulo a block as in memory: its bytes go to the disk straight from
the ring.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from hsx_dagster.core.storage.atomic import ALIGN, write_atomic
from hsx_dagster.core.storage.cpu_account import CpuAccount

# safetensors' names of the dtypes a chunk holds, in the order its writer sorts them (widest alignment first).
SAFETENSORS_ORDER: tuple[tuple[torch.dtype, str], ...] = (
    (torch.int64, "I64"),
    (torch.float64, "F64"),
    (torch.float32, "F32"),
    (torch.int32, "I32"),
    (torch.bfloat16, "BF16"),
    (torch.float16, "F16"),
    (torch.int16, "I16"),
    (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.float8_e5m2, "F8_E5M2"),
    (torch.int8, "I8"),
    (torch.uint8, "U8"),
    (torch.bool, "BOOL"),
)
_RANK = {dtype: rank for rank, (dtype, _) in enumerate(SAFETENSORS_ORDER)}
_NAME = dict(SAFETENSORS_ORDER)
HASH_PIECE = 64 * 2**20  # the hashing thread takes this much at a time (sha256 releases the GIL per call)


@dataclass(frozen=True)
class ChunkTensor:
    """One tensor of a chunk as the row ranges it is stored in: ``pieces`` are contiguous CPU tensors of
    ``dtype`` whose concatenation along the first dimension is the tensor (an empty list: zero rows)."""

    name: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    pieces: tuple[torch.Tensor, ...]

    @property
    def rows(self) -> int:
        return sum(piece.shape[0] for piece in self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(piece.numel() * piece.element_size() for piece in self.pieces)

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> ChunkTensor:
        return cls(name, tensor.dtype, tuple(tensor.shape[1:]), (tensor.contiguous(),))


def chunk_header(tensors: Sequence[ChunkTensor], metadata: dict[str, str], align: bool = False) -> bytes:
    """The 8-byte length and the JSON header of a chunk holding ``tensors`` (in `file_order`), padded to 8 bytes;
    with ``align``, further so that the largest tensor's first piece starts at the file offset its memory has modulo
    ALIGN (a direct write then takes it from that memory)."""
    entries: dict[str, object] = {"__metadata__": {key: str(metadata[key]) for key in sorted(metadata)}}
    start = 0
    for tensor in file_order(tensors):
        for piece in tensor.pieces:
            if piece.dtype != tensor.dtype or tuple(piece.shape[1:]) != tensor.row_shape:
                raise ValueError(f"{tensor.name}: a piece of {piece.dtype} {list(piece.shape)} in a tensor of rows "
                                 f"{tensor.dtype} {list(tensor.row_shape)}")  # fmt: skip
        end = start + tensor.nbytes
        entries[tensor.name] = {
            "dtype": _NAME[tensor.dtype],
            "shape": [tensor.rows, *tensor.row_shape],
            "data_offsets": [start, end],
        }
        start = end
    header = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    header += b" " * (-(8 + len(header)) % 8)
    if align:
        header += b" " * _alignment_padding(tensors, 8 + len(header))
    return struct.pack("<Q", len(header)) + header


def _alignment_padding(tensors: Sequence[ChunkTensor], data_start: int) -> int:
    """Spaces (a multiple of 8) that put the largest tensor's first piece at its memory's offset modulo ALIGN."""
    ordered = file_order(tensors)
    largest = max(ordered, key=lambda tensor: tensor.nbytes, default=None)
    if largest is None or not largest.pieces or not largest.nbytes:
        return 0
    before = sum(tensor.nbytes for tensor in ordered[: ordered.index(largest)])
    padding = (largest.pieces[0].data_ptr() - data_start - before) % ALIGN
    return padding if padding % 8 == 0 else 0  # a header stays a multiple of 8 bytes long


def file_order(tensors: Sequence[ChunkTensor]) -> list[ChunkTensor]:
    return sorted(tensors, key=lambda tensor: (_RANK[tensor.dtype], tensor.name))


def chunk_buffers(tensors: Sequence[ChunkTensor], metadata: dict[str, str], align: bool = False) -> list[memoryview]:
    """The chunk's bytes in file order, as views of the header and of every piece's memory (nothing copied)."""
    buffers = [memoryview(chunk_header(tensors, metadata, align))]
    for tensor in file_order(tensors):
        buffers += [_bytes_of(piece) for piece in tensor.pieces if piece.numel()]
    return buffers


class WrittenChunk(NamedTuple):
    size: int
    sha256: str
    direct: bool  # written with O_DIRECT (False: buffered, asked so or refused by the file system)


def write_chunk(
    path: Path,
    tensors: Sequence[ChunkTensor],
    metadata: dict[str, str],
    hasher: Executor,
    *,
    direct: bool = False,
    cpu: CpuAccount | None = None,
) -> WrittenChunk:
    """Write the chunk atomically (write_atomic: whole or absent; ``direct``: with O_DIRECT where the file system
    takes it) while ``hasher`` hashes the same memory. The pieces must not change until this returns. ``cpu``: where
    the serialisation, write, fsync and hash CPU time are added."""
    if cpu is None:
        cpu = CpuAccount()  # measured and dropped: one code path
    with cpu.part("serialisation"):
        buffers = chunk_buffers(tensors, metadata, align=direct)
    digest = hasher.submit(_sha256, buffers, cpu)
    try:
        wrote_direct = write_atomic(path, buffers, direct=direct, cpu=cpu)
    finally:
        sha256 = digest.result()  # the hashing thread is done with the memory before the caller may reuse it
    return WrittenChunk(sum(buffer.nbytes for buffer in buffers), sha256, wrote_direct)


def _sha256(buffers: Sequence[memoryview], cpu: CpuAccount) -> str:
    with cpu.part("hash"):
        digest = hashlib.sha256()
        for buffer in buffers:
            for start in range(0, buffer.nbytes, HASH_PIECE):
                digest.update(buffer[start : start + HASH_PIECE])
        return digest.hexdigest()


def _bytes_of(piece: torch.Tensor) -> memoryview:
    if piece.device.type != "cpu" or not piece.is_contiguous():
        raise ValueError("chunk pieces must be contiguous tensors in host memory")
    return piece.reshape(-1).view(torch.uint8).numpy().data  # a view of the tensor's own memory
