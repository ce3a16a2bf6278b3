"""speculators' data path, written from an assembled drafter dataset.

speculators 0.9 (`speculators.train.data.ArrowDataset`) takes as ``--data-path`` a folder that ``datasets``'
``load_from_disk`` opens (one row per sample: ``input_ids``, ``loss_mask``, ``seq_len``, torch format), with
``token_freq.pt`` beside it (loss-masked token counts, ``torch.save`` of a dict, read with ``weights_only=True``)
and the states served per row by a hidden-states backend: ours, ``hsx`` (`hs_backend`), reads them from our
chunks; the plain ``file`` layout (``hidden_states/hs_<row>.safetensors``) is written on request.

Rows are the train split then the validation split, each in sample-id order, so speculators'
``--train-data-ratio`` (first rows train, the rest validate) gives back our split; the row order is the same for
the ``datasets`` rows, the backend and the ``file`` layout (the ``sample_id`` column records it).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from safetensors.torch import save as save_safetensors

from hsx_dagster.core.dataset.reader import DrafterDataset
from hsx_dagster.core.export.file_pool import dataset_indices, write_rows
from hsx_dagster.core.export.folder import ExportFolder
from hsx_dagster.core.export.mapping import LayerMapping, speculators_mapping
from hsx_dagster.core.export.row_groups import TokenCounts, masked_values, rows_in_order
from hsx_dagster.core.storage.atomic import write_atomic
from hsx_dagster.core.storage.files import atomic_output, folder_bytes

EXPORT_FILE = "hsx_export.json"  # the mapping, the drafter dataset served, the command line
ARROW_FILE = "data-00000-of-00001.arrow"
BACKEND = "hsx"
ROWS_PER_RECORD_BATCH = 1000
_LIST = {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"}
FEATURES = {
    "input_ids": _LIST,
    "loss_mask": _LIST,
    "seq_len": {"dtype": "int64", "_type": "Value"},
    "sample_id": {"dtype": "int64", "_type": "Value"},
}


@dataclass(frozen=True)
class SpeculatorsExport:
    path: Path
    rows: int
    train_rows: int
    bytes: int
    mapping: LayerMapping
    files: bool
    command: str


def row_order(drafter_dir: Path) -> tuple[np.ndarray, int]:
    """Sample ids in row order (train, then val, each by sample id) and the number of train rows."""
    train = np.sort(DrafterDataset(drafter_dir, split="train").sample_ids_array)
    val = np.sort(DrafterDataset(drafter_dir, split="val").sample_ids_array)
    return np.concatenate([train, val]).astype(np.int64), len(train)


def train_command(path: Path, model_path: str, mapping: LayerMapping, train_rows: int, rows: int, files: bool) -> str:
    """The command line that trains an EAGLE-3 drafter on the export (docs/trainers-speculators.md)."""
    ratio = (train_rows + 0.5) / rows if train_rows < rows else 1.0  # int(rows * ratio) == train_rows
    backend = "file" if files else BACKEND
    launcher = "speculators train" if files else "python -m hsx_dagster.core.export.speculators_train train"
    return (
        f"{launcher} --speculator-type eagle3 --verifier-name-or-path {model_path} --data-path {path} "
        f"--hidden-states-backend {backend} --on-missing raise --train-data-ratio {ratio:.6f} "
        f"--target-layer-ids {' '.join(str(i) for i in mapping.trainer_aux_ids)} "
        "--save-path checkpoints/eagle3"
    )


def export_speculators(
    drafter_dir: Path,
    tokenized_dir: Path,
    dest: Path,
    *,
    files: bool = False,
    progress: Callable[[str], None] | None = None,
) -> SpeculatorsExport:
    """Write ``dest`` (renamed into place when complete); a re-run resumes an interrupted export."""
    dataset = DrafterDataset(drafter_dir)
    mapping = speculators_mapping(dataset.layer_ids, dataset.num_hidden_layers)  # fails before anything is written
    order, train_rows = row_order(drafter_dir)
    command = train_command(dest, str(dataset.record.model_path), mapping, train_rows, len(order), files)
    spec = {
        "format": "hsx-speculators-export",
        "version": 1,
        "drafter_dataset": str(Path(drafter_dir).resolve()),
        "drafter_created_at": dataset.record.created_at,
        "mapping": mapping.to_dict(),
        "files": files,
    }
    folder = ExportFolder(dest, spec)
    if not folder.complete():
        work = folder.begin()
        _write_rows(work, tokenized_dir, dataset.record.shard_keys, order)
        if files:
            _write_files(work, dataset, mapping, order, progress)
        export = {**spec, "rows": len(order), "train_rows": train_rows, "backend": BACKEND, "command": command}
        write_atomic(work / EXPORT_FILE, json.dumps(export, indent=2).encode())
        folder.finish()
    return SpeculatorsExport(dest, len(order), train_rows, folder_bytes(dest), mapping, files, command)


def _write_rows(work: Path, tokenized_dir: Path, shards: list[str], order: np.ndarray) -> None:
    """The ``datasets`` folder (Arrow stream + state.json + dataset_info.json) and ``token_freq.pt``, streamed in
    row groups (row_groups.py): memory flat in the number of samples."""
    schema = pa.schema(
        [("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64()),
         ("sample_id", pa.int64())],
        metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})},
    )  # fmt: skip
    counts = TokenCounts()
    with atomic_output(work / ARROW_FILE) as sink, pa.ipc.new_stream(sink, schema) as writer:
        for group in rows_in_order(tokenized_dir, shards, order, work / ".row-groups"):
            counts.add(masked_values(group))
            ids = group.column("input_ids")
            rows = pa.table(
                [ids.cast(pa.list_(pa.int64())), group.column("loss_mask").cast(pa.list_(pa.int64())),
                 pc.list_value_length(ids).cast(pa.int64()), group.column("sample_id")],
                schema=schema,
            )  # fmt: skip
            writer.write_table(rows.combine_chunks(), max_chunksize=ROWS_PER_RECORD_BATCH)
    info = {"citation": "", "description": "hsx-dagster export", "features": FEATURES, "homepage": "", "license": ""}
    write_atomic(work / "dataset_info.json", json.dumps(info, indent=2).encode())
    state = {
        "_data_files": [{"filename": ARROW_FILE}],
        # datasets' cache key of the rows: a digest of the row order (not a tuple of 10^6 Python ints)
        "_fingerprint": f"hsx-{len(order)}-{hashlib.blake2b(order.tobytes(), digest_size=4).hexdigest()}",
        "_format_columns": ["input_ids", "loss_mask", "seq_len"],
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": False,
        "_split": None,
    }
    write_atomic(work / "state.json", json.dumps(state, indent=2).encode())
    buffer = io.BytesIO()
    torch.save(counts.as_dict(), buffer)  # as speculators' save_token_frequency_distribution writes it
    write_atomic(work / "token_freq.pt", buffer.getvalue())


def row_states(sample: dict[str, Any], mapping: LayerMapping) -> torch.Tensor:
    """One row's ``hidden_states`` as speculators reads them: [T, aux layers + 1, H], the last slot last."""
    positions = [*mapping.aux_positions, mapping.last_position]
    return sample["hidden_states"][:, positions]


@dataclass(frozen=True)
class SpeculatorsFiles:
    """speculators' ``file`` layout (file_pool.RowWriter): ``hidden_states/hs_<row>.safetensors``."""

    drafter_dir: Path
    work: Path
    mapping: LayerMapping

    def path(self, row: int) -> Path:
        return self.work / "hidden_states" / f"hs_{row}.safetensors"

    def write(self, sample: dict, handle: BinaryIO) -> None:
        states = row_states(sample, self.mapping).contiguous()
        handle.write(save_safetensors({"hidden_states": states, "token_ids": sample["input_ids"]}))


def _write_files(
    work: Path,
    dataset: DrafterDataset,
    mapping: LayerMapping,
    order: np.ndarray,
    progress: Callable[[str], None] | None,
) -> None:
    """The ``file`` layout by a pool of workers (file_pool.py); rows already written are kept."""

    def report(done: int, total: int) -> None:
        if progress:
            progress(f"speculators file layout: {done:,}/{total:,} rows")

    write_rows(SpeculatorsFiles(dataset.path, work, mapping), dataset_indices(dataset, order), progress=report)
