"""A chunk written from its pieces' memory is the file safetensors itself writes for the same tensors, and its
recorded sha256 is the file's."""

import hashlib
import itertools
import json
import re
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from hsx_dagster.core.storage import ChunkTensor, chunk_header, write_chunk

METADATA = {"format": "hsx-hidden-states", "shard": "shard-00", "storage_dtype": "bfloat16", "zeta": "ü", "alpha": "1"}


def _pieces(tensor: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, ...]:
    bounds = [0, *cuts, tensor.shape[0]]
    return tuple(tensor[a:b].contiguous() for a, b in itertools.pairwise(bounds))


def _chunk(fp8: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = 37
    states = torch.randn(tokens, 3, 64, generator=generator)
    tensors = {
        "input_ids": torch.randint(0, 1000, (tokens,), generator=generator, dtype=torch.int32),
        "loss_mask": torch.randint(0, 2, (tokens,), generator=generator, dtype=torch.uint8),
        "offsets": torch.tensor([0, 5, 17, 37]),
        "sample_ids": torch.tensor([10, 3, 99]),
        "final_hidden_states": torch.randn(tokens, 64, generator=generator).to(torch.bfloat16),
    }
    if fp8:
        tensors["hidden_states"] = states.clamp(-400, 400).to(torch.float8_e4m3fn)
        tensors["hidden_states_scales"] = torch.ones(tokens, 3, 1, dtype=torch.bfloat16)
    else:
        tensors["hidden_states"] = states.to(torch.bfloat16)
    return tensors


def _as_pieces(tensors: dict[str, torch.Tensor]) -> list[ChunkTensor]:
    """Token-major tensors cut in three pieces (as rows of the staging ring are), the per-sample ones whole."""
    chunk = []
    for name, tensor in tensors.items():
        if name in ("offsets", "sample_ids"):
            chunk.append(ChunkTensor.whole(name, tensor))
        else:
            chunk.append(ChunkTensor(name, tensor.dtype, tuple(tensor.shape[1:]), _pieces(tensor, [4, 4, 30])))
    return chunk


def _split(data: bytes) -> tuple[dict, bytes, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return header, data[8 : 8 + length], data[8 + length :]


@pytest.mark.parametrize("fp8", [False, True], ids=["bfloat16", "fp8"])
def test_a_chunk_is_the_file_safetensors_writes_for_the_same_tensors(fp8, tmp_path):
    tensors = _chunk(fp8)
    with ThreadPoolExecutor(1) as hasher:
        size, sha256, _ = write_chunk(tmp_path / "chunk.safetensors", _as_pieces(tensors), METADATA, hasher)
    ours = (tmp_path / "chunk.safetensors").read_bytes()
    theirs = save(tensors, metadata=METADATA)
    our_header, our_raw, our_data = _split(ours)
    their_header, _their_raw, their_data = _split(theirs)
    assert our_header == their_header  # tensor order, dtypes, shapes, offsets and metadata
    assert our_data == their_data and len(ours) == len(theirs) == size
    assert len(our_raw) % 8 == 0 and our_raw.rstrip(b" ") == our_raw.strip()  # padded with spaces, as safetensors
    assert list(json.loads(our_raw)["__metadata__"]) == sorted(METADATA)  # in a fixed order: reproducible bytes
    assert sha256 == hashlib.sha256(ours).hexdigest()
    loaded = load_file(tmp_path / "chunk.safetensors")  # safetensors validates the layout as it opens it
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name
    with safe_open(str(tmp_path / "chunk.safetensors"), framework="pt") as chunk:
        assert chunk.metadata() == METADATA
        assert torch.equal(chunk.get_slice("input_ids")[5:17], tensors["input_ids"][5:17])


def test_empty_pieces_and_a_tensor_without_rows_are_written(tmp_path):
    tensors = [
        ChunkTensor(
            "input_ids", torch.int32, (), (torch.empty(0, dtype=torch.int32), torch.arange(3, dtype=torch.int32))
        ),
        ChunkTensor("loss_mask", torch.uint8, (), ()),
    ]
    with ThreadPoolExecutor(1) as hasher:
        write_chunk(tmp_path / "c.safetensors", tensors, {}, hasher)
    loaded = load_file(tmp_path / "c.safetensors")
    assert loaded["input_ids"].tolist() == [0, 1, 2] and loaded["loss_mask"].shape == (0,)


def test_a_piece_that_does_not_fit_its_tensor_is_refused_naming_it():
    wrong = ChunkTensor("hidden_states", torch.bfloat16, (2, 8), (torch.zeros(3, 2, 4, dtype=torch.bfloat16),))
    with pytest.raises(ValueError, match=re.escape("hidden_states: a piece of torch.bfloat16 [3, 2, 4]")):
        chunk_header([wrong], {})
