"""The staging ring batches land in: spans stay whole, rows come back oldest first, a full ring holds the device
back; and the writer: its memory stays within max(1.5 GB, three batches) whatever the chunk size, a batch larger
than a chunk is cut between samples, and what it writes is what was staged."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from hsx_dagster.core.storage import (
    MIN_HOST_BYTES,
    ChunkLayout,
    ChunkWriter,
    RowSpec,
    ShardStore,
    StagingRing,
    StoredLayers,
    read_index,
)
from hsx_dagster_tests.support.helpers import provenance_of

SPECS = {"x": RowSpec((2,), torch.int32), "flag": RowSpec((), torch.bool)}


def test_spans_never_straddle_the_end_and_rows_come_back_oldest_first():
    ring = StagingRing(SPECS, rows=10)
    first, second = ring.reserve(4), ring.reserve(4)
    assert (first.start, first.stop, second.start, second.stop) == (0, 4, 4, 8)
    ring.release(first.number, 4)  # the oldest span written: rows 0-3 are free again
    third = ring.reserve(3)  # 2 rows left at the end are too few: the span starts over at 0
    assert (third.start, third.stop) == (0, 3)
    ring.release(second.number, 6)  # half of the second span
    assert not ring.empty
    ring.release(third.number, 3)
    assert ring.empty and ring.reserve(10).start == 0
    with pytest.raises(ValueError, match="11 rows do not fit a staging ring of 10"):
        ring.reserve(11)


def test_a_full_ring_waits_for_rows_to_be_released():
    ring = StagingRing(SPECS, rows=8)
    held = ring.reserve(6)
    reserved = []
    waiter = threading.Thread(target=lambda: reserved.append(ring.reserve(4)))
    waiter.start()
    time.sleep(0.2)
    assert not reserved  # 2 free rows: the caller waits
    ring.release(held.number, held.stop)
    waiter.join(timeout=5)
    assert reserved and reserved[0].start == 0


WIDE = ChunkLayout(StoredLayers((0, 1, 2), include_final=True), 4096, "bfloat16")  # 32 KiB of states per token


@pytest.mark.parametrize("chunk_gb", [0.25, 100.0])
def test_host_memory_stays_within_the_floor_or_three_batches_whatever_the_chunk_size(chunk_gb, tmp_path):
    with ShardStore(tmp_path / "shard-00", provenance_of(tmp_path)) as store, ThreadPoolExecutor(1) as hasher:
        writer = ChunkWriter(store, WIDE.row_specs(), int(chunk_gb * 2**30), {}, hasher, slot_names=["a"] * 4)
        largest = 0
        try:
            for tokens in (8192, 2048, 65_536):  # a batch of 8K tokens (256 MiB), a smaller one, then 2 GiB
                largest = max(largest, tokens)
                writer.abandon(writer.stage([0], [tokens]))  # nothing to write: only the ring is sized
                # three batches of what the ring carries per token: the states, ids, mask and per-token reductions
                assert writer.host_bytes <= max(MIN_HOST_BYTES, 3 * largest * _row_bytes(writer))
                assert writer.chunk_rows * sum(spec.nbytes for spec in WIDE.row_specs().values()) <= chunk_gb * 2**30
        finally:
            writer.close()


def _row_bytes(writer: ChunkWriter) -> int:
    return sum(spec.nbytes for spec in writer.specs.values())


NARROW = ChunkLayout(StoredLayers((1, 3), include_final=False), 8, "bfloat16")


def _staged_batch(writer: ChunkWriter, sample_ids: list[int], lengths: list[int]):
    batch = writer.stage(sample_ids, lengths)
    views = batch.views
    tokens = sum(lengths)
    first = sample_ids[0] * 1000
    views["input_ids"].copy_(torch.arange(first, first + tokens, dtype=torch.int32))
    views["loss_mask"].fill_(1)
    views["hidden_states"].copy_(torch.arange(tokens * 16, dtype=torch.float32).reshape(tokens, 2, 8))
    views["token_sum"].fill_(1.0)
    views["token_sum_of_squares"].fill_(2.0)
    views["token_nonfinite"].fill_(False)
    return batch


def test_a_batch_larger_than_a_chunk_is_cut_between_samples_and_chunks_end_between_batches(tmp_path):
    row_bytes = sum(spec.nbytes for spec in NARROW.row_specs().values())
    folder = tmp_path / "shard-00"
    with ShardStore(folder, provenance_of(tmp_path)) as store, ThreadPoolExecutor(1) as hasher:
        writer = ChunkWriter(store, NARROW.row_specs(), 10 * row_bytes, {}, hasher, slot_names=["layer 1", "layer 3"])
        writer.submit(_staged_batch(writer, [1, 2, 3, 4], [4, 4, 4, 4]))  # 16 tokens: larger than a chunk of 10
        writer.submit(_staged_batch(writer, [5, 6], [3, 3]))  # fits after 4 + 4 tokens? no: chunks end between
        writer.submit(_staged_batch(writer, [7], [2]))  # ... batches, unless a batch alone is larger than a chunk
        writer.close()
    records = read_index(folder)
    assert [record.sample_ids for record in records] == [[1, 2], [3, 4], [5, 6, 7]]
    assert all(record.tokens <= 10 for record in records)
    starts = {1: 1000, 3: 1008, 5: 5000}  # the first id of each chunk's first sample, as staged
    for record in records:
        chunk = load_file(folder / record.chunk)
        assert chunk["offsets"][-1] == record.tokens == chunk["input_ids"].numel()
        assert int(chunk["input_ids"][0]) == starts[record.sample_ids[0]]
        assert record.stats["sum"] == [float(record.tokens)] * 2  # the staged per-token reductions, added up
        assert record.stats["sum_of_squares"] == [2.0 * record.tokens] * 2
        assert record.stats["values_per_slot"] == record.tokens * 8
