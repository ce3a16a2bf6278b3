"""One batch through the device: its ids padded and sent, the forward pass, the real tokens of every captured layer
gathered, reduced and copied into the batch's rows of the staging ring (batch_states.py), and its ids and masks
beside them; the calling thread's CPU time added by part (cpu_account.py).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from hsx_dagster.core.extraction.backbone import Backbone
from hsx_dagster.core.extraction.batch_states import copy_to_host, stage_states
from hsx_dagster.core.extraction.timing import LapTimer
from hsx_dagster.core.storage.chunk_writer import StagedBatch
from hsx_dagster.core.storage.cpu_account import CpuAccount


def run_batch(
    backbone: Backbone,
    rows: np.ndarray,
    input_ids: pa.ListArray,
    loss_mask: pa.ListArray,
    staged: StagedBatch,
    storage_dtype: torch.dtype,
    pad_token_id: int,
    timer: LapTimer,
    measured: bool = False,
    cpu: CpuAccount | None = None,
) -> None:
    """One forward pass over ``rows`` (right-padded), its states gathered, reduced and copied into the ``staged``
    rows on the device (batch_states.py); on a GPU the copy is still under way when this returns (``staged.ready``).
    ``cpu``: where the calling thread's CPU time is added (inputs, forward, gather_and_copy)."""
    cpu = cpu or CpuAccount()
    with cpu.part("inputs"):
        input_tensor, mask_tensor, positions, lengths, ids_per_row = _batch_inputs(
            backbone, rows, input_ids, staged, pad_token_id
        )
    views = staged.views
    with cpu.part("forward"):
        started = timer.start(sync=measured)
        captured = backbone.forward(input_tensor, mask_tensor)
    with cpu.part("gather_and_copy"):
        info = backbone.info
        copies = stage_states(
            captured, info.layers.capture_keys, lengths, positions, views, storage_dtype, info.include_final
        )
        del captured
        timer.stop(started, sync=measured)
        copy_to_host(copies)
        ids_rows, mask_rows, start = views["input_ids"].numpy(), views["loss_mask"].numpy(), 0
        for r, ids in zip(rows, ids_per_row):
            ids_rows[start : start + len(ids)] = ids
            mask_rows[start : start + len(ids)] = loss_mask[int(r)].values.to_numpy(zero_copy_only=False)
            start += len(ids)
        if positions is not None:
            # blocking: the writer waiting for the copy sleeps; a default event spins a core for the whole batch
            staged.ready = torch.cuda.Event(blocking=True)
            staged.ready.record()


def _batch_inputs(
    backbone: Backbone, rows: np.ndarray, input_ids: pa.ListArray, staged: StagedBatch, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int], list[np.ndarray]]:
    """The batch's ids right-padded and its attention mask, on the device; on a GPU the flat positions of its real
    tokens too; the lengths and the ids of every row."""
    ids_per_row = [input_ids[int(r)].values.to_numpy(zero_copy_only=False) for r in rows]
    lengths = [len(ids) for ids in ids_per_row]
    if lengths != staged.lengths:
        raise RuntimeError(f"the tokenized rows hold {lengths} tokens where num_tokens says {staged.lengths}")
    longest = max(lengths)
    padded = np.full((len(rows), longest), pad_token_id, dtype=np.int64)
    attention = np.zeros((len(rows), longest), dtype=np.int64)
    for k, ids in enumerate(ids_per_row):
        padded[k, : len(ids)] = ids
        attention[k, : len(ids)] = 1
    device = next(backbone.model.parameters()).device
    cuda = device.type == "cuda"
    input_tensor, mask_tensor = torch.from_numpy(padded), torch.from_numpy(attention)
    positions = None
    if cuda:
        # Flat positions of the real tokens (row by row, in order), computed on the host: gathering with a boolean
        # mask on the device would force a device-to-host synchronisation every batch.
        positions = torch.from_numpy(np.concatenate([k * longest + np.arange(n) for k, n in enumerate(lengths)]))
        input_tensor, mask_tensor, positions = (
            tensor.pin_memory().to(device, non_blocking=True) for tensor in (input_tensor, mask_tensor, positions)
        )
    return input_tensor, mask_tensor, positions, lengths, ids_per_row
