"""Per-layer statistics of a chunk's states, reduced on the device before the copy and kept in the chunk's index record.

The numerics checks add these records up instead of reading and de-quantising the whole shard again. They stay true
to the bytes on disk because the integrity check proves each chunk still has the sha256 recorded in the same index
line. Chunks written before the records carried statistics are read and computed by the checks as before
(chunk_checks.LayerStatistics.add_chunk, which also recomputes them for the tests that prove the two agree).

Where the states are, before the device-to-host copy, every token is reduced per stored slot (``layer {i}`` for each
layer id, then ``final``) to three numbers (`token_statistics`): the float32 sum and sum of squares of its values as
stored (fp8 de-quantised), and whether it is non-finite. They travel with the batch's rows through the staging ring
(a few bytes per token beside kilobytes of states); the writer adds them up per chunk in float64
(`chunk_statistics_of`) and screens the flags (`nonfinite_samples`): the host never touches the states for either.

A token counts as non-finite when the float32 sum of its values before any quantisation is not finite: NaN or Inf
anywhere in it (NaN spreads through a sum, and Inf stays Inf or becomes NaN), or finite values so large (beyond
10^38) that they add up past float32's range, which no usable state holds.

Recorded per slot: the sum and the sum of squares of its values (float64), whether any value is non-zero, and the
samples holding a NaN or Inf anywhere (none: the writer's screening keeps them out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

STAT_TENSORS = ("token_sum", "token_sum_of_squares", "token_nonfinite")  # per token and slot, in the staging ring
BLOCK_TOKENS = 256  # tokens converted to float32 at a time on a CPU (cache-sized; a GPU takes the batch at once)


def token_statistics(values: torch.Tensor, sums: torch.Tensor, squares: torch.Tensor) -> None:
    """The float32 sum and sum of squares of each row of ``values`` ([T, H], any float dtype), into ``sums`` and
    ``squares`` ([T] float32, on ``values``' device)."""
    block = values.shape[0] if values.device.type != "cpu" else BLOCK_TOKENS
    for start in range(0, values.shape[0], block):
        rows = values[start : start + block].float()
        torch.sum(rows, dim=-1, out=sums[start : start + block])
        torch.linalg.vector_norm(rows, dim=-1, out=squares[start : start + block])
    squares.square_()


def chunk_statistics_of(runs: Sequence[dict[str, torch.Tensor]], slot_names: Sequence[str], tokens: int) -> dict:
    """The statistics of a chunk (JSON-ready) from the staged rows it is written from: ``runs`` are row ranges of
    the staging ring (name -> rows), which carry the per-token reductions beside the states."""
    slots = len(slot_names)
    sums, squares = np.zeros(slots), np.zeros(slots)
    for run in runs:
        sums += run["token_sum"].numpy().sum(axis=0, dtype=np.float64)
        squares += run["token_sum_of_squares"].numpy().sum(axis=0, dtype=np.float64)
    nonzero = squares > 0
    for slot in np.flatnonzero(~nonzero):  # squares of tiny values underflow to 0: look at the values themselves
        nonzero[slot] = any(bool((_slot_values(run, int(slot)) != 0).any()) for run in runs)
    hidden = runs[0]["hidden_states"].shape[-1] if runs else 0
    return {
        "values_per_slot": tokens * hidden,
        "sum": sums.tolist() if tokens else [],
        "sum_of_squares": squares.tolist() if tokens else [],
        "nonzero": nonzero.tolist() if tokens else [],
        "nonfinite_samples": [],  # screened out before they reach a chunk (nonfinite_samples below)
    }


def _slot_values(run: dict[str, torch.Tensor], slot: int) -> torch.Tensor:
    layers = run["hidden_states"].shape[1]
    values = run["hidden_states"][:, slot] if slot < layers else run["final_hidden_states"]
    return values.float()


def nonfinite_samples(flags: np.ndarray, lengths: Sequence[int], slot_names: Sequence[str]) -> dict[int, str]:
    """Position in the batch -> which layers hold NaN/Inf, for the samples that have any (``flags``: [T, slots])."""
    if not flags.any():
        return {}
    found, start = {}, 0
    for position, length in enumerate(lengths):
        sample = flags[start : start + length]
        bad_slots = [bool(bad) for bad in np.asarray(sample.any(axis=0)).tolist()]
        if any(bad_slots):
            tokens = int(sample.any(axis=1).sum())
            layers = ", ".join(name for name, bad in zip(slot_names, bad_slots) if bad)
            found[position] = f"NaN or Inf in {tokens} of {length} tokens ({layers})"
        start += length
    return found


def recorded(stats: Any) -> bool:
    """Whether an index record carries usable statistics (records written before they were kept do not)."""
    return isinstance(stats, dict) and "sum" in stats and "values_per_slot" in stats
