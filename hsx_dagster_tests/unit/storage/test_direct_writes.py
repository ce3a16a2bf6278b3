"""Chunk files written with O_DIRECT from the staging ring: the same tensors as a buffered write, the file cut to its
true size, the sha256 that of the bytes on disk, the states taken from the ring's memory (the header padded so they
line up), and buffered writes where the file system refuses O_DIRECT (at open or at a write)."""

import errno
import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hsx_dagster.core.storage import ChunkTensor, RowSpec, StagingRing, atomic as atomic_module, direct_io, write_chunk
from hsx_dagster.core.storage.atomic import ALIGN, O_DIRECT
from hsx_dagster.core.storage.cpu_account import CpuAccount
from hsx_dagster.core.storage.direct_io import choose_direct, filesystem_type

pytestmark = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
METADATA = {"format": "hsx-hidden-states", "shard": "shard-00"}


def _ring_chunk(tokens: int = 300, start: int = 7) -> tuple[list[ChunkTensor], dict[str, torch.Tensor]]:
    """A chunk's tensors as rows ``start:start + tokens`` of a staging ring (the states 2 x 512 bfloat16 per token:
    large enough to be written straight from the ring), and the same tensors whole."""
    specs = {"hidden_states": RowSpec((2, 512), torch.bfloat16), "input_ids": RowSpec((), torch.int32),
             "loss_mask": RowSpec((), torch.uint8)}  # fmt: skip
    ring = StagingRing(specs, 1024)
    generator = torch.Generator().manual_seed(0)
    for name, buffer in ring.buffers.items():
        assert buffer.data_ptr() % ALIGN == 0, f"{name}: the ring's rows start on a page boundary"
        buffer.copy_((torch.randn(buffer.shape, generator=generator) * 100).to(buffer.dtype))
    views = ring.views(start, start + tokens)
    offsets = torch.tensor([0, 100, tokens])
    tensors = [ChunkTensor(name, view.dtype, tuple(view.shape[1:]), (view,)) for name, view in views.items()]
    tensors += [ChunkTensor.whole("offsets", offsets), ChunkTensor.whole("sample_ids", torch.tensor([4, 9]))]
    whole = {name: view.clone() for name, view in views.items()} | {
        "offsets": offsets,
        "sample_ids": torch.tensor([4, 9]),
    }
    return tensors, whole


def _header(path: Path) -> tuple[dict, int]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), 8 + length


def test_a_direct_write_holds_the_buffered_tensors_at_their_true_size_from_the_rings_memory(tmp_path):
    tensors, whole = _ring_chunk()
    cpu = CpuAccount()
    with ThreadPoolExecutor(1) as hasher:
        direct = write_chunk(tmp_path / "direct.safetensors", tensors, METADATA, hasher, direct=True, cpu=cpu)
        buffered = write_chunk(tmp_path / "buffered.safetensors", tensors, METADATA, hasher)
    if not direct.direct:
        pytest.skip(f"the test folder's file system ({filesystem_type(tmp_path)}) takes no direct writes")
    assert not buffered.direct
    on_disk = (tmp_path / "direct.safetensors").read_bytes()
    assert len(on_disk) == direct.size and direct.size % ALIGN  # cut back to its true size after the padded block
    assert direct.sha256 == hashlib.sha256(on_disk).hexdigest()  # the hash of the bytes written, from memory
    header, data_start = _header(tmp_path / "direct.safetensors")
    states_at = data_start + header["hidden_states"]["data_offsets"][0]
    assert (states_at - tensors[0].pieces[0].data_ptr()) % ALIGN == 0  # lined up: written from the ring itself
    assert header == _header(tmp_path / "buffered.safetensors")[0]  # the same layout, only the padding differs
    for name, tensor in load_file(tmp_path / "direct.safetensors").items():
        assert torch.equal(tensor.view(torch.uint8), whole[name].view(torch.uint8)), name
    assert cpu.seconds["hash"] > 0 and cpu.seconds["write"] > 0  # the account saw both threads' parts


def test_a_file_system_that_refuses_o_direct_at_open_gets_buffered_writes(tmp_path, monkeypatch):
    def refusing_opener(path: str, flags: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument", path)  # what tmpfs before Linux 6.6 says

    monkeypatch.setattr(atomic_module, "_direct_opener", refusing_opener)
    tensors, _ = _ring_chunk()
    with ThreadPoolExecutor(1) as hasher:
        written = write_chunk(tmp_path / "c.safetensors", tensors, METADATA, hasher, direct=True)
    assert not written.direct
    assert written.sha256 == hashlib.sha256((tmp_path / "c.safetensors").read_bytes()).hexdigest()


def test_auto_writes_direct_on_ext4_and_xfs_only(tmp_path, monkeypatch):
    table = tmp_path / "mountinfo"
    table.write_text(
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        f"30 25 0:27 / {tmp_path}/fast rw,relatime - xfs /dev/nvme0n1 rw\n"
        f"31 25 0:28 / {tmp_path}/shared rw,relatime - nfs4 server:/export rw\n"
    )
    monkeypatch.setattr(direct_io, "MOUNTINFO", table)
    assert choose_direct("auto", tmp_path / "fast" / "shard-00") == (True, "direct (direct_io: auto, xfs)")
    assert choose_direct("auto", tmp_path) == (True, "direct (direct_io: auto, ext4)")
    assert choose_direct("auto", tmp_path / "shared" / "x") == (
        False,
        "buffered (direct_io: auto, nfs4: direct writes are used on ext4, xfs)",
    )
    assert choose_direct("on", tmp_path / "shared") == (True, "direct (direct_io: on)")
    assert choose_direct("off", tmp_path / "fast") == (False, "buffered (direct_io: off)")
    with pytest.raises(ValueError, match=r"extraction\.direct_io must be one of"):
        choose_direct("sometimes", tmp_path)


def test_a_write_refused_half_way_goes_on_buffered(tmp_path, monkeypatch):
    """A file system that opens with O_DIRECT and refuses a write (EINVAL) gets the rest written buffered: the file
    is whole and its hash that of its bytes."""
    real_open = open
    refused = []

    class RefusesOnce:
        def __init__(self, handle) -> None:
            self.handle = handle

        def write(self, data):
            if not refused:
                refused.append(len(data))
                raise OSError(errno.EINVAL, "Invalid argument")
            return self.handle.write(data)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def refusing_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        return RefusesOnce(handle) if kwargs.get("opener") is not None else handle

    monkeypatch.setattr(atomic_module, "open", refusing_open, raising=False)
    tensors, whole = _ring_chunk()
    with ThreadPoolExecutor(1) as hasher:
        written = write_chunk(tmp_path / "c.safetensors", tensors, METADATA, hasher, direct=True)
    if not refused:
        pytest.skip(f"the test folder's file system ({filesystem_type(tmp_path)}) takes no direct writes")
    assert not written.direct
    assert written.sha256 == hashlib.sha256((tmp_path / "c.safetensors").read_bytes()).hexdigest()
    for name, tensor in load_file(tmp_path / "c.safetensors").items():
        assert torch.equal(tensor.view(torch.uint8), whole[name].view(torch.uint8)), name
