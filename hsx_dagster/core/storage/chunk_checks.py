"""What the checks verify of one chunk, from a single read of it (chunk_scan.py): its header and samples against
the index and the shard's provenance, its stored ids and masks against the tokenized samples, and the per-layer
statistics of its states (recorded at write time; read and computed only for chunks written before that)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from safetensors import safe_open

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.storage.chunk_reader import read_sample
from hsx_dagster.core.storage.chunk_scan import ScannedChunk, scan_chunk
from hsx_dagster.core.storage.chunk_stats import recorded
from hsx_dagster.core.storage.format import SCALES_SUFFIX, STATE_TENSORS
from hsx_dagster.core.storage.provenance import ChunkLayout, StoredLayers
from hsx_dagster.core.storage.shard_records import ChunkRecord

MAX_LISTED = 10


def chunk_problems(
    path: Path, record: ChunkRecord, layout: ChunkLayout, header: dict[str, str] | None = None
) -> list[str]:
    """What is wrong with one committed chunk (read once): see `scanned_chunk_problems`."""
    return scanned_chunk_problems(scan_chunk(path), record, layout, header)


def scanned_chunk_problems(
    scanned: ScannedChunk, record: ChunkRecord, layout: ChunkLayout, header: dict[str, str] | None = None
) -> list[str]:
    """Missing, checksum, sample ids, tensors; ``header`` (e.g. format, shard, storage_dtype) are metadata entries
    its safetensors header must carry."""
    path = scanned.path
    if scanned.error == "missing":
        return [f"{path}: missing"]
    if scanned.sha256 != record.sha256:
        return [f"{path}: checksum differs from the one recorded at write time (corrupted)"]
    if scanned.error:
        return [f"{path}: {scanned.error}"]
    problems = [
        f"{path}: header says {key} {scanned.metadata.get(key)!r}, the shard's provenance {value!r}"
        for key, value in (header or {}).items()
        if scanned.metadata.get(key) != value
    ]
    found = scanned.tensors
    tokens = found.get("input_ids", (None, [None]))[1][0]
    if tokens is None or "loss_mask" not in found:
        return [*problems, f"{path}: input_ids or loss_mask is missing"]
    sample_ids, offsets = scanned.small.get("sample_ids"), scanned.small.get("offsets")
    if sample_ids is None or sample_ids.tolist() != record.sample_ids:
        problems.append(f"{path}: holds other samples than the index records")
    if offsets is None or len(offsets) != record.samples + 1 or offsets[0] != 0 or offsets[-1] != tokens:
        problems.append(f"{path}: offsets do not cover its {tokens} tokens in {record.samples} samples")
    if tokens != record.tokens or found["loss_mask"][1] != [tokens]:
        problems.append(f"{path}: {tokens} tokens, the index records {record.tokens}")
    return problems + _layout_problems(path, found, layout.expected_tensors(tokens))


def _layout_problems(path: Path, found: dict, expected: dict) -> list[str]:
    problems = []
    for name, (want_dtype, want_shape) in expected.items():
        got = found.get(name)
        if got is None:
            problems.append(f"{path}: {name} is missing")
        elif got[0] != want_dtype or got[1] != want_shape:
            problems.append(f"{path}: {name} is {got[0]} {got[1]}, expected {want_dtype} {want_shape}")
    unexpected = sorted(n for n in found if (n.endswith(SCALES_SUFFIX) or n in STATE_TENSORS) and n not in expected)
    if unexpected:
        problems.append(f"{path}: {', '.join(unexpected)} present, not part of the layout")
    return problems


class TokenizedRows:
    """A shard's tokenized samples as flat arrays, to compare stored ids and masks with, many samples at once."""

    def __init__(self, table: pa.Table) -> None:
        ids = table.column("sample_id").to_numpy()
        self.row_of = {int(sample_id): row for row, sample_id in enumerate(ids.tolist())}
        tokens, masks = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
        self.offsets = tokens.offsets.to_numpy().astype(np.int64)
        self.ids = tokens.values.to_numpy(zero_copy_only=False)
        self.masks = masks.values.to_numpy(zero_copy_only=False)

    def mismatching(self, small: dict[str, np.ndarray], positions: dict[int, int]) -> list[int]:
        """Sample ids (of ``positions``: sample id -> position in the chunk; departed ones skipped) whose stored
        ids or loss mask (``small``: the chunk's small tensors) differ from the tokenized row, or that do not sit
        at their position."""
        wanted = [(s, p, self.row_of[s]) for s, p in positions.items() if s in self.row_of]
        if not wanted:
            return []
        samples, places, rows = (np.asarray(column, dtype=np.int64) for column in zip(*wanted))
        chunk_ids, offsets = small.get("sample_ids"), small.get("offsets")
        if chunk_ids is None or offsets is None or "input_ids" not in small or "loss_mask" not in small:
            return samples.tolist()
        inside = places < len(chunk_ids)
        placed = inside & (chunk_ids[np.minimum(places, len(chunk_ids) - 1)] == samples)
        lengths = offsets[places + 1] - offsets[places] if len(offsets) > places.max() + 1 else None
        want_lengths = self.offsets[rows + 1] - self.offsets[rows]
        if lengths is None:
            return samples.tolist()
        same = placed & (lengths == want_lengths) & (lengths > 0)
        if same.any():
            stored = _ranges(offsets[places[same]], lengths[same])
            tokenized = _ranges(self.offsets[rows[same]], lengths[same])
            differs = (small["input_ids"][stored] != self.ids[tokenized]) | (
                small["loss_mask"][stored] != self.masks[tokenized]
            )
            starts = np.concatenate([[0], np.cumsum(lengths[same])[:-1]])
            same[np.flatnonzero(same)] = np.add.reduceat(differs.astype(np.int64), starts) == 0
        return samples[~same].tolist()


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices ``starts[k] .. starts[k] + lengths[k] - 1`` of every k, concatenated."""
    shifts = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return shifts + np.arange(int(lengths.sum()))


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
        self.read_chunks = 0  # chunks read for their states (no statistics recorded at write time)

    def add(self, path: Path, record: ChunkRecord) -> None:
        """A chunk whose checksum was verified: its recorded statistics, or (older chunks) its states read."""
        if not recorded(record.stats):
            self.add_chunk(path)
            return
        stats = record.stats or {}
        if stats["sum"]:
            self.sums += np.asarray(stats["sum"])
            self.squares += np.asarray(stats["sum_of_squares"])
            self.nonzero |= np.asarray(stats["nonzero"], dtype=bool)
        self.count += int(stats["values_per_slot"])
        self.tokens += record.tokens
        self.bad_samples += list(stats["nonfinite_samples"])

    def add_chunk(self, path: Path) -> None:
        """Read the chunk's states and add them (fp8 de-quantised)."""
        self.read_chunks += 1
        with safe_open(str(path), framework="pt") as chunk:
            offsets = chunk.get_tensor("offsets")
            whole = read_sample(chunk, 0, int(offsets[-1]), dtype=torch.float32)
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
        metadata = {
            "per_layer": rows,
            "nonfinite_samples": len(self.bad_samples),
            "tokens": self.tokens,
            "warnings": warnings,
            "chunks_read_for_statistics": self.read_chunks,
        }
        return CheckOutcome(not problems, description, metadata)


def positions_of(sample_ids: Sequence[int]) -> dict[int, int]:
    return {sample_id: k for k, sample_id in enumerate(sample_ids)}
