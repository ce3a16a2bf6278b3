"""SpecForge's offline data path, written from an assembled drafter dataset.

SpecForge 0.2 lists ``*.ckpt`` files under its ``--hidden-states-path`` (sorted by path, so the names are
zero-padded) and loads each with ``torch.load``: one sample per file, a dict of tensors
(``specforge.runtime.data_plane.offline_reader`` and the per-algorithm normalisers):
- EAGLE-3: ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``hidden_state`` [1, T, H] (what the LM head reads:
  the final norm's output; SpecForge's ``TargetHead`` applies only the LM head to it) and ``aux_hidden_state``
  [1, T, 3H] (three layers concatenated, SGLang's ids = ours);
- DFlash: ``input_ids``, ``loss_mask`` and ``hidden_states`` [1, T, K*H] (the draft's ``target_layer_ids`` = ours).

This is the one pickle-based container the project writes: tensors only (loadable with ``weights_only=True``),
and only when asked (`export.specforge` or selecting ``specforge_dataset``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from hsx_dagster.core.dataset.reader import DrafterDataset
from hsx_dagster.core.export.file_pool import ROWS_PER_BATCH, dataset_indices, write_rows
from hsx_dagster.core.export.folder import ExportFolder
from hsx_dagster.core.export.mapping import LayerMapping, specforge_mapping
from hsx_dagster.core.export.speculators import row_order
from hsx_dagster.core.storage.atomic import write_atomic
from hsx_dagster.core.storage.files import folder_bytes

EXPORT_FILE = "hsx_export.json"
ROWS_PER_FOLDER = 5000


@dataclass(frozen=True)
class SpecForgeExport:
    path: Path
    rows: int
    train_rows: int
    bytes: int
    mapping: LayerMapping
    layout: str
    command: str


def sample_file(row: int) -> str:
    start = row // ROWS_PER_FOLDER * ROWS_PER_FOLDER
    return f"rows_{start:08d}-{start + ROWS_PER_FOLDER - 1:08d}/data_{row:08d}.ckpt"


def sample_tensors(sample: dict, mapping: LayerMapping, layout: str) -> dict[str, torch.Tensor]:
    """One file's tensors, shaped as SpecForge's offline normaliser for ``layout`` reads them."""
    states = sample["hidden_states"][:, list(mapping.aux_positions)]  # [T, K, H]
    concatenated = states.flatten(1).unsqueeze(0)  # [1, T, K*H], layers in mapping order (indexing copied them)
    tensors = {"input_ids": sample["input_ids"].to(torch.int64), "loss_mask": sample["loss_mask"].to(torch.int64)}
    if layout == "dflash":
        tensors["hidden_states"] = concatenated
    else:
        tensors |= {"aux_hidden_state": concatenated, "hidden_state": sample["final_hidden_states"].unsqueeze(0)}
    return {name: _owning(tensor) for name, tensor in tensors.items()}


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a storage of its own: torch.save writes a tensor's whole storage, so a view into the chunk
    it was read from would carry the chunk along. Copied only when it is such a view."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def train_command(path: Path, model_path: str, layout: str) -> str:
    return f"specforge train --algorithm {layout} --target-model-path {model_path} --hidden-states-path {path}"


@dataclass(frozen=True)
class SpecForgeRows:
    """One ``.ckpt`` per row (file_pool.RowWriter): the sample's tensors as ``layout`` reads them, pickled by
    ``torch.save`` straight into the file."""

    drafter_dir: Path
    work: Path
    mapping: LayerMapping
    layout: str

    def path(self, row: int) -> Path:
        return self.work / sample_file(row)

    def write(self, sample: dict, handle: BinaryIO) -> None:
        torch.save(sample_tensors(sample, self.mapping, self.layout), handle)


def export_specforge(
    drafter_dir: Path,
    dest: Path,
    *,
    layout: str = "eagle3",
    progress: Callable[[str], None] | None = None,
    workers: int | None = None,
    pool: str = "auto",
) -> SpecForgeExport:
    """Write ``dest`` (renamed into place when complete); a re-run resumes an interrupted export, keeping the files
    it wrote whole. ``workers`` (default: the cores this process may use) of kind ``pool`` write the files."""
    dataset = DrafterDataset(drafter_dir)
    mapping = specforge_mapping(
        dataset.layer_ids, dataset.num_hidden_layers, dataset.record.layers.include_final, layout
    )  # fails before anything is written
    order, train_rows = row_order(drafter_dir)
    command = train_command(dest, str(dataset.record.model_path), layout)
    spec = {
        "format": "hsx-specforge-export",
        "version": 1,
        "layout": layout,
        "drafter_dataset": str(Path(drafter_dir).resolve()),
        "drafter_created_at": dataset.record.created_at,
        "mapping": mapping.to_dict(),
    }
    folder = ExportFolder(dest, spec)
    if not folder.complete():
        work = folder.begin()
        rows = SpecForgeRows(Path(drafter_dir), work, mapping, layout)
        every = max(1000, len(order) // 20)

        def report(done: int, total: int) -> None:
            if progress and (done == total or done // every != (done - ROWS_PER_BATCH) // every):
                progress(f"specforge {layout}: {done:,}/{total:,} rows")

        write_rows(rows, dataset_indices(dataset, order), workers=workers, kind=pool, progress=report)
        export = {
            **spec,
            "rows": len(order),
            "train_rows": train_rows,
            "sample_ids": order.tolist(),
            "command": command,
        }
        write_atomic(work / EXPORT_FILE, json.dumps(export, indent=2).encode())
        folder.finish()
    return SpecForgeExport(dest, len(order), train_rows, folder_bytes(dest), mapping, layout, command)
