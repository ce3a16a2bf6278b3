"""Assemble the trainer-facing dataset over all shards, without copying a tensor.

``<output_dir>/drafter/`` holds:

- ``index.parquet``: one row per sample: sample_id, shard, chunk (path relative to the output
  folder), position (within the chunk), num_tokens, num_loss_tokens, split;
- ``manifest.json``: what the data is and how it was made (model and tokenizer hashes, layer ids
  and their convention, dtypes and the fp8 scale layout, totals, per-shard statistics, settings,
  package version);
- ``quarantine.parquet``: samples set aside during extraction (sample_id, shard, reason, detail).

The split is a pure function of the sample id, so it never changes when shards are re-run or
more data is added.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from safetensors import safe_open

from hsx_dagster import __version__
from hsx_dagster.core.dataset.manifest import Manifest, ManifestLayers, ShardStats
from hsx_dagster.core.inputs.tokenized import (
    TokenizedSummary,
    read_tokenized_shard,
    shard_digests,
    tokenized_shard_keys,
)
from hsx_dagster.core.model.info import ModelDirError, ModelInfo
from hsx_dagster.core.model.layers import LAYER_CONVENTION
from hsx_dagster.core.storage.atomic import write_atomic
from hsx_dagster.core.storage.files import atomic_output, file_sha256
from hsx_dagster.core.storage.format import (
    COMPLETE_FILE,
    DRAFTER_INDEX_FILE,
    DRAFTER_INDEX_SCHEMA,
    DRAFTER_QUARANTINE_FILE,
    DRAFTER_QUARANTINE_SCHEMA,
    MANIFEST_FILE,
    SHARD_FILE,
    STORAGE_DTYPES,
)
from hsx_dagster.core.storage.provenance import ShardProvenance
from hsx_dagster.core.storage.quantization import FP8_DTYPE, scale_layout
from hsx_dagster.core.storage.shard_store import ShardTotals, read_index, read_quarantine


class AssemblyError(RuntimeError):
    """The shards cannot be assembled (missing, unfinished, stale or made differently)."""


@dataclass
class DrafterSummary:
    samples: int
    tokens: int
    bytes: int
    train_samples: int
    val_samples: int
    shards: tuple[ShardStats, ...]
    manifest: Manifest
    ignored_folders: list[str] = field(default_factory=list)  # hidden_states/<name> that is not a current shard


def split_of(sample_id: int, val_fraction: float) -> str:
    """'val' for a fixed, pseudo-random ``val_fraction`` of sample ids, 'train' for the rest."""
    digest = hashlib.blake2b(int(sample_id).to_bytes(8, "big", signed=True), digest_size=8, person=b"hsx-split")
    return "val" if int.from_bytes(digest.digest(), "big") / 2**64 < val_fraction else "train"


def shard_status(hidden_states_dir: Path, shard_keys: Sequence[str], tokenized_dir: Path) -> dict[str, str]:
    """'complete', 'missing', 'incomplete' or 'stale' (made from another tokenized dataset) per shard. The tokenized
    side is the digest summary.json records for each shard file still as it was written (shard_digests), so no
    tokenized id is read for it."""
    status = {}
    complete = []
    for shard in shard_keys:
        folder = hidden_states_dir / shard
        if not (folder / SHARD_FILE).is_file():
            status[shard] = "missing"
        elif not (folder / COMPLETE_FILE).is_file():
            status[shard] = "incomplete"
        else:
            complete.append(shard)
    digests = shard_digests(tokenized_dir, complete)
    for shard in complete:
        made_from = ShardProvenance.read(hidden_states_dir / shard).tokenized_sha256
        status[shard] = "complete" if made_from == digests[shard] else "stale"
    return {shard: status[shard] for shard in shard_keys}


def assemble(
    tokenized_dir: Path,
    hidden_states_dir: Path,
    shard_keys: Sequence[str],
    out_dir: Path,
    *,
    val_fraction: float,
    settings: dict,
) -> DrafterSummary:
    """Index every committed sample of ``shard_keys`` (each complete, made from the current tokenized dataset and
    like the others) into ``out_dir``: index.parquet, quarantine.parquet, manifest.json."""
    provenance = _check_shards(tokenized_dir, Path(hidden_states_dir), list(shard_keys))
    ignored = sorted(
        path.name for path in Path(hidden_states_dir).iterdir() if path.is_dir() and path.name not in shard_keys
    )
    index, quarantined, shard_stats, hidden_size = _index_shards(
        tokenized_dir, Path(hidden_states_dir), shard_keys, val_fraction
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    index.write(out_dir / DRAFTER_INDEX_FILE)
    write_atomic(out_dir / DRAFTER_QUARANTINE_FILE, _parquet_bytes(quarantined))
    manifest = Manifest(
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        hsx_version=__version__,
        model=_model_record(provenance, TokenizedSummary.read(tokenized_dir)),
        layers=ManifestLayers(
            ids=provenance.layer_ids,
            convention=LAYER_CONVENTION,
            include_final=provenance.include_final,
            preset=provenance.layer_preset,
            num_hidden_layers=_model_description(provenance)["num_hidden_layers"],
        ),
        # no chunk at all (every sample quarantined): the width recorded, or the model's config says
        hidden_size=hidden_size
        or provenance.hidden_size
        or ModelInfo.read(provenance.model_path).require_hidden_size(),
        compute_dtype=provenance.compute_dtype,
        storage_dtype=provenance.storage_dtype,
        quantization=None,
        samples=index.num_rows,
        tokens=sum(s.tokens for s in shard_stats),
        bytes=sum(s.bytes for s in shard_stats),
        quarantined_samples=quarantined.num_rows,
        quarantine_file=DRAFTER_QUARANTINE_FILE,
        val_fraction=val_fraction,
        train_samples=index.num_rows - index.val_samples,
        val_samples=index.val_samples,
        shards=tuple(shard_stats),
        settings=settings,
        index=DRAFTER_INDEX_FILE,
    )
    if STORAGE_DTYPES[provenance.storage_dtype] == FP8_DTYPE:  # how to de-quantise without this package
        manifest = replace(manifest, quantization=scale_layout(manifest.hidden_size))
    write_atomic(out_dir / MANIFEST_FILE, json.dumps(manifest.to_dict(), indent=2).encode())
    return DrafterSummary(
        samples=manifest.samples,
        tokens=manifest.tokens,
        bytes=manifest.bytes,
        train_samples=manifest.train_samples,
        val_samples=manifest.val_samples,
        shards=manifest.shards,
        manifest=manifest,
        ignored_folders=ignored,
    )


def _check_shards(tokenized_dir: Path, hidden_states_dir: Path, shard_keys: list[str]) -> ShardProvenance:
    """Every shard complete, made from the current tokenized dataset and like the first; its provenance."""
    made = tokenized_shard_keys(tokenized_dir)
    if made and made != shard_keys:
        # Assembling other shards than the tokenized ones would drop samples or read stale ones.
        raise AssemblyError(
            f"cannot assemble the drafter dataset: the tokenized dataset in {tokenized_dir} has {len(made)} shards, "
            f"the settings {len(shard_keys)} (key `shards`). Set shards: {len(made)} again, or materialize "
            "tokenized_dataset and then every hidden_states shard with the new count"
        )
    status = shard_status(hidden_states_dir, shard_keys, tokenized_dir)
    not_ready = {shard: state for shard, state in status.items() if state != "complete"}
    if not_ready:
        listed = ", ".join(f"{shard} ({state})" for shard, state in sorted(not_ready.items()))
        stale = (
            "; a stale shard was last run on an earlier tokenized dataset: run it again (it extracts only its "
            "new samples and drops the ones that left the inputs)"
            if "stale" in not_ready.values()
            else ""
        )
        raise AssemblyError(
            f"cannot assemble the drafter dataset: shards not ready: {listed}; materialize them first{stale}"
        )
    provenances = {shard: ShardProvenance.read(hidden_states_dir / shard) for shard in shard_keys}
    first = provenances[shard_keys[0]]
    for shard, provenance in provenances.items():
        differing = first.differs_for_a_dataset(provenance)
        if differing:
            raise AssemblyError(
                f"{shard} was made differently from {shard_keys[0]} ({', '.join(differing)}); re-run it"
            )
    return first


class _IndexColumns:
    """The index's columns as numpy arrays, chunk by chunk (chunk and shard names once each, as codes): about 30
    bytes per sample while assembling, where Python objects per sample cost kilobytes."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {n: [] for n in ("sample_id", "chunk", "position", "tokens", "loss")}
        self.chunk_names: list[str] = []

    def add(self, chunk: str, sample_ids: np.ndarray, positions: np.ndarray, tokens: np.ndarray, loss: np.ndarray):
        self.parts["sample_id"].append(sample_ids)
        self.parts["chunk"].append(np.full(len(sample_ids), len(self.chunk_names), dtype=np.int32))
        self.parts["position"].append(positions.astype(np.int32))
        self.parts["tokens"].append(tokens.astype(np.int32))
        self.parts["loss"].append(loss.astype(np.int32))
        self.chunk_names.append(chunk)

    def sorted_columns(self) -> dict[str, np.ndarray]:
        """Every column, in sample-id order."""
        columns = {
            name: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64 if name == "sample_id" else np.int32)
            for name, parts in self.parts.items()
        }
        order = np.argsort(columns["sample_id"], kind="stable")
        return {name: values[order] for name, values in columns.items()}


