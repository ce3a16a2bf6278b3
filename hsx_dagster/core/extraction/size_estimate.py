"""How many bytes a shard's hidden states take on disk, known before any model loads.

Computed from the tokenized dataset (tokens and samples per shard) and the model's config.json
(hidden size), for the layers stored: per token the ids and mask plus one vector per stored layer
(fp8: plus its block scales), per sample its offset and id (in the chunk and in the index), per
chunk the safetensors header and its index line. Reported per storage dtype in the tokenized
dataset's metadata, and checked against the free disk at the start of each shard run.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hsx_dagster.core.inputs.tokenized import ShardLoad
from hsx_dagster.core.model.info import ModelInfo
from hsx_dagster.core.storage.format import STORAGE_DTYPES
from hsx_dagster.core.storage.quantization import bytes_per_vector

TOKEN_BYTES = 4 + 1  # input_ids int32 + loss_mask uint8
SAMPLE_BYTES = 8 + 8 + 21  # offsets int64 + sample_ids int64 in the chunk, the id in index.jsonl (63-bit, ", ")
CHUNK_BYTES = 1_400  # safetensors header with its metadata, plus the fixed part of the index line
SHARD_BYTES = 6_000  # shard.json, complete.json, the lock file
HEADROOM = 1.02  # the run needs this much more than the estimate free before it starts


class InsufficientDiskError(RuntimeError):
    """The shard cannot fit in the free space under the output folder."""


@dataclass(frozen=True)
class StoredShape:
    """What is stored per token: ``layers`` vectors of ``hidden_size`` (the final norm's included)."""

    layers: int
    hidden_size: int

    @classmethod
    def of_model(cls, model: ModelInfo, layer_ids: Sequence[int], include_final: bool) -> StoredShape:
        return cls(layers=len(layer_ids) + int(include_final), hidden_size=model.require_hidden_size())


def estimate_bytes(tokens: int, samples: int, shape: StoredShape, storage_dtype: str, chunk_bytes: int) -> int:
    """Bytes on disk for ``samples`` samples of ``tokens`` tokens in total."""
    per_token = TOKEN_BYTES + shape.layers * bytes_per_vector(shape.hidden_size, STORAGE_DTYPES[storage_dtype])
    payload = tokens * per_token + samples * SAMPLE_BYTES
    chunks = max(1, math.ceil(payload / chunk_bytes)) if samples else 0
    return payload + chunks * CHUNK_BYTES + SHARD_BYTES


def estimate_by_dtype(shards: Sequence[ShardLoad], shape: StoredShape, chunk_bytes: int) -> dict[str, dict[str, int]]:
    """storage dtype -> shard -> bytes, for the tokenized shards."""
    return {
        dtype: {s.shard: estimate_bytes(s.tokens, s.samples, shape, dtype, chunk_bytes) for s in shards}
        for dtype in STORAGE_DTYPES
    }


def check_free_disk(
    directory: Path, needed: int, describe_alternatives: str = "", others: Sequence[tuple[str, int]] = ()
) -> int:
    """Refuse to start when ``needed`` bytes (with headroom) are not free where ``directory`` lives, once what the
    other running shards will still write there (``others``: (shard, bytes)) is set aside. Returns the free bytes."""
    probe = Path(directory)
    while not probe.exists():  # the folder may not exist yet: ask about the disk it will be on
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    promised = sum(count for _, count in others)
    if needed * HEADROOM + promised > free:
        others_note = ""
        if promised:
            named = ", ".join(f"{shard} {format_bytes(count)}" for shard, count in others if count)
            others_note = f", and the other running shards will still write {format_bytes(promised)} of it ({named})"
        raise InsufficientDiskError(
            f"{directory}: needs about {format_bytes(needed)} for the states still to extract, but only "
            f"{format_bytes(free)} are free there{others_note}. Free some space, point output_dir at a bigger disk"
            f"{describe_alternatives}"
        )
    return free


def format_bytes(count: float) -> str:
    if count < 1000:
        return f"{int(count)} B"
    for unit in ("KB", "MB", "GB"):
        count /= 1000
        if count < 1000:
            return f"{count:.1f} {unit}"
    return f"{count / 1000:.1f} TB"
