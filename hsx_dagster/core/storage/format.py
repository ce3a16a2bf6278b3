"""The on-disk format, in one place: every file name, table schema, dtype table and format version.

Everything the pipeline writes is Parquet, JSON, JSON lines or safetensors (never pickle)::

    <output_dir>/tokenized/
        samples/shard-00.parquet ...  SAMPLE_SCHEMA, one file per shard
        rejects.parquet               REJECT_SCHEMA: every input that did not become a sample, with why
        summary.json                  counts, per-shard tokens, histogram, provenance (TOKENIZED_VERSION)
    <output_dir>/hidden_states/<shard>/
        chunk-000000.safetensors      flat, token-major, unpadded tensors of many samples (CHUNK_TENSORS)
        index.jsonl                   one line per committed chunk (the truth about what is committed)
        quarantine.jsonl              samples set aside with a reason
        shard.json                    provenance: what the shard was made from (HIDDEN_STATES_FORMAT)
        complete.json                 written once every sample of the shard is committed
        shard.lock                    held by the one run writing the shard
        removed_chunks.jsonl          chunks taken out of the index: damaged (moved to set_aside/) or holding
                                      no current sample (deleted), with the reason
        verified.json                 chunks the shard checks read whole, with the size, mtime and inode they had
        written.jsonl                 chunks the latest run committed, with the sha256 it hashed from memory and
                                      the file's size, mtime, ctime and inode: its checks do not read them again
        split_batches.jsonl           batches cut into several chunks, their samples in order: a run that redoes some
                                      of them forms the same batch again (core/extraction/replay.py)
    <output_dir>/drafter/
        index.parquet                 DRAFTER_INDEX_SCHEMA: one row per sample, where its tensors are
        quarantine.parquet            DRAFTER_QUARANTINE_SCHEMA
        manifest.json                 what the dataset is and how it was made (DRAFTER_FORMAT)

This module imports only torch, pyarrow and the choices, so the trainer-side reader stays light.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from hsx_dagster.core.settings.choices import ComputeDtype, StorageDtype

# --- dtypes ---------------------------------------------------------------------------------
FP8_DTYPE = torch.float8_e4m3fn
_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3": FP8_DTYPE,
}
# The settings' choices (hsx_dagster.core.settings.choices), as torch dtypes; `auto` compute is resolved per device.
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    name: _TORCH_DTYPES[name] for name in typing.get_args(ComputeDtype) if name != "auto"
}
STORAGE_DTYPES: dict[str, torch.dtype] = {name: _TORCH_DTYPES[name] for name in typing.get_args(StorageDtype)}
# How safetensors names each storage dtype in a chunk header (checked by the integrity checks).
SAFETENSORS_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    FP8_DTYPE: "F8_E4M3",
}


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: how dtypes are written in settings, manifests and metadata."""
    return str(dtype).removeprefix("torch.")


# --- tokenized dataset ----------------------------------------------------------------------
TOKENIZED_VERSION = 1
TOKENIZED_SAMPLES_DIR = "samples"
TOKENIZED_REJECTS_FILE = "rejects.parquet"
TOKENIZED_SUMMARY_FILE = "summary.json"
SAMPLE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("source", pa.string()),
        ("source_index", pa.int64()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("shard", pa.string()),
    ]
)
REJECT_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("source_index", pa.int64()),
        ("location", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)


def tokenized_shard_file(tokenized_dir: Path, shard: str) -> Path:
    return Path(tokenized_dir) / TOKENIZED_SAMPLES_DIR / f"{shard}.parquet"


# --- hidden-state shards --------------------------------------------------------------------
HIDDEN_STATES_FORMAT = "hsx-hidden-states"
HIDDEN_STATES_VERSION = 1
SHARD_INDEX_FILE = "index.jsonl"
SHARD_QUARANTINE_FILE = "quarantine.jsonl"
SHARD_FILE = "shard.json"
COMPLETE_FILE = "complete.json"
LOCK_FILE = "shard.lock"
REMOVED_CHUNKS_FILE = "removed_chunks.jsonl"  # chunks taken out of the index, with the reason (chunk_removal.py)
SET_ASIDE_DIR = "set_aside"  # damaged chunks, moved here rather than deleted
SPLIT_BATCHES_FILE = "split_batches.jsonl"  # batches cut into several chunks: their samples, in order (replay.py)
WRITTEN_FILE = "written.jsonl"  # this run's chunks as its writer hashed them: sha256, size, mtime, ctime, inode
VERIFIED_FILE = "verified.json"  # chunks the shard checks read whole and found as written: sha256, size, mtime, inode
CHUNK_PATTERN = "chunk-{:06d}.safetensors"
# Tensors of a chunk: per token input_ids int32 [T], loss_mask uint8 [T], hidden_states [T, L, H],
# final_hidden_states [T, H] (optional), <state>_scales (fp8 only); per sample offsets int64 [n + 1]
# (sample k = rows offsets[k]:offsets[k+1]) and sample_ids int64 [n].
STATE_TENSORS = ("hidden_states", "final_hidden_states")
SCALES_SUFFIX = "_scales"


def is_chunk_file(name: str) -> bool:
    return name.startswith("chunk-")


def chunk_number(name: str) -> int:
    """The number in a chunk's name (``chunk-000012.safetensors`` -> 12); -1 for another name."""
    digits = name.removeprefix("chunk-").split(".", 1)[0]
    return int(digits) if digits.isdigit() else -1


def is_temporary_file(name: str) -> bool:
    """Names `write_atomic` gives a file before its rename: leftovers of a crash."""
    return name.startswith(".") and ".tmp" in name


# --- drafter dataset ------------------------------------------------------------------------
DRAFTER_FORMAT = "hsx-drafter-dataset"
DRAFTER_VERSION = 1
MANIFEST_FILE = "manifest.json"
DRAFTER_INDEX_FILE = "index.parquet"
DRAFTER_QUARANTINE_FILE = "quarantine.parquet"
DRAFTER_INDEX_SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("shard", pa.string()),
        ("chunk", pa.string()),  # relative to the manifest's chunks_root
        ("position", pa.int32()),  # within the chunk
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("split", pa.string()),
    ]
)
DRAFTER_QUARANTINE_SCHEMA = pa.schema(
    [("sample_id", pa.int64()), ("shard", pa.string()), ("reason", pa.string()), ("detail", pa.string())]
)


class FormatError(RuntimeError):
    """Files on disk that are not of the format (or the version) this code reads."""


def check_drafter_manifest(manifest: Any, path: Path) -> dict:
    """Refuse a manifest of another format or of a newer version than this code understands."""
    if not isinstance(manifest, dict):
        raise FormatError(f"{path}: not a manifest (a JSON object was expected)")
    found, version = manifest.get("format"), manifest.get("format_version")
    if found != DRAFTER_FORMAT:
        raise FormatError(f"{path}: format is {found!r}, not {DRAFTER_FORMAT!r}: not an hsx drafter dataset")
    if not isinstance(version, int) or version > DRAFTER_VERSION:
        raise FormatError(
            f"{path}: format_version {version!r} is newer than this hsx-dagster reads ({DRAFTER_VERSION}); "
            "upgrade hsx-dagster to read it"
        )
    return manifest