def _index_shards(
    tokenized_dir: Path, hidden_states_dir: Path, shard_keys: Sequence[str], val_fraction: float
) -> tuple[IndexTable, pa.Table, list[ShardStats], int | None]:
    """The index (one row per committed sample, by sample id), the quarantined samples, each shard's totals,
    and the width of the stored states (None when no chunk was committed)."""
    columns = _IndexColumns()
    quarantined: dict[str, list] = {name: [] for name in DRAFTER_QUARANTINE_SCHEMA.names}
    shard_stats, hidden_size = [], None
    for shard in shard_keys:
        folder = hidden_states_dir / shard
        tokenized = read_tokenized_shard(tokenized_dir, shard, columns=["sample_id", "num_loss_tokens"])
        current = _SortedLookup(
            tokenized.column("sample_id").to_numpy(), tokenized.column("num_loss_tokens").to_numpy()
        )
        records = read_index(folder)
        samples = tokens = 0
        for record in records:
            with safe_open(str(folder / record.chunk), framework="np") as chunk:
                lengths = np.diff(chunk.get_tensor("offsets").astype(np.int64))
                hidden_size = hidden_size or chunk.get_slice("hidden_states").get_shape()[-1]
            chunk_ids = np.asarray(record.sample_ids, dtype=np.int64)
            found, loss = current.find(chunk_ids)
            kept = np.flatnonzero(found)  # the others departed: their input is gone; never indexed or served again
            columns.add(f"hidden_states/{shard}/{record.chunk}", chunk_ids[kept], kept, lengths[kept], loss[kept])
            samples, tokens = samples + len(kept), tokens + int(lengths[kept].sum())
        set_aside = [entry for entry in read_quarantine(folder) if current.has(entry.sample_id)]
        for entry in set_aside:
            quarantined["sample_id"].append(entry.sample_id)
            quarantined["shard"].append(shard)
            quarantined["reason"].append(entry.reason)
            quarantined["detail"].append(entry.detail)
        totals = ShardTotals.of(records)
        shard_stats.append(ShardStats(shard, samples, tokens, totals.bytes, len(totals.chunks), len(set_aside)))
    index = IndexTable(columns.sorted_columns(), columns.chunk_names, val_fraction)
    return index, pa.table(quarantined, schema=DRAFTER_QUARANTINE_SCHEMA), shard_stats, hidden_size


