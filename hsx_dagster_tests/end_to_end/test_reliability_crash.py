"""Crash safety: a shard run killed with SIGKILL at any moment resumes to exactly the dataset an
uninterrupted run writes, sample by sample and byte for byte; no temporary file stays and the lock
is free. Also a full disk (ENOSPC) while a chunk is written: a clear error, nothing half-written,
and the re-run completes.

The runs that are killed are real processes (see shard_child.py); the re-runs happen here.
"""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hsx_dagster.core.dataset import check_shard, shard_checks
from hsx_dagster.core.extraction import run_shard
from hsx_dagster.core.inputs import read_tokenized_shard
from hsx_dagster.core.storage import (
    COMPLETE_FILE,
    LOCK_FILE,
    SET_ASIDE_DIR,
    SHARD_FILE,
    SHARD_INDEX_FILE,
    SPLIT_BATCHES_FILE,
    WRITTEN_FILE,
    StoreError,
    atomic as atomic_module,
    read_index,
)
from hsx_dagster_tests.support import shard_child
from hsx_dagster_tests.support.helpers import shard_job, tokenize

pytestmark = pytest.mark.slow  # servers, subprocesses or kills: left out of the quick loop

# A batch of four samples of at most 256 tokens (2 bfloat16 layers of 64, ids and mask): chunks of whole batches,
# several per shard.
CHUNK_BYTES = 4 * 256 * (2 * 64 * 2 + 5)
# Chunks smaller than most batches: a batch is cut into several, and a crash between them leaves it half committed
# (its other samples are computed in the same batch again: replay.py).
CUT_CHUNK_BYTES = 100_000


@pytest.fixture(scope="module")
def tokenized(small_inputs, demo_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("crash") / "tokenized"
    tokenize([small_inputs], demo_model_dir, out, shards=1, max_length=256)
    return out


def job_for(tokenized: Path, out: Path, model: Path, chunk_bytes: int = CHUNK_BYTES) -> dict:
    return dict(
        shard="shard-00",
        shard_index=0,
        tokenized_dir=tokenized,
        output_dir=out,
        model_path=model,
        layer_ids=(1, 3),
        devices=("cpu",),
        storage_dtype="bfloat16",
        batch_size=4,
        max_batch_tokens=4096,
        chunk_bytes=chunk_bytes,
    )


@contextmanager
def one_thread():
    """Single-threaded arithmetic, as in the killed child: equal inputs give equal bytes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def stored_bytes(out: Path) -> dict[int, dict[str, bytes]]:
    """sample_id -> every per-token tensor of that sample as raw bytes, read straight from the chunks."""
    samples: dict[int, dict[str, bytes]] = {}
    for record in read_index(out):
        with safe_open(str(out / record.chunk), framework="pt") as chunk:
            offsets = chunk.get_tensor("offsets").tolist()
            ids = chunk.get_tensor("sample_ids").tolist()
            names = sorted(set(chunk.keys()) - {"offsets", "sample_ids"})
            tensors = {name: chunk.get_tensor(name) for name in names}
        for k, sample_id in enumerate(ids):
            assert sample_id not in samples, f"sample {sample_id} stored twice"
            samples[sample_id] = {
                name: bytes(t[offsets[k] : offsets[k + 1]].contiguous().view(torch.uint8).numpy())
                for name, t in tensors.items()
            }
    return samples


def assert_clean_and_equal(out: Path, reference: dict) -> None:
    """The shard equals the uninterrupted one and holds nothing but committed work."""
    committed = {record.chunk for record in read_index(out)}
    names = {path.name for path in out.iterdir()}
    # and the log of the batches cut into several chunks, when some were (core/extraction/replay.py)
    assert names - {SPLIT_BATCHES_FILE} == committed | {SHARD_INDEX_FILE, SHARD_FILE, COMPLETE_FILE, LOCK_FILE}, names
    assert (out / SHARD_INDEX_FILE).read_bytes().endswith(b"\n")
    stored = stored_bytes(out)
    assert stored.keys() == reference.keys()
    for sample_id, tensors in reference.items():
        assert stored[sample_id] == tensors, f"sample {sample_id} differs from the uninterrupted run"


def assert_lock_free(out: Path) -> None:
    with open(out / LOCK_FILE, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if still held
        fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def reference(tokenized, demo_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted") / "shard-00"
    with one_thread():
        run_shard(shard_job(**job_for(tokenized, out, demo_model_dir)))
    assert len(read_index(out)) >= 4, "the crash tests need several chunks"
    return stored_bytes(out)


@pytest.fixture(scope="module")
def forkserver():
    """Children forked from a server that imported the shard code once: each starts in milliseconds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["hsx_dagster_tests.support.shard_child"])
    return context


