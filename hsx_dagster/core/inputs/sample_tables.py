"""The Parquet tables tokenization writes: samples in staging and per shard (`SAMPLE_SCHEMA`), rejects
(`REJECT_SCHEMA`), built in columns from the first pass's rows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hsx_dagster.core.inputs.records import RawRecord, Reject
from hsx_dagster.core.storage.format import REJECT_SCHEMA, SAMPLE_SCHEMA

WRITE_ROWS = 4096  # rows per row group: fewer, larger writes cost the reading process less
STAGING_SCHEMA = pa.schema([f for f in SAMPLE_SCHEMA if f.name != "shard"])  # before shards are assigned
# One sample of the first pass: its record, sample id, token ids and loss mask.
SampleRow = tuple[RawRecord, int, np.ndarray, np.ndarray]


def write_shards(staging_file: Path, samples_dir: Path, assignment: np.ndarray, keys: list[str]) -> None:
    writers = {key: pq.ParquetWriter(samples_dir / f"{key}.parquet", SAMPLE_SCHEMA) for key in keys}
    try:
        offset = 0
        for batch in pq.ParquetFile(staging_file).iter_batches(batch_size=WRITE_ROWS):
            shard_of_row = assignment[offset : offset + batch.num_rows]
            offset += batch.num_rows
            table = pa.Table.from_batches([batch])
            for index, key in enumerate(keys):
                rows = np.flatnonzero(shard_of_row == index)
                if len(rows):
                    part = table.take(pa.array(rows))
                    writers[key].write_table(part.append_column("shard", pa.array([key] * len(rows), pa.string())))
    finally:
        for writer in writers.values():
            writer.close()


def sample_table(rows: Sequence[SampleRow]) -> pa.Table:
    lengths = np.asarray([len(ids) for _, _, ids, _ in rows], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = np.concatenate([ids for _, _, ids, _ in rows]) if rows else np.zeros(0, np.int32)
    masks = np.concatenate([mask for _, _, _, mask in rows]) if rows else np.zeros(0, np.uint8)
    return pa.table(
        {
            "sample_id": pa.array([sample_id for _, sample_id, _, _ in rows], pa.int64()),
            "source": pa.array([item.source for item, _, _, _ in rows], pa.string()),
            "source_index": pa.array([item.source_index for item, _, _, _ in rows], pa.int64()),
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, pa.int32())),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(masks, pa.uint8())),
            "num_tokens": pa.array(lengths, pa.int32()),
            "num_loss_tokens": pa.array([int(mask.sum()) for _, _, _, mask in rows], pa.int32()),
        },
        schema=STAGING_SCHEMA,
    )


def reject_table(rejects: Sequence[Reject]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "source": r.source,
                "source_index": r.source_index,
                "location": r.location,
                "reason": r.reason,
                "detail": r.detail,
            }
            for r in rejects
        ],
        schema=REJECT_SCHEMA,
    )
