"""Checks of one hidden-state shard folder, each a plain function returning a `CheckOutcome`.

They run on the partition a run has just materialized, so a damaged or incomplete shard is caught
on the shard that is wrong (where the retry schedule can act), not later on the assembled dataset:

- coverage: every tokenized sample of the shard is committed or quarantined exactly once, and the ids
  and loss mask stored beside each sample's states are the tokenized ones (committed samples whose input
  is gone are counted as departed, not served);
- integrity: every chunk the index lists exists, still has the sha256 recorded at write time,
  holds the samples the index says, and its header (format, shard, layers, dtype, tensor names,
  dtypes and shapes) matches the shard's provenance;
- numerics: no NaN/Inf in any stored state (fp8 de-quantised first); per-layer mean and std
  (a layer of zeros fails, an outlying scale is reported).

The per-chunk parts (`chunk_problems`, `LayerStatistics`, `chunk_rows_mismatching`) are also what
the drafter dataset's checks (`hsx_dagster.core.dataset.checks`) run over every shard.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.model_info import ModelDirError, ModelInfo
from hsx_dagster.core.storage.atomic import StoreError
from hsx_dagster.core.storage.chunk_reader import read_sample
from hsx_dagster.core.storage.files import file_sha256
from hsx_dagster.core.storage.format import (
    COMPLETE_FILE,
    SCALES_SUFFIX,
    STATE_TENSORS,
    tokenized_shard_file,
)
from hsx_dagster.core.storage.provenance import ChunkLayout, ShardProvenance, StoredLayers
from hsx_dagster.core.storage.shard_store import ChunkRecord, read_index, read_quarantine

MAX_LISTED = 10


def chunk_problems(
    path: Path, record: ChunkRecord, layout: ChunkLayout, header: dict[str, str] | None = None
) -> list[str]:
    """What is wrong with one committed chunk: missing, checksum, sample ids, tensors; ``header``
    (e.g. format, shard, storage_dtype) are metadata entries its safetensors header must carry."""
    if not path.is_file():
        return [f"{path}: missing"]
    if file_sha256(path) != record.sha256:
        return [f"{path}: checksum differs from the one recorded at write time (corrupted)"]
    problems: list[str] = []
    try:
        with safe_open(str(path), framework="pt") as chunk:
            names = set(chunk.keys())
            metadata = chunk.metadata() or {}
            found = {
                name: (chunk.get_slice(name).get_dtype(), list(chunk.get_slice(name).get_shape())) for name in names
            }
            sample_ids = chunk.get_tensor("sample_ids").tolist() if "sample_ids" in names else None
            offsets = chunk.get_tensor("offsets").tolist() if "offsets" in names else None
    except Exception as exc:  # safetensors raises its own error types for a bad header
        return [f"{path}: unreadable safetensors header ({exc})"]
    for key, value in (header or {}).items():
        if metadata.get(key) != value:
            problems.append(f"{path}: header says {key} {metadata.get(key)!r}, the shard's provenance {value!r}")
    tokens = found.get("input_ids", (None, [None]))[1][0]
    if tokens is None or "loss_mask" not in found:
        return [*problems, f"{path}: input_ids or loss_mask is missing"]
    if sample_ids != record.sample_ids:
        problems.append(f"{path}: holds other samples than the index records")
    if offsets is None or len(offsets) != record.samples + 1 or offsets[0] != 0 or offsets[-1] != tokens:
        problems.append(f"{path}: offsets do not cover its {tokens} tokens in {record.samples} samples")
    if tokens != record.tokens or found["loss_mask"][1] != [tokens]:
        problems.append(f"{path}: {tokens} tokens, the index records {record.tokens}")
    expected = layout.expected_tensors(tokens)
    for name, (want_dtype, want_shape) in expected.items():
        got = found.get(name)
        if got is None:
            problems.append(f"{path}: {name} is missing")
        elif got[0] != want_dtype or got[1] != want_shape:
            problems.append(f"{path}: {name} is {got[0]} {got[1]}, expected {want_dtype} {want_shape}")
    unexpected = sorted(n for n in names if (n.endswith(SCALES_SUFFIX) or n in STATE_TENSORS) and n not in expected)
    if unexpected:
        problems.append(f"{path}: {', '.join(unexpected)} present, not part of the layout")
    return problems


class LayerStatistics:
    """Running per-layer mean/std over chunks, and the samples holding NaN or Inf."""

    def __init__(self, layers: StoredLayers) -> None:
        self.names = layers.slot_names
        self.sums = np.zeros(len(self.names))
        self.squares = np.zeros(len(self.names))
        self.nonzero = np.zeros(len(self.names), dtype=bool)
        self.count = 0
        self.tokens = 0
        self.bad_samples: list[int] = []

    def add_chunk(self, path: Path) -> None:
        with safe_open(str(path), framework="pt") as chunk:
            offsets = chunk.get_tensor("offsets")
            whole = read_sample(chunk, 0, int(offsets[-1]), dtype=torch.float32)  # fp8 de-quantised
            states = whole["hidden_states"]  # [T, L, H]
            if "final_hidden_states" in whole:
                states = torch.cat([states, whole["final_hidden_states"].unsqueeze(1)], dim=1)
            sample_ids = chunk.get_tensor("sample_ids").tolist()
        finite = torch.isfinite(states).all(dim=2).all(dim=1)  # per token
        if not bool(finite.all()):
            bad_tokens = torch.nonzero(~finite).flatten()
            owners = torch.searchsorted(offsets, bad_tokens, right=True) - 1
            self.bad_samples += sorted({sample_ids[int(k)] for k in owners})
            states = torch.where(torch.isfinite(states), states, torch.zeros((), dtype=states.dtype))
        self.sums += states.sum(dim=(0, 2)).double().numpy()
        self.squares += (states.double() ** 2).sum(dim=(0, 2)).numpy()
        self.nonzero |= (states != 0).any(dim=2).any(dim=0).numpy()
        self.count += states.shape[0] * states.shape[2]
        self.tokens += states.shape[0]

    def outcome(self) -> CheckOutcome:
        means = self.sums / max(self.count, 1)
        stds = np.sqrt(np.maximum(self.squares / max(self.count, 1) - means**2, 0.0))
        problems, warnings = [], []
        if self.bad_samples:
            problems.append(f"NaN or Inf in {len(self.bad_samples)} samples: {self.bad_samples[:MAX_LISTED]}")
        if self.tokens:
            problems += [f"{name} is all zeros" for name, has in zip(self.names, self.nonzero) if not has]
        median_std = float(np.median(stds[self.nonzero])) if self.nonzero.any() else 0.0
        for name, std in zip(self.names, stds):
            if median_std > 0 and std > 0 and (std > 100 * median_std or std < median_std / 100):
                warnings.append(f"{name} has std {std:.3g}, far from the median layer's {median_std:.3g}")
        rows = [
            {"layer": name, "mean": round(float(m), 6), "std": round(float(s), 6)}
            for name, m, s in zip(self.names, means, stds)
        ]
        description = "; ".join(problems + warnings) or (
            f"all values finite over {self.tokens:,} tokens; per-layer statistics in metadata"
        )
        return CheckOutcome(
            not problems,
            description,
            {
                "per_layer": rows,
                "nonfinite_samples": len(self.bad_samples),
                "tokens": self.tokens,
                "warnings": warnings,
            },
        )


def chunk_rows_mismatching(
    path: Path, rows: dict[int, int], positions: dict[int, int], tokenized: pa.Table
) -> list[int]:
    """Sample ids of chunk ``path`` whose stored ids or loss mask differ from the tokenized row, or that
    do not sit at their position. ``rows``: sample id -> tokenized row; ``positions``: sample id ->
    position in the chunk the index gives."""
    mismatched = []
    input_ids, loss_mask = tokenized.column("input_ids"), tokenized.column("loss_mask")
    with safe_open(str(path), framework="pt") as chunk:
        offsets = chunk.get_tensor("offsets").tolist()
        chunk_ids = chunk.get_tensor("sample_ids").tolist()
        ids, masks = chunk.get_tensor("input_ids"), chunk.get_tensor("loss_mask")
    for sample_id, position in positions.items():
        row = rows.get(sample_id)
        if row is None or position >= len(chunk_ids) or chunk_ids[position] != sample_id:
            mismatched.append(sample_id)
            continue
        start, end = offsets[position], offsets[position + 1]
        if ids[start:end].tolist() != input_ids[row].as_py() or masks[start:end].tolist() != loss_mask[row].as_py():
            mismatched.append(sample_id)
    return mismatched


# --- one shard -------------------------------------------------------------------------------


def layout_of(provenance: ShardProvenance) -> ChunkLayout:
    """The layout every chunk of the shard has: the recorded width (the model's config for shards written before
    shard.json recorded it)."""
    hidden = provenance.hidden_size or ModelInfo.read(provenance.model_path).require_hidden_size()
    return provenance.layout(hidden)


def _unreadable(kind: str, error: Exception) -> CheckOutcome:
    return CheckOutcome(False, f"{kind}: {error}", {"problems": 1})


def check_shard_coverage(shard_dir: Path, tokenized_dir: Path, shard: str) -> CheckOutcome:
    """Every tokenized sample of ``shard`` committed or quarantined exactly once, with its ids and mask."""
    shard_dir = Path(shard_dir)
    source = tokenized_shard_file(tokenized_dir, shard)
    if not source.is_file():
        return CheckOutcome(False, f"{source} not found: nothing to compare the shard with", {"problems": 1})
    tokenized = pq.read_table(source, columns=["sample_id", "input_ids", "loss_mask"])
    try:
        records = read_index(shard_dir)
        quarantined = [q.sample_id for q in read_quarantine(shard_dir)]
    except (StoreError, TypeError) as exc:
        return _unreadable("coverage", exc)
    rows = {sample_id: row for row, sample_id in enumerate(tokenized.column("sample_id").to_pylist())}
    committed = Counter(sample_id for record in records for sample_id in record.sample_ids)
    accounted = committed + Counter(quarantined)
    twice = sorted(sample_id for sample_id, n in accounted.items() if n > 1)
    missing = sorted(sample_id for sample_id in rows if sample_id not in accounted)
    # committed samples whose input is gone (stable membership): kept in their chunk, never indexed or served
    departed = sorted(sample_id for sample_id in accounted if sample_id not in rows)
    mismatched: list[int] = []
    for record in records:
        path = shard_dir / record.chunk
        if path.is_file():  # a missing chunk is the integrity check's finding
            positions = {sample_id: k for k, sample_id in enumerate(record.sample_ids)}
            mismatched += chunk_rows_mismatching(path, rows, positions, tokenized)
    problems = []
    if missing:
        problems.append(f"{len(missing)} samples neither committed nor quarantined (e.g. {missing[:MAX_LISTED]})")
    if twice:
        problems.append(f"{len(twice)} samples committed or quarantined more than once (e.g. {twice[:MAX_LISTED]})")
    if mismatched:
        problems.append(
            f"{len(mismatched)} samples' stored ids or loss mask differ from the tokenized ones "
            f"(e.g. {sorted(mismatched)[:MAX_LISTED]})"
        )
    if not problems and not (shard_dir / COMPLETE_FILE).is_file():
        problems.append(f"{shard_dir / COMPLETE_FILE} is missing: the shard was not marked complete")
    set_aside = f" ({len(quarantined)} of them quarantined with a reason)" if quarantined else ""
    return CheckOutcome(
        not problems,
        "; ".join(problems)
        or f"all {len(rows)} tokenized samples of {shard} accounted for once, ids and masks identical{set_aside}",
        {
            "tokenized_samples": len(rows),
            "committed": sum(committed.values()),
            "quarantined": len(quarantined),
            "missing": len(missing),
            "duplicated": len(twice),
            "departed": len(departed),
            "mismatched": len(mismatched),
        },
    )


def check_shard_integrity(shard_dir: Path) -> CheckOutcome:
    """Every committed chunk's checksum, samples and header as recorded; the layout from shard.json."""
    shard_dir = Path(shard_dir)
    try:
        provenance = ShardProvenance.read(shard_dir)
        layout = layout_of(provenance)
        records = read_index(shard_dir)
    except (StoreError, ModelDirError) as exc:
        return _unreadable("integrity", exc)
    header = provenance.chunk_header()
    problems: list[str] = []
    for record in records:
        problems += chunk_problems(shard_dir / record.chunk, record, layout, header)
    size = sum(r.bytes for r in records)
    return CheckOutcome(
        not problems,
        "; ".join(problems[:MAX_LISTED])
        or f"{len(records)} chunks: checksums, samples, headers, shapes and dtypes as recorded",
        {"chunks": len(records), "bytes_read": size, "problems": len(problems)},
    )


def check_shard_numerics(shard_dir: Path) -> CheckOutcome:
    """No NaN or Inf in the shard's states; per-layer statistics."""
    shard_dir = Path(shard_dir)
    try:
        provenance = ShardProvenance.read(shard_dir)
        records = read_index(shard_dir)
    except StoreError as exc:
        return _unreadable("numerics", exc)
    stats = LayerStatistics(provenance.layers)
    unreadable = []
    for record in records:
        try:
            stats.add_chunk(shard_dir / record.chunk)
        except Exception as exc:  # a damaged chunk: named here, the integrity check says what is wrong with it
            unreadable.append(f"{record.chunk} ({type(exc).__name__})")
    outcome = stats.outcome()
    if unreadable:
        outcome = CheckOutcome(
            False,
            f"{len(unreadable)} chunks unreadable: {', '.join(unreadable[:MAX_LISTED])}; {outcome.description}",
            {**outcome.metadata, "unreadable_chunks": len(unreadable)},
        )
    return outcome