KILLS = [
    ("forward", 5),  # in the middle of the fifth forward pass
    ("chunk_write", 2),  # half of the second chunk's temporary file on disk
    ("after_commit", 2),  # between chunks: the second one just committed
    ("index_append", 2),  # half of the second chunk's index line on disk
]


@pytest.mark.parametrize("chunk_bytes", [CHUNK_BYTES, CUT_CHUNK_BYTES], ids=["whole-batches", "cut-batches"])
@pytest.mark.parametrize("point, at", KILLS, ids=[point for point, _ in KILLS])
def test_sigkill_at_any_moment_resumes_to_the_uninterrupted_dataset(
    point, at, chunk_bytes, tokenized, demo_model_dir, reference, forkserver, tmp_path
):
    out = tmp_path / "shard-00"
    job = job_for(tokenized, out, demo_model_dir, chunk_bytes)
    child = forkserver.Process(target=shard_child.run_and_kill, args=(job, point, at))
    child.start()
    child.join(timeout=300)
    assert child.exitcode == -signal.SIGKILL, f"the child was not killed at {point} #{at} (exit {child.exitcode})"

    # What the kill left behind is what each moment should leave.
    lines = (out / SHARD_INDEX_FILE).read_text().splitlines(keepends=True) if (out / SHARD_INDEX_FILE).exists() else []
    assert not (out / COMPLETE_FILE).exists()
    if point == "chunk_write":
        (temporary,) = out.glob(".chunk-000001.safetensors.tmp*")
        assert temporary.stat().st_size > 0 and len(lines) == 1
    elif point == "after_commit":
        assert len(lines) == 2 and all(line.endswith("\n") for line in lines)
    elif point == "index_append":
        assert len(lines) == 2 and not lines[-1].endswith("\n") and (out / "chunk-000001.safetensors").exists()
    else:
        assert len(lines) < len(read_index(out)) + 1 and sum(r.samples for r in read_index(out)) < len(reference)
    assert_lock_free(out)  # the kernel released it with the process
    committed = sum(record.samples for record in read_index(out))

    with one_thread():
        result = run_shard(shard_job(**job))
    assert result.report.samples_skipped == committed  # committed work is never redone
    assert result.report.samples == len(reference) - committed
    assert_clean_and_equal(out, reference)
    assert_lock_free(out)


