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

import io
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from safetensors.torch import save as save_safetensors

from hsx_dagster.core.dataset.reader import DrafterDataset
from hsx_dagster.core.export.folder import ExportFolder
from hsx_dagster.core.export.mapping import LayerMapping, speculators_mapping
from hsx_dagster.core.inputs.tokenized import read_tokenized_shard
from hsx_dagster.core.storage.atomic import write_atomic

EXPORT_FILE = "hsx_export.json"  # the mapping, the drafter dataset served, the command line
ARROW_FILE = "data-00000-of-00001.arrow"
BACKEND = "hsx"
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


def row_order(drafter_dir: Path) -> tuple[list[int], int]:
    """Sample ids in row order (train, then val, each by sample id) and the number of train rows."""
    train = sorted(DrafterDataset(drafter_dir, split="train").sample_ids)
    val = sorted(DrafterDataset(drafter_dir, split="val").sample_ids)
    return train + val, len(train)


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
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    return SpeculatorsExport(dest, len(order), train_rows, size, mapping, files, command)


def _write_rows(work: Path, tokenized_dir: Path, shards: list[str], order: list[int]) -> None:
    """The ``datasets`` folder (Arrow stream + state.json + dataset_info.json) and ``token_freq.pt``."""
    tables = [read_tokenized_shard(tokenized_dir, s, ["sample_id", "input_ids", "loss_mask"]) for s in shards]
    by_id: dict[int, tuple[list[int], list[int]]] = {}
    for table in tables:
        for sid, ids, mask in zip(*(table.column(c).to_pylist() for c in ("sample_id", "input_ids", "loss_mask"))):
            by_id[sid] = (ids, mask)
    missing = [sid for sid in order if sid not in by_id]
    if missing:
        raise FileNotFoundError(f"{tokenized_dir}: samples {missing[:5]} of the drafter dataset are not tokenized")
    ids_col = [by_id[sid][0] for sid in order]
    mask_col = [by_id[sid][1] for sid in order]
    table = pa.table(
        {
            "input_ids": pa.array(ids_col, pa.list_(pa.int64())),
            "loss_mask": pa.array(mask_col, pa.list_(pa.int64())),
            "seq_len": pa.array([len(ids) for ids in ids_col], pa.int64()),
            "sample_id": pa.array(order, pa.int64()),
        }
    )
    info = {"citation": "", "description": "hsx-dagster export", "features": FEATURES, "homepage": "", "license": ""}
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": FEATURES}})})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1000)
    write_atomic(work / ARROW_FILE, sink.getvalue().to_pybytes())
    write_atomic(work / "dataset_info.json", json.dumps(info, indent=2).encode())
    state = {
        "_data_files": [{"filename": ARROW_FILE}],
        "_fingerprint": f"hsx-{len(order)}-{hash(tuple(order)) & 0xFFFFFFFF:08x}",
        "_format_columns": ["input_ids", "loss_mask", "seq_len"],
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": False,
        "_split": None,
    }
    write_atomic(work / "state.json", json.dumps(state, indent=2).encode())
    counts: Counter[int] = Counter()
    for ids, mask in zip(ids_col, mask_col, strict=True):
        counts.update(token for token, keep in zip(ids, mask, strict=True) if keep)
    buffer = io.BytesIO()
    torch.save(dict(counts), buffer)  # as speculators' save_token_frequency_distribution writes it
    write_atomic(work / "token_freq.pt", buffer.getvalue())


def row_states(sample: dict[str, Any], mapping: LayerMapping) -> torch.Tensor:
    """One row's ``hidden_states`` as speculators reads them: [T, aux layers + 1, H], the last slot last."""
    positions = [*mapping.aux_positions, mapping.last_position]
    return sample["hidden_states"][:, positions]


def _write_files(
    work: Path,
    dataset: DrafterDataset,
    mapping: LayerMapping,
    order: list[int],
    progress: Callable[[str], None] | None,
) -> None:
    """speculators' ``file`` layout: ``hidden_states/hs_<row>.safetensors``; rows already written are kept."""
    folder = work / "hidden_states"
    folder.mkdir(exist_ok=True)
    index_of = {sid: i for i, sid in enumerate(dataset.sample_ids)}
    for row, sid in enumerate(order):
        path = folder / f"hs_{row}.safetensors"
        if path.exists():
            continue  # written whole by an interrupted run
        sample = dataset[index_of[sid]]
        tensors = {"hidden_states": row_states(sample, mapping).contiguous(), "token_ids": sample["input_ids"]}
        write_atomic(path, save_safetensors(tensors))
        if progress and row % 1000 == 0:
            progress(f"speculators file layout: {row:,}/{len(order):,} rows")
