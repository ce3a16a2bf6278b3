"""A shard's committed samples against its current tokenized samples: what is pending, what left, what changed.

Samples keep their shard (hsx_dagster.core.inputs.sharding), so after the inputs grow or shrink a shard holds
three kinds of samples: current and committed (kept as they are), current and not committed (pending: the next
run extracts them), and committed but no longer in the inputs (departed: never indexed or served again; a chunk
holding only departed samples is deleted by the next run). A committed sample whose stored token ids or loss mask
differ from its tokenized row (another tokenizer, chat template, max_length or thinking policy) is not current
either: the run refuses to mix it, or with ``on_mismatch: start_over`` re-extracts the chunks holding such samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from safetensors import safe_open

from hsx_dagster.core.storage.atomic import StoreError
from hsx_dagster.core.storage.chunk_checks import TokenizedRows, positions_of
from hsx_dagster.core.storage.files import file_sha256
from hsx_dagster.core.storage.shard_records import ChunkRecord, read_index, read_quarantine


@dataclass(frozen=True)
class ShardWork:
    """What a shard run has to do: samples to extract, samples committed that left the inputs."""

    current: int  # tokenized samples of the shard
    committed: int  # of them, committed or quarantined
    pending: int  # of them, still to extract
    pending_tokens: int
    departed: int  # committed samples no longer among the tokenized ones

    @property
    def stale(self) -> bool:
        return bool(self.pending or self.departed)


def shard_work(shard_dir: Path, sample_ids: np.ndarray, num_tokens: np.ndarray | None = None) -> ShardWork:
    """``shard_dir``'s work for the tokenized samples ``sample_ids`` (with their ``num_tokens``); a shard never
    extracted has every sample pending. Reads the index only, no chunk."""
    ids = np.asarray(sample_ids, dtype=np.int64)
    try:
        records, quarantined = read_index(shard_dir), read_quarantine(shard_dir)
    except (StoreError, TypeError):
        records, quarantined = [], []
    committed = np.fromiter((i for r in records for i in r.sample_ids), dtype=np.int64)
    done = np.concatenate([committed, np.asarray([q.sample_id for q in quarantined], dtype=np.int64)])
    pending = ~np.isin(ids, done)
    tokens = np.asarray(num_tokens, dtype=np.int64)[pending].sum() if num_tokens is not None else 0
    return ShardWork(
        current=len(ids),
        committed=int((~pending).sum()),
        pending=int(pending.sum()),
        pending_tokens=int(tokens),
        departed=int((~np.isin(committed, ids)).sum()),
    )


def chunks_with_changed_tokens(
    directory: Path, records: Sequence[ChunkRecord], table: pa.Table
) -> list[tuple[ChunkRecord, int]]:
    """Committed chunks holding current samples whose stored ids or loss mask differ from ``table``'s rows
    (sample_id, input_ids, loss_mask), with how many such samples each holds. Reads ids and masks, and hashes
    only a chunk that differs (to tell damage from re-tokenization)."""
    rows = TokenizedRows(table)
    changed = []
    for record in records:
        path = Path(directory) / record.chunk
        if not path.is_file():
            continue  # a missing chunk is the integrity check's finding
        try:
            with safe_open(str(path), framework="np") as chunk:
                small = {name: chunk.get_tensor(name) for name in ("offsets", "input_ids", "loss_mask", "sample_ids")}
            count = len(rows.mismatching(small, positions_of(record.sample_ids)))
        except Exception:  # an unreadable chunk: damage, told apart below
            count = record.samples
        # A chunk whose bytes are no longer those committed is damaged, not re-tokenized: the integrity check
        # sets it aside and the next run re-extracts its samples (healing.py).
        if count and file_sha256(path) == record.sha256:
            changed.append((record, count))
    return changed
