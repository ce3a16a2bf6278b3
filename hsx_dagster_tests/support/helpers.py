"""Builders the tests share: a shard job and a tokenization from the keys of the settings file, flat; a
settings file written from its sections; a free local port.

The core takes the settings sections themselves (`ModelSettings`, `ExtractionSettings`, `DatasetSettings`);
a test names only the keys it cares about, as hsx.yaml would, and the rest keeps the settings' defaults
(devices: the CPU).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from hsx_dagster.core.extraction import ShardJob
from hsx_dagster.core.inputs import TokenizedSummary, tokenize_dataset
from hsx_dagster.core.model import ModelInfo
from hsx_dagster.core.settings import DatasetSettings, ExtractionSettings, ModelSettings
from hsx_dagster.core.storage import TOKENIZED_REJECTS_FILE, ChunkLayout, ShardProvenance, StoredLayers

_MODEL_KEYS = {"include_final", "trust_remote_code"}
_JOB_KEYS = {"shard", "shard_index", "tokenized_dir", "output_dir", "owner", "probe_budget", "run_id"}


def shard_job(
    *,
    model_path: Path,
    layer_ids: Sequence[int],
    layer_preset: str | None = None,
    chunk_bytes: int | None = None,
    **keys: Any,
) -> ShardJob:
    """A shard job from flat keys: the job's own (shard, shard_index, tokenized_dir, output_dir, owner,
    probe_budget), `model.*` (model_path, layer_ids, the preset they were resolved from, include_final,
    trust_remote_code) and `extraction.*` (chunk_bytes instead of chunk_mb). shard defaults to shard-00 (index
    0), devices to the CPU."""
    job = {key: keys.pop(key) for key in _JOB_KEYS & set(keys)}
    model_keys = {key: keys.pop(key) for key in _MODEL_KEYS & set(keys)}
    model = ModelSettings(path=Path(model_path), layers=layer_preset or list(layer_ids), **model_keys)
    if chunk_bytes is not None:
        keys["chunk_mb"] = chunk_bytes / 2**20
    keys.setdefault("devices", ["cpu"])
    job.setdefault("shard", "shard-00")
    job.setdefault("shard_index", int(job["shard"].rsplit("-", 1)[1]))
    return ShardJob(model=model, layer_ids=tuple(layer_ids), extraction=ExtractionSettings(**keys), **job)


def batch_bytes(
    model_path: Path,
    layer_ids: Sequence[int],
    tokens: int,
    include_final: bool = False,
    storage_dtype: str = "bfloat16",
) -> int:
    """What a batch of ``tokens`` tokens takes in a chunk: as a chunk size, chunks of whole batches (one each)."""
    hidden = ModelInfo.read(Path(model_path)).require_hidden_size()
    layout = ChunkLayout(StoredLayers(tuple(layer_ids), include_final), hidden, storage_dtype)
    return tokens * sum(spec.nbytes for spec in layout.row_specs().values())


def tokenize(
    paths: Sequence[Path],
    model_path: Path,
    out_dir: Path,
    *,
    shards: int = 1,
    workers: int | str | None = None,
    trust_remote_code: bool = False,
    progress: Callable[[str], None] | None = None,
    **dataset: Any,
) -> TokenizedSummary:
    """`tokenize_dataset` of ``paths`` with flat `dataset.*` keys (workers: `tokenize_workers`); a key not given
    keeps the settings' default."""
    if workers is not None:
        dataset["tokenize_workers"] = workers
    return tokenize_dataset(
        DatasetSettings(paths=list(paths), **dataset),
        ModelSettings(path=Path(model_path), trust_remote_code=trust_remote_code),
        Path(out_dir),
        shards=shards,
        progress=progress,
    )


def provenance_of(output_dir: Path, **keys: Any) -> ShardProvenance:
    """A shard's provenance record as a run of shard-00 with layers 1 and 3 writes it; ``keys`` replace fields."""
    fields: dict[str, Any] = dict(
        shard="shard-00",
        model_path=str(output_dir / "model"),
        config_sha256="0" * 64,
        weights_index_sha256="0" * 64,
        layer_ids=(1, 3),
        include_final=False,
        storage_dtype="bfloat16",
        compute_dtype="float32",
        tokenized_sha256="0" * 64,
    )
    return ShardProvenance(**{**fields, **keys})


def write_settings(path: Path, **sections: Any) -> Path:
    """A settings file (hsx.yaml) at ``path``, written from its top-level keys as YAML: ``dataset={"paths":
    [...]}``, ``shards=2``, ...; paths anywhere in it are written as strings."""

    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(plain(sections), sort_keys=False), encoding="utf-8")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def build_drafter_dataset(
    inputs: Sequence[Path],
    model_path: Path,
    out: Path,
    *,
    layer_ids: Sequence[int],
    shards: Sequence[str] = ("shard-00", "shard-01"),
    val_fraction: float = 0.25,
    **keys: Any,
) -> Path:
    """Tokenize ``inputs``, extract every shard on the CPU and assemble ``out/drafter``; returns ``out`` (which holds
    ``tokenized/``, ``hidden_states/`` and ``drafter/``, as a settings file's output_dir). ``keys``: `shard_job`'s
    (include_final, storage_dtype, ...)."""
    from hsx_dagster.core.dataset import assemble
    from hsx_dagster.core.extraction import run_shard

    tokenize(inputs, model_path, out / "tokenized", shards=len(shards), max_length=1024)
    keys = {"batch_size": 8, "max_batch_tokens": 4096, **keys}
    stored = {key: keys[key] for key in ("include_final", "storage_dtype") if key in keys}
    keys.setdefault("chunk_bytes", batch_bytes(model_path, layer_ids, keys["max_batch_tokens"], **stored))
    for index, shard in enumerate(shards):
        job = shard_job(
            shard=shard,
            shard_index=index,
            tokenized_dir=out / "tokenized",
            output_dir=out / "hidden_states" / shard,
            model_path=model_path,
            layer_ids=layer_ids,
            **keys,
        )
        run_shard(job)
    assemble(out / "tokenized", out / "hidden_states", list(shards), out / "drafter", val_fraction=val_fraction,
             settings={"test": True})  # fmt: skip
    return out


def read_rejects(tokenized_dir: Path) -> pa.Table:
    """The tokenized dataset's rejects (rejects.parquet): source, location and reason of every record left out."""
    return pq.read_table(Path(tokenized_dir) / TOKENIZED_REJECTS_FILE)