class _SortedLookup:
    """A shard's tokenized sample ids and their loss-token counts, looked up many at a time (sorted arrays)."""

    def __init__(self, sample_ids: np.ndarray, loss_tokens: np.ndarray) -> None:
        order = np.argsort(sample_ids, kind="stable")
        self.ids, self.loss = np.asarray(sample_ids, dtype=np.int64)[order], np.asarray(loss_tokens)[order]

    def find(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, loss tokens of each; 0 where not found)."""
        if len(self.ids) == 0:
            return np.zeros(len(sample_ids), dtype=bool), np.zeros(len(sample_ids), dtype=np.int64)
        places = np.minimum(np.searchsorted(self.ids, sample_ids), len(self.ids) - 1)
        found = self.ids[places] == sample_ids
        return found, np.where(found, self.loss[places], 0)

    def has(self, sample_id: int) -> bool:
        return bool(self.find(np.asarray([sample_id], dtype=np.int64))[0][0])


class IndexTable:
    """The sorted index columns, written to Parquet in row groups (strings made per row group, not all at once)."""

    ROW_GROUP = 65536

    def __init__(self, columns: dict[str, np.ndarray], chunk_names: list[str], val_fraction: float) -> None:
        self.columns = columns
        self.chunk_names = pa.array(chunk_names, pa.string())
        self.shard_names = pa.array([name.split("/")[1] for name in chunk_names], pa.string())
        self.val = np.fromiter(
            (split_of(sample_id, val_fraction) == "val" for sample_id in columns["sample_id"].tolist()),
            dtype=bool,
            count=len(columns["sample_id"]),
        )

    @property
    def num_rows(self) -> int:
        return len(self.columns["sample_id"])

    @property
    def val_samples(self) -> int:
        return int(self.val.sum())

    def slice(self, start: int, stop: int) -> pa.Table:
        codes = pa.array(self.columns["chunk"][start:stop])
        split = np.where(self.val[start:stop], "val", "train")
        return pa.table(
            [
                pa.array(self.columns["sample_id"][start:stop]),
                pa.DictionaryArray.from_arrays(codes, self.shard_names).cast(pa.string()),
                pa.DictionaryArray.from_arrays(codes, self.chunk_names).cast(pa.string()),
                pa.array(self.columns["position"][start:stop]),
                pa.array(self.columns["tokens"][start:stop]),
                pa.array(self.columns["loss"][start:stop]),
                pa.array(split, pa.string()),
            ],
            schema=DRAFTER_INDEX_SCHEMA,
        )

    def write(self, path: Path) -> None:
        with atomic_output(path) as sink, pq.ParquetWriter(sink, DRAFTER_INDEX_SCHEMA) as writer:
            for start in range(0, max(self.num_rows, 1), self.ROW_GROUP):
                writer.write_table(self.slice(start, min(start + self.ROW_GROUP, self.num_rows)))


def _parquet_bytes(table: pa.Table) -> bytes:
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    return buffer.getvalue().to_pybytes()


def _model_record(provenance: ShardProvenance, tokenized: TokenizedSummary) -> dict:
    """The manifest's ``model``: where it is, what defines it (hashes of its config, weights and tokenizer, the
    libraries that read them) and the text model's description."""
    model_path = Path(provenance.model_path)
    tokenizer_file = model_path / "tokenizer.json"
    return {
        "path": str(model_path),
        "config_sha256": provenance.config_sha256,
        "weights_index_sha256": provenance.weights_index_sha256,
        "tokenizer_sha256": file_sha256(tokenizer_file) if tokenizer_file.is_file() else None,
        "chat_template_sha256_16": tokenized.tokenizer["chat_template_sha256_16"],
        # the class transformers loaded the tokenizer files as, and the library versions (None: older data)
        "tokenizer_class": tokenized.tokenizer.get("class"),
        "tokenizer_files_sha256": tokenized.tokenizer.get("files_sha256"),
        "transformers_version": tokenized.tokenizer.get("transformers_version"),
        "tokenizers_version": tokenized.tokenizer.get("tokenizers_version"),
        # the text model: num_hidden_layers (the N of the layer presets), hidden_size, architecture
        **_model_description(provenance),
    }


def _model_description(provenance: ShardProvenance) -> dict:
    """What shard.json says the text model is; read from the model's config.json for shards made before
    shard.json recorded it (None where neither says)."""
    if provenance.model is not None:
        return provenance.model
    try:
        return ModelInfo.read(provenance.model_path).describe()
    except ModelDirError:
        keys = ("architecture", "architectures", "model_type", "text_model_type", "num_hidden_layers", "hidden_size")
        return dict.fromkeys(keys)
