"""Reading chunks back: one sample's tokens as memory-mapped slices, fp8 de-quantised on request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hsx_dagster.core.storage.format import SCALES_SUFFIX, STATE_TENSORS
from hsx_dagster.core.storage.quantization import dequantize
from hsx_dagster.core.storage.shard_store import read_index


def iter_shard_samples(directory: Path, dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor | int]]:
    """Every committed sample of a shard, in commit order, read through memory-mapped slices;
    states in ``dtype`` (default: as stored, bfloat16 for fp8), see `read_sample`."""
    directory = Path(directory)
    for record in read_index(directory):
        with safe_open(str(directory / record.chunk), framework="pt") as chunk:
            offsets = chunk.get_tensor("offsets").tolist()
            sample_ids = chunk.get_tensor("sample_ids").tolist()
            for k, sample_id in enumerate(sample_ids):
                yield {"sample_id": sample_id, **read_sample(chunk, offsets[k], offsets[k + 1], dtype=dtype)}


def read_sample(
    chunk: Any, start: int, end: int, dtype: torch.dtype | None = None, raw: bool = False
) -> dict[str, torch.Tensor]:
    """Tokens ``start:end`` of an open chunk (memory-mapped slices, nothing else is read).

    States come back in ``dtype``; by default as stored, except fp8, which is de-quantised to
    bfloat16 (exactly: see quantization.py). ``raw=True`` hands fp8 states out as stored with their
    ``*_scales`` beside them, for trainers that de-quantise on their own device.
    """
    names = set(chunk.keys())
    sample = {
        "input_ids": chunk.get_slice("input_ids")[start:end].to(torch.int64),
        "loss_mask": chunk.get_slice("loss_mask")[start:end],
    }
    for name in STATE_TENSORS:
        if name not in names:
            continue
        states = chunk.get_slice(name)[start:end]
        scales_name = name + SCALES_SUFFIX
        if scales_name in names:
            scales = chunk.get_slice(scales_name)[start:end]
            if raw:
                sample[scales_name] = scales
            else:
                states = dequantize(states, scales, dtype or torch.bfloat16)
        if dtype is not None and not raw:
            states = states.to(dtype)
        sample[name] = states
    return sample
