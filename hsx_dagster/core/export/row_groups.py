"""A drafter dataset's tokenized rows (ids and loss masks) in an export's row order, in groups of bounded size.

The export's rows are ordered by sample id (train, then validation); the tokenized shards hold the same samples in
input order, and sample ids are content hashes, so every group of output rows draws on every shard. Holding all
shards at once would cost 5 bytes per token (1.7 GB at 10^6 samples of 335 tokens); instead, two passes over
scratch files, each file one group of output rows:

1. each shard's Parquet file is read in record batches; each row goes, with its output position, to the scratch
   Arrow file of its group (compact dtypes, as tokenized: int32 ids, uint8 masks);
2. each group's file is read back, sorted by position and handed out, then deleted.

Memory: one record batch of a shard or one group, whatever the number of samples; disk: one extra copy of the ids
and masks, written once and read once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hsx_dagster.core.inputs.tokenized import read_tokenized_shard
from hsx_dagster.core.storage.format import tokenized_shard_file

COLUMNS = ["sample_id", "input_ids", "loss_mask"]
ALIGN = 1000  # group sizes are a multiple of the export's record batches (speculators: 1,000 rows)
MIN_GROUP_ROWS = 8000  # about 2.7 M tokens at 335 per sample: tens of MB per group
MAX_GROUPS = 256  # scratch files open at once in the first pass
READ_BATCH_ROWS = 16384


def group_rows(rows: int) -> int:
    """Rows per group: at least MIN_GROUP_ROWS, few enough groups to keep their files open, a multiple of ALIGN."""
    wanted = max(MIN_GROUP_ROWS, -(-rows // MAX_GROUPS))
    return -(-wanted // ALIGN) * ALIGN


class _Positions:
    """Output position of each sample id (-1 for ids not exported), from sorted arrays, not a dict per sample."""

    def __init__(self, order: np.ndarray) -> None:
        self.permutation = np.argsort(order, kind="stable")
        self.sorted = order[self.permutation]

    def of(self, sample_ids: np.ndarray) -> np.ndarray:
        if len(self.sorted) == 0:
            return np.full(len(sample_ids), -1, dtype=np.int64)
        places = np.minimum(np.searchsorted(self.sorted, sample_ids), len(self.sorted) - 1)
        return np.where(self.sorted[places] == sample_ids, self.permutation[places], -1)


def rows_in_order(tokenized_dir: Path, shards: Sequence[str], order: np.ndarray, scratch: Path) -> Iterator[pa.Table]:
    """Tables of consecutive output rows (``sample_id``, ``input_ids`` list<int32>, ``loss_mask`` list<uint8>) for
    the samples ``order`` lists, in that order; FileNotFoundError names samples no tokenized shard holds."""
    order = np.asarray(order, dtype=np.int64)
    size = group_rows(len(order))
    groups = -(-len(order) // size)
    scratch.mkdir(parents=True, exist_ok=True)
    for stale in scratch.glob("group-*.arrow"):  # an interrupted run's
        stale.unlink()
    paths = [scratch / f"group-{k:06d}.arrow" for k in range(groups)]
    try:
        _scatter(tokenized_dir, shards, order, size, paths)
        for k, path in enumerate(paths):
            yield _gathered(path, k * size, min(size, len(order) - k * size), order, tokenized_dir)
            path.unlink()
    finally:
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            scratch.rmdir()


def _scatter(tokenized_dir: Path, shards: Sequence[str], order: np.ndarray, size: int, paths: list[Path]) -> None:
    """Pass 1: every exported row of every shard appended, with its position, to its group's file."""
    positions = _Positions(order)
    writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
    try:
        for shard in shards:
            read_tokenized_shard(tokenized_dir, shard, ["sample_id"])  # a missing shard is named, with what to do
            source = pq.ParquetFile(tokenized_shard_file(tokenized_dir, shard))
            for batch in source.iter_batches(batch_size=READ_BATCH_ROWS, columns=COLUMNS):
                where = positions.of(batch.column("sample_id").to_numpy())
                group = np.where(where >= 0, where // size, -1)
                for k in np.unique(group[group >= 0]).tolist():
                    picked = np.flatnonzero(group == k)
                    part = batch.take(pa.array(picked)).append_column("position", pa.array(where[picked]))
                    if k not in writers:
                        writers[k] = pa.ipc.new_stream(str(paths[k]), part.schema)
                    writers[k].write_batch(part)
    finally:
        for writer in writers.values():
            writer.close()


def _gathered(path: Path, start: int, count: int, order: np.ndarray, tokenized_dir: Path) -> pa.Table:
    """Pass 2: one group's rows, sorted by position; every position of the group present exactly once."""
    if not path.is_file():  # no shard held any sample of this group
        table = pa.table({"position": pa.array([], pa.int64())})
    else:
        with pa.OSFile(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
    found = table.column("position").to_numpy()
    if len(found) != count or not np.array_equal(np.sort(found), np.arange(start, start + count)):
        missing = np.setdiff1d(np.arange(start, start + count), found)
        raise FileNotFoundError(
            f"{tokenized_dir}: samples {order[missing[:5]].tolist()} of the drafter dataset are not tokenized"
            if len(missing)
            else f"{tokenized_dir}: samples tokenized more than once"
        )
    table = table.take(pa.array(np.argsort(found, kind="stable"))).drop_columns(["position"])
    return table.combine_chunks()


def masked_values(table: pa.Table) -> np.ndarray:
    """The loss-masked token ids of ``table``'s rows, in row order, as one numpy array."""
    ids = pc.list_flatten(table.column("input_ids")).to_numpy()
    mask = pc.list_flatten(table.column("loss_mask")).to_numpy()
    return np.asarray(ids[mask != 0], dtype=np.int64)


class TokenCounts:
    """Token frequencies over row groups with numpy, keyed in order of first appearance (as a Counter fed the rows
    in order would be): the same dict, built without a Python object per token."""

    def __init__(self) -> None:
        self.counts = np.zeros(0, dtype=np.int64)
        self.first = np.zeros(0, dtype=np.int64)
        self.seen = 0

    def add(self, tokens: np.ndarray) -> None:
        if len(tokens) == 0:
            return
        top = int(tokens.max()) + 1
        if top > len(self.counts):
            self.counts = np.concatenate([self.counts, np.zeros(top - len(self.counts), dtype=np.int64)])
            self.first = np.concatenate([self.first, np.full(top - len(self.first), -1, dtype=np.int64)])
        self.counts += np.bincount(tokens, minlength=len(self.counts))
        values, places = np.unique(tokens, return_index=True)
        new = self.first[values] < 0
        self.first[values[new]] = self.seen + places[new]
        self.seen += len(tokens)

    def as_dict(self) -> dict[int, int]:
        tokens = np.flatnonzero(self.counts)
        tokens = tokens[np.argsort(self.first[tokens], kind="stable")]
        return dict(zip(tokens.tolist(), self.counts[tokens].tolist()))