def test_sigkill_during_a_direct_write_resumes_to_the_uninterrupted_dataset(
    tokenized, demo_model_dir, reference, forkserver, tmp_path
):
    """O_DIRECT writes (direct_io: on; the padded last block, the cut to size) are whole or absent as buffered ones
    are: a kill half-way through a chunk leaves a temporary the next run removes, and the dataset ends equal."""
    out = tmp_path / "shard-00"
    job = {**job_for(tokenized, out, demo_model_dir), "direct_io": "on"}
    child = forkserver.Process(target=shard_child.run_and_kill, args=(job, "chunk_write", 2))
    child.start()
    child.join(timeout=300)
    assert child.exitcode == -signal.SIGKILL, f"the child was not killed (exit {child.exitcode})"
    assert len(read_index(out)) == 1 and list(out.glob(".chunk-000001.safetensors.tmp*"))
    with one_thread():
        result = run_shard(shard_job(**job))
    if not result.report.chunks_direct:
        pytest.skip(f"{out}: the file system takes no direct writes ({result.report.direct_io})")
    assert result.report.direct_io == "direct (direct_io: on)"
    assert_clean_and_equal(out, reference)


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_while_writing_a_chunk_is_named_and_leaves_nothing_half_written(
    tokenized, demo_model_dir, reference, tmp_path, monkeypatch
):
    out = tmp_path / "shard-00"
    job = job_for(tokenized, out, demo_model_dir)
    real_open = open
    writes = []

    def open_on_a_filling_disk(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if Path(file).name.startswith(".chunk-") and "w" in mode:
            writes.append(file)
            if len(writes) == 2:
                return shard_child.HalfWrittenFile(handle, _disk_full)
        return handle

    monkeypatch.setattr(atomic_module, "open", open_on_a_filling_disk, raising=False)
    with one_thread(), pytest.raises(StoreError) as failure:
        run_shard(shard_job(**job))
    message = str(failure.value)
    assert f"{out / 'chunk-000001.safetensors'}: no space left on device" in message and "run again" in message
    assert [path.name for path in out.iterdir() if ".tmp" in path.name] == []  # the temporary was removed
    assert [record.chunk for record in read_index(out)] == ["chunk-000000.safetensors"]
    assert not (out / "chunk-000001.safetensors").exists() and not (out / COMPLETE_FILE).exists()

    monkeypatch.undo()  # space was freed
    with one_thread():
        result = run_shard(shard_job(**job))
    assert result.report.samples_skipped == read_index(out)[0].samples
    assert_clean_and_equal(out, reference)
    assert json.loads((out / COMPLETE_FILE).read_text())["samples"] == len(reference)
    assert sorted(reference) == sorted(read_tokenized_shard(tokenized, "shard-00").column("sample_id").to_pylist())


@pytest.fixture(scope="module")
def extracted_shard(tokenized, demo_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("to-heal") / "shard-00"
    with one_thread():
        run_shard(shard_job(**job_for(tokenized, out, demo_model_dir)))
    return out


@pytest.mark.parametrize("point", ["logged", "moved", "reextraction"])
def test_sigkill_while_healing_a_damaged_chunk_resumes(
    point, tokenized, demo_model_dir, reference, extracted_shard, forkserver, tmp_path
):
    """A crash while a damaged chunk is set aside (removal logged / chunk moved, index not yet rewritten), or while
    its samples are extracted again, loses nothing committed: the next check or run completes the removal, and the
    shard ends as the uninterrupted one, sample by sample."""
    out = tmp_path / "shard-00"
    shutil.copytree(extracted_shard, out)
    damaged = read_index(out)[1]
    data = bytearray((out / damaged.chunk).read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / damaged.chunk).write_bytes(bytes(data))
    job = job_for(tokenized, out, demo_model_dir)
    if point == "reextraction":
        check_shard(out, tokenized, "shard-00", heal=True)
        child = forkserver.Process(target=shard_child.run_and_kill, args=(job, "forward", 1))
    else:
        child = forkserver.Process(target=shard_child.heal_and_kill, args=(out, tokenized, point))
    child.start()
    child.join(timeout=300)
    assert child.exitcode == -signal.SIGKILL, f"the child was not killed at {point} (exit {child.exitcode})"
    assert_lock_free(out)
    others = {r.chunk: (out / r.chunk).read_bytes() for r in read_index(out) if r.chunk != damaged.chunk}

    with one_thread():
        result = run_shard(shard_job(**job))  # completes an interrupted removal first, then re-extracts
    assert result.report.samples == damaged.samples
    assert sorted(i for r in read_index(out) for i in r.sample_ids if i in damaged.sample_ids) == sorted(
        damaged.sample_ids
    )
    assert {r.chunk: (out / r.chunk).read_bytes() for r in read_index(out) if r.chunk in others} == others
    assert (out / SET_ASIDE_DIR / f"{damaged.chunk}.{damaged.sha256[:12]}").is_file()
    outcomes = check_shard(out, tokenized, "shard-00", heal=True)
    assert all(o.passed for o in outcomes.values()), {k: o.description for k, o in outcomes.items()}
    stored = stored_bytes(out)
    assert stored.keys() == reference.keys()
    for sample_id in reference:
        assert stored[sample_id] == reference[sample_id], f"sample {sample_id} differs from the uninterrupted run"


def test_a_damaged_chunk_of_a_cut_batch_heals_to_the_uninterrupted_bytes(
    tokenized, demo_model_dir, reference, tmp_path
):
    """Its samples are extracted again in the batch they first formed (split_batches.jsonl), not alone."""
    out = tmp_path / "shard-00"
    job = job_for(tokenized, out, demo_model_dir, CUT_CHUNK_BYTES)
    with one_thread():
        run_shard(shard_job(**job))
    logged = [json.loads(line)["sample_ids"] for line in (out / SPLIT_BATCHES_FILE).read_text().splitlines()]
    damaged = next(r for r in read_index(out) if any(set(r.sample_ids) < set(batch) for batch in logged))
    data = bytearray((out / damaged.chunk).read_bytes())
    data[-3] ^= 0x01
    (out / damaged.chunk).write_bytes(bytes(data))
    assert not check_shard(out, tokenized, "shard-00", heal=True)["shard_integrity"].passed

    with one_thread():
        result = run_shard(shard_job(**job))
    assert result.report.samples == damaged.samples  # only its samples stored again, though their batch ran whole
    assert result.report.computed_tokens > sum(len(reference[i]["input_ids"]) // 4 for i in damaged.sample_ids)
    assert all(outcome.passed for outcome in check_shard(out, tokenized, "shard-00").values())
    stored = stored_bytes(out)
    assert stored.keys() == reference.keys()
    for sample_id in damaged.sample_ids:
        assert stored[sample_id] == reference[sample_id], f"sample {sample_id} differs from the uninterrupted run"


def test_the_runs_own_chunks_are_not_hashed_again_and_damage_after_its_commit_is_caught(
    tokenized, demo_model_dir, tmp_path, monkeypatch
):
    """One hash per byte: the checks of the run that wrote a chunk take its writer's digest while the file is the
    one committed (written.jsonl); a chunk changed after the commit is read whole and caught: a byte flipped in
    place (same size, new mtime), the same flip with the mtime set back (its ctime moved), and a replaced file (new
    inode, mtime set back too). Counted by the bytes the checks hash, not by a timing."""
    out = tmp_path / "shard-00"
    with one_thread():
        run_shard(shard_job(**job_for(tokenized, out, demo_model_dir), run_id="run-1"))
    records = read_index(out)
    assert len(read_lines_of(out / WRITTEN_FILE)) == len(records) >= 4
    flipped, flipped_back, replaced = records[0], records[1], records[2]
    for record in (flipped, flipped_back):
        path = out / record.chunk
        before = path.stat()
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))  # in place: same size and inode
        if record is flipped_back:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert path.stat().st_size == before.st_size and path.stat().st_ino == before.st_ino
    path = out / replaced.chunk
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    (out / "replacement").write_bytes(bytes(data))
    os.utime(out / "replacement", ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(out / "replacement", path)

    hashed: list[str] = []
    real_scan = shard_checks.scan_chunk

    def counting_scan(chunk: Path):
        scanned = real_scan(chunk)
        hashed.append(Path(chunk).name)
        return scanned

    monkeypatch.setattr(shard_checks, "scan_chunk", counting_scan)
    outcomes = check_shard(out, tokenized, "shard-00", run_id="run-1")
    integrity = outcomes["shard_integrity"]
    assert sorted(hashed) == sorted(r.chunk for r in (flipped, flipped_back, replaced))  # the others: not read
    assert not integrity.passed
    for record in (flipped, flipped_back, replaced):
        assert f"{out / record.chunk}: checksum differs" in integrity.description
    assert integrity.metadata["scan_bytes"] == flipped.bytes + flipped_back.bytes + replaced.bytes
    assert integrity.metadata["chunks_from_writer"] == len(records) - 3
    assert outcomes["shard_coverage"].metadata["chunks_compared"] == len(records)  # the writer's ones too

    hashed.clear()  # another run's id (or none: a check run on its own) takes no writer's digest
    other = check_shard(out, tokenized, "shard-00", run_id="run-2")["shard_integrity"]
    assert other.metadata["chunks_from_writer"] == 0
    assert len(hashed) + other.metadata["chunks_skipped"] == len(records)  # skipped: verified by the check above


def read_lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()
