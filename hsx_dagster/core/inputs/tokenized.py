"""The tokenized dataset on disk, read back: its summary (`TokenizedSummary`), one shard's samples, the rejects.

Layout under ``<output_dir>/tokenized/`` (written by `hsx_dagster.core.inputs.tokenization`)::

    samples/shard-00.parquet ...  sample_id, source, source_index, input_ids (list<int32>),
                                   loss_mask (list<uint8>), num_tokens, num_loss_tokens, shard
    rejects.parquet                source, source_index, location, reason, detail
    summary.json                   counts, per-shard tokens, histogram, provenance
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hsx_dagster.core.shard_keys import check_shard_key
from hsx_dagster.core.storage.format import TOKENIZED_SUMMARY_FILE, tokenized_shard_file

HISTOGRAM_EDGES = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class TokenizedDataError(RuntimeError):
    """The tokenized dataset on disk is missing or is not what is asked for; the message says what to do."""


@dataclass(frozen=True)
class ShardLoad:
    """One tokenized shard: its key and what it holds."""

    shard: str
    samples: int
    tokens: int
    added: int = 0  # samples new to the shard since the previous tokenized dataset
    removed: int = 0  # samples of the shard in the previous tokenized dataset that are gone from the inputs
    # `tokenized_digest` of the shard's file and that file's size, mtime and inode when it was taken (None in
    # datasets tokenized before): whoever compares a shard with its tokenized samples reads this, not the file
    sha256: str | None = None
    file: dict | None = None


@dataclass(frozen=True)
class LengthBucket:
    """Samples of ``min`` to ``max`` tokens (both included)."""

    min: int
    max: int
    samples: int


@dataclass(frozen=True)
class InputFile:
    """One input file and what became of its records."""

    path: str
    format: str  # jsonl | json_array | parquet
    records: int
    samples: int
    rejects: int
    bytes: int


@dataclass
class TokenizedSummary:
    format_version: int
    samples: int
    tokens: int
    loss_tokens: int
    truncated: int
    rejects: dict[str, int]
    shards: list[ShardLoad]
    imbalance: float
    histogram: list[LengthBucket]
    inputs: list[InputFile]
    tokenizer: dict
    options: dict
    elapsed_s: float
    conversations_per_s: float
    bytes_written: int
    created_at: float = field(default_factory=time.time)
    # Fields of the inputs the pipeline does not understand (not rendered): conversations per reason.
    ignored_fields: dict[str, int] = field(default_factory=dict)
    workers: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def read(cls, tokenized_dir: Path) -> TokenizedSummary:
        data = json.loads((Path(tokenized_dir) / TOKENIZED_SUMMARY_FILE).read_text(encoding="utf-8"))
        data["shards"] = [ShardLoad(**entry) for entry in data["shards"]]
        data["histogram"] = [LengthBucket(**bucket) for bucket in data["histogram"]]
        data["inputs"] = [InputFile(**entry) for entry in data["inputs"]]
        return cls(**data)

    @property
    def rejected(self) -> int:
        return sum(self.rejects.values())


def length_histogram(num_tokens: np.ndarray) -> list[LengthBucket]:
    """Sample counts per power-of-two token-length bucket; the last bucket ends at the longest sample."""
    if len(num_tokens) == 0:
        return []
    top = int(np.max(num_tokens))
    # The last bucket ends at the longest sample, so the table also shows the maximum.
    edges = [edge for edge in HISTOGRAM_EDGES if edge <= top] + [top + 1]
    counts, _ = np.histogram(num_tokens, bins=edges)
    return [LengthBucket(int(lo), int(hi) - 1, int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], counts)]


def read_tokenized_shard(tokenized_dir: Path, shard: str, columns: Sequence[str] | None = None) -> pa.Table:
    """One shard's samples, in input order; a shard the tokenized dataset lacks is named with what to do."""
    path = tokenized_shard_file(tokenized_dir, check_shard_key(shard))
    if not path.is_file():
        made = tokenized_shard_keys(tokenized_dir)
        if not made:
            raise TokenizedDataError(
                f"{path} not found: {tokenized_dir} holds no tokenized dataset; materialize tokenized_dataset first"
            )
        raise TokenizedDataError(
            f"{path} not found: the tokenized dataset was made with {len(made)} shards ({made[0]} .. {made[-1]}), "
            f"and {shard} is not one of them. The setting `shards` changed since: materialize tokenized_dataset "
            "again (hidden_states shards made from the old tokenization are then refused unless "
            "extraction.on_mismatch is start_over)"
        )
    return pq.read_table(path, columns=list(columns) if columns else None)


def tokenized_digest(table: pa.Table) -> str:
    """A hash of a shard's samples as extraction stores them (ids, tokens and loss masks): hidden states made
    from other tokenized samples are never mixed with these (shard.json records it; assembly compares it)."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(table.column("sample_id").to_numpy()).data)
    for column, dtype in (("input_ids", np.int32), ("loss_mask", np.uint8)):
        for chunk in table.column(column).chunks:
            # hashed where they lie (no bytes copies): the values as stored already have these dtypes
            values = chunk.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
            digest.update(np.ascontiguousarray(values).data)
            digest.update(np.diff(chunk.offsets.to_numpy()).astype(np.int64).data)
    return digest.hexdigest()


def file_stamp(path: Path) -> dict:
    """What says a file is unchanged: size, modification time and inode (a replaced file has another inode)."""
    status = Path(path).stat()
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "ino": status.st_ino}


def stamped_digest(tokenized_dir: Path, shard: str) -> tuple[str, dict]:
    """`tokenized_digest` of a shard's file, read whole, and the file's stamp (as summary.json records them)."""
    table = read_tokenized_shard(tokenized_dir, shard, columns=["sample_id", "input_ids", "loss_mask"])
    return tokenized_digest(table), file_stamp(tokenized_shard_file(tokenized_dir, shard))


def shard_digests(tokenized_dir: Path, shards: Sequence[str]) -> dict[str, str]:
    """`tokenized_digest` of each shard: from summary.json where its file is unchanged since it was recorded, else
    read from the file (tokenized datasets made before summary.json recorded it, or a file replaced by hand)."""
    try:
        loads = {load.shard: load for load in TokenizedSummary.read(Path(tokenized_dir)).shards}
    except FileNotFoundError:
        loads = {}
    digests = {}
    for shard in shards:
        load = loads.get(shard)
        path = tokenized_shard_file(tokenized_dir, check_shard_key(shard))
        if load is not None and load.sha256 and load.file and path.is_file() and file_stamp(path) == load.file:
            digests[shard] = load.sha256
        else:
            digests[shard] = stamped_digest(tokenized_dir, shard)[0]
    return digests


def read_membership(tokenized_dir: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The shard assignment of a tokenized dataset: (sample ids, shard indices); None when there is none."""
    keys = tokenized_shard_keys(tokenized_dir)
    if not keys:
        return None
    ids, shards = [], []
    for index, key in enumerate(keys):
        path = tokenized_shard_file(tokenized_dir, key)
        column = pq.read_table(path, columns=["sample_id"]).column("sample_id").to_numpy() if path.is_file() else []
        ids.append(np.asarray(column, dtype=np.int64))
        shards.append(np.full(len(column), index, dtype=np.int32))
    return np.concatenate(ids), np.concatenate(shards)


def tokenized_shard_keys(tokenized_dir: Path) -> list[str]:
    """The shards the tokenized dataset was made with (from summary.json); [] when there is none."""
    try:
        return [entry.shard for entry in TokenizedSummary.read(Path(tokenized_dir)).shards]
    except FileNotFoundError:
        return []
