"""Per-layer statistics of a chunk's states, computed once when the chunk is written and kept in its index record.

The writer has every state in memory anyway; the numerics checks then add up these records instead of reading
and de-quantising the whole shard again. They stay true to the bytes on disk because the integrity check proves
each chunk still has the sha256 recorded in the same index line. Chunks written before the records carried
statistics are read and computed by the checks as before.

Per stored slot (``layer {i}`` for each layer id, then ``final``): the sum and the sum of squares of its values
(float64), whether any value is non-zero, and the samples holding a NaN or Inf anywhere (none, when the writer's
screening kept them out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hsx_dagster.core.storage.format import SCALES_SUFFIX
from hsx_dagster.core.storage.quantization import dequantize

BLOCK_TOKENS = 2048  # tokens converted to float32 at a time: bounded extra memory


def chunk_statistics(tensors: dict[str, torch.Tensor], offsets: torch.Tensor, sample_ids: Sequence[int]) -> dict:
    """The statistics of a chunk's ``tensors`` (as stored: fp8 with their scales), JSON-ready."""
    tokens = int(offsets[-1])
    sums, squares, nonzero, bad_tokens = None, None, None, []
    for start in range(0, max(tokens, 1), BLOCK_TOKENS):
        states = _float_states(tensors, start, min(start + BLOCK_TOKENS, tokens))  # [t, slots, H]
        if states.shape[0] == 0:
            break
        finite = torch.isfinite(states)
        if not bool(finite.all()):
            bad_tokens += (torch.nonzero(~finite.all(dim=2).all(dim=1)).flatten() + start).tolist()
            states = torch.where(finite, states, torch.zeros((), dtype=states.dtype))
        block_sums = states.sum(dim=(0, 2), dtype=torch.float64)
        block_squares = states.square().sum(dim=(0, 2), dtype=torch.float64)
        block_nonzero = (states != 0).any(dim=2).any(dim=0)
        sums = block_sums if sums is None else sums + block_sums
        squares = block_squares if squares is None else squares + block_squares
        nonzero = block_nonzero if nonzero is None else nonzero | block_nonzero
    owners = torch.searchsorted(offsets, torch.tensor(bad_tokens, dtype=offsets.dtype), right=True) - 1
    hidden = tensors["hidden_states"].shape[-1]
    return {
        "values_per_slot": tokens * hidden,
        "sum": sums.tolist() if sums is not None else [],
        "sum_of_squares": squares.tolist() if squares is not None else [],
        "nonzero": nonzero.tolist() if nonzero is not None else [],
        "nonfinite_samples": sorted({int(sample_ids[int(k)]) for k in owners}),
    }


def _float_states(tensors: dict[str, torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Tokens ``start:end`` of every stored slot, de-quantised, as float32 [t, slots, H]."""
    parts = []
    for name in ("hidden_states", "final_hidden_states"):
        if name not in tensors:
            continue
        states = tensors[name][start:end]
        scales = tensors.get(name + SCALES_SUFFIX)
        states = dequantize(states, scales[start:end], torch.float32) if scales is not None else states.float()
        parts.append(states if name == "hidden_states" else states.unsqueeze(1))
    return torch.cat(parts, dim=1)


def recorded(stats: Any) -> bool:
    """Whether an index record carries usable statistics (records written before they were kept do not)."""
    return isinstance(stats, dict) and "sum" in stats and "values_per_slot" in stats
