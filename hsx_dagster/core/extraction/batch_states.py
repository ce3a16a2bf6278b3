"""What the device does with one batch's captured layers before anything reaches the host: gather the real tokens of
every stored slot in the stored layout, reduce them to per-token statistics (chunk_stats.py), quantise them to fp8
when asked, and copy the result into the batch's rows of the host staging ring (staging.py): one copy per batch.

On a GPU every slot is gathered with one index into device memory, and the copy into the pinned staging rows is
asynchronous: the writer waits for the batch's CUDA event, the device goes on with the next batch. On the CPU the
device is the host: each row's real tokens are copied straight into the staging rows, so the states are neither
allocated nor copied a second time (large allocations made and freed batch after batch cost more system time than
the copies).

Rows are right-padded (real tokens first), so the real tokens of row ``k`` are its first ``lengths[k]`` positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hsx_dagster.core.storage.chunk_stats import token_statistics
from hsx_dagster.core.storage.format import SCALES_SUFFIX
from hsx_dagster.core.storage.quantization import FP8_DTYPE, block_size_for, dequantize, quantize

HIDDEN, FINAL = "hidden_states", "final_hidden_states"


def stage_states(
    captured: dict[int | str, torch.Tensor],
    keys: Sequence[int | str],
    lengths: Sequence[int],
    positions: torch.Tensor | None,
    rows: dict[str, torch.Tensor],
    storage_dtype: torch.dtype,
    include_final: bool,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Make the states of one batch for its staging ``rows`` (views of the ring: states, fp8 scales, per-token
    statistics) from the ``captured`` layers ([B, S, H] each, in the order of ``keys``: layer ids, then the final
    norm's output when ``include_final``). ``positions``: the flat positions of the real tokens, on the device (not
    needed on a CPU). Returns the copies into the rows still to make (`copy_to_host`): the device's work is timed
    apart from them."""
    first = captured[keys[0]]
    tokens, hidden, device = int(sum(lengths)), first.shape[-1], first.device
    fp8 = storage_dtype == FP8_DTYPE
    layers = len(keys) - int(include_final)
    straight = device.type == "cpu" and not fp8  # gather into the staging rows themselves
    work_dtype = first.dtype if fp8 else storage_dtype
    if straight:
        stored = {HIDDEN: rows[HIDDEN], **({FINAL: rows[FINAL]} if include_final else {})}
    else:
        stored = {HIDDEN: torch.empty((tokens, layers, hidden), dtype=work_dtype, device=device)}
        if include_final:
            stored[FINAL] = torch.empty((tokens, hidden), dtype=work_dtype, device=device)
    slots = [stored[HIDDEN][:, slot] for slot in range(layers)] + ([stored[FINAL]] if include_final else [])
    for key, target in zip(keys, slots):
        _gather(captured[key], lengths, positions, target)
    sums = torch.empty((len(slots), tokens), dtype=torch.float32, device=device)
    squares = torch.empty_like(sums)
    if fp8:
        before = torch.stack([slot.sum(dim=-1, dtype=torch.float32) for slot in slots])  # Inf is clamped below
        stored = _quantized(stored, hidden)
        for slot, values in enumerate(_slots(stored, layers, include_final)):
            token_statistics(values, sums[slot], squares[slot])
        nonfinite = ~torch.isfinite(before)
    else:
        for slot, values in enumerate(slots):
            token_statistics(values, sums[slot], squares[slot])
        nonfinite = ~torch.isfinite(sums)
    copies = [] if straight else [(rows[name], tensor) for name, tensor in stored.items()]
    reductions = {"token_sum": sums, "token_sum_of_squares": squares, "token_nonfinite": nonfinite}
    return copies + [(rows[name], values.t()) for name, values in reductions.items()]


def copy_to_host(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The copies `stage_states` left: asynchronous from a GPU into the pinned rows (the writer waits for the
    batch's event before reading them)."""
    for target, source in copies:
        target.copy_(source, non_blocking=source.device.type == "cuda")


def _gather(layer: torch.Tensor, lengths: Sequence[int], positions: torch.Tensor | None, target: torch.Tensor) -> None:
    """The real tokens of ``layer`` ([B, S, H]), row after row, into ``target`` ([T, H], cast on the copy)."""
    if layer.device.type == "cpu" or positions is None:
        start = 0
        for row, length in enumerate(lengths):
            target[start : start + length].copy_(layer[row, :length])
            start += length
    else:  # one kernel per slot rather than one per row
        target.copy_(layer.reshape(-1, layer.shape[-1]).index_select(0, positions))


def _quantized(stored: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """fp8 states with their scales, on the device (so half the bytes cross to the host)."""
    quantized = {}
    for name, tensor in stored.items():
        quantized[name], quantized[name + SCALES_SUFFIX] = quantize(tensor, block_size_for(hidden))
    return quantized


def _slots(stored: dict[str, torch.Tensor], layers: int, include_final: bool) -> list[torch.Tensor]:
    """Every stored slot's values as the chunk will hold them, de-quantised to float32 ([T, H] each)."""
    scales = stored[HIDDEN + SCALES_SUFFIX]
    values = [dequantize(stored[HIDDEN][:, slot], scales[:, slot], torch.float32) for slot in range(layers)]
    if include_final:
        values.append(dequantize(stored[FINAL], stored[FINAL + SCALES_SUFFIX], torch.float32))
    return values
