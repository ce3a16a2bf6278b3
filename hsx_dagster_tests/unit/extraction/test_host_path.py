"""The host path keeps what the chunks guarantee: statistics reduced on the device equal those recomputed from the
stored chunks, a shard written by the previous version (chunks serialised by safetensors itself, one without
statistics) resumes and passes its checks, and the shard runs of one host share its cores."""

import errno
import fcntl
import hashlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import asdict

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from hsx_dagster.core.dataset import check_shard
from hsx_dagster.core.extraction import Backbone, HostShare, host_share, run_shard, usable_cores
from hsx_dagster.core.storage import (
    COMPLETE_FILE,
    SHARD_INDEX_FILE,
    VERIFIED_FILE,
    LayerStatistics,
    ShardProvenance,
    read_index,
)
from hsx_dagster_tests.support.helpers import batch_bytes, shard_job

LAYERS = (1, 3)


def job_keys(tokenized, out, model, **keys) -> dict:
    keys = {"batch_size": 4, "max_batch_tokens": 2048, "include_final": True, **keys}
    stored = {key: keys[key] for key in ("include_final", "storage_dtype") if key in keys}
    return dict(
        tokenized_dir=tokenized,
        output_dir=out,
        model_path=model,
        layer_ids=LAYERS,
        chunk_bytes=batch_bytes(model, LAYERS, keys["max_batch_tokens"], **stored),  # chunks of whole batches
        **keys,
    )


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float8_e4m3"])
def test_statistics_reduced_on_the_device_equal_those_recomputed_from_the_stored_chunks(
    storage_dtype, tokenized, demo_model_dir, tmp_path
):
    out = tmp_path / "shard-00"
    run_shard(shard_job(**job_keys(tokenized, out, demo_model_dir, storage_dtype=storage_dtype)))
    layers = ShardProvenance.read(out).layers
    records = read_index(out)
    assert len(records) >= 2
    for record in records:
        recomputed = LayerStatistics(layers)
        recomputed.add_chunk(out / record.chunk)  # reads the stored states (fp8 de-quantised), as for older chunks
        stats = record.stats or {}
        bound = 1e-6 * np.sqrt(recomputed.squares * recomputed.count)  # float32 summation's error, far below it
        np.testing.assert_allclose(stats["sum"], recomputed.sums, rtol=1e-5, atol=bound.max())
        np.testing.assert_allclose(stats["sum_of_squares"], recomputed.squares, rtol=1e-5)
        assert stats["nonzero"] == recomputed.nonzero.tolist() == [True] * 3
        assert stats["values_per_slot"] == recomputed.count and stats["nonfinite_samples"] == []


def _as_the_previous_version_wrote_it(folder, without_statistics: str) -> None:
    """Every chunk serialised again by ``safetensors.torch.save`` (what the previous version's store did, with its
    metadata in safetensors' own order), the index updated to the new bytes; one chunk's record without statistics
    (as versions before them wrote it)."""
    lines = []
    for record in read_index(folder):
        path = folder / record.chunk
        with safe_open(str(path), framework="pt") as chunk:
            metadata = chunk.metadata()
        payload = save(load_file(path), metadata=metadata)
        path.write_bytes(payload)
        fields = asdict(record) | {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
        if record.chunk == without_statistics:
            del fields["stats"]
        lines.append(json.dumps(fields) + "\n")
    (folder / SHARD_INDEX_FILE).write_text("".join(lines))


def test_a_shard_written_by_the_previous_version_resumes_and_checks(tokenized, demo_model_dir, tmp_path):
    uninterrupted, out = tmp_path / "uninterrupted" / "shard-00", tmp_path / "previous" / "shard-00"
    with _threads(1):  # equal inputs, equal bytes
        run_shard(shard_job(**job_keys(tokenized, uninterrupted, demo_model_dir)))
    records = read_index(uninterrupted)
    assert len(records) >= 4
    shutil.copytree(uninterrupted, out)
    _as_the_previous_version_wrote_it(out, without_statistics=records[0].chunk)
    # ... and interrupted: its last two chunks never committed
    kept = (out / SHARD_INDEX_FILE).read_text().splitlines(keepends=True)[:-2]
    (out / SHARD_INDEX_FILE).write_text("".join(kept))
    for name in (COMPLETE_FILE, VERIFIED_FILE, records[-1].chunk, records[-2].chunk):
        (out / name).unlink(missing_ok=True)
    older = {line: (out / json.loads(line)["chunk"]).read_bytes() for line in kept}

    with _threads(1):
        result = run_shard(shard_job(**job_keys(tokenized, out, demo_model_dir)))
    redone = records[-2].samples + records[-1].samples
    assert result.report.samples == redone and result.report.samples_skipped == sum(r.samples for r in records) - redone
    assert all((out / json.loads(line)["chunk"]).read_bytes() == data for line, data in older.items())  # untouched
    outcomes = check_shard(out, tokenized, "shard-00")
    assert all(outcome.passed for outcome in outcomes.values()), {k: o.description for k, o in outcomes.items()}
    assert outcomes["shard_numerics"].metadata["chunks_read_for_statistics"] == 1  # the record without them
    for record in read_index(uninterrupted):  # every sample as the uninterrupted run stored it, bit for bit
        mine = _samples(uninterrupted, record.chunk)
        theirs = {sample: _sample_of(out, sample) for sample in mine}
        assert all(torch.equal(mine[s][k], theirs[s][k]) for s in mine for k in mine[s])


def _samples(folder, chunk_name) -> dict:
    chunk = load_file(folder / chunk_name)
    offsets = chunk["offsets"].tolist()
    return {
        int(sample): {name: chunk[name][offsets[k] : offsets[k + 1]].view(torch.uint8) for name in
                      ("input_ids", "loss_mask", "hidden_states", "final_hidden_states")}
        for k, sample in enumerate(chunk["sample_ids"].tolist())
    }  # fmt: skip


def _sample_of(folder, sample_id: int) -> dict:
    for record in read_index(folder):
        if sample_id in record.sample_ids:
            return _samples(folder, record.chunk)[sample_id]
    raise AssertionError(f"sample {sample_id} is not stored")


class _threads:
    def __init__(self, count: int) -> None:
        self.count, self.before = count, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.count)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.before)


HOLD_A_REGISTRATION = textwrap.dedent("""
    import sys, time
    from hsx_dagster.core.extraction.host_share import HostShare
    share = HostShare(sys.argv[1])
    print("registered", flush=True)
    time.sleep(300)
""")


def test_shard_runs_on_one_host_share_its_cores_and_a_dead_one_stops_counting(tmp_path, monkeypatch):
    monkeypatch.setattr(host_share, "RECOUNT_S", 0.0)
    mine = HostShare(tmp_path, cores=8)
    assert mine.threads() == 8 and mine.runs == 1
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_REGISTRATION, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "registered"
        third = HostShare(tmp_path, cores=8)
        assert mine.threads() == 2 and mine.runs == 3  # 8 cores over three runs
        third.close()
        assert mine.threads() == 4
        other.send_signal(signal.SIGKILL)  # the kernel drops its lock: its registration no longer counts
        other.wait(timeout=30)
        assert mine.threads() == 8 and mine.runs == 1
        registered = (tmp_path / host_share.RUNS_DIR).glob(f"run-{socket.gethostname()}-*.lock")
        assert len(list(registered)) == 1  # the dead one's file is gone
    finally:
        other.kill()
        mine.close()
    assert HostShare(tmp_path, fixed=3, cores=8).threads() == 3  # a number in the settings wins


def test_a_folder_that_refuses_flock_leaves_the_run_every_core_and_says_so(tmp_path, monkeypatch, caplog):
    def refuse(handle, operation):  # what Lustre without -o flock answers; no such filesystem here
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)  # host_share locks through the storage layer's FileLock
    share = HostShare(tmp_path, cores=6)
    assert share.threads() == 6
    assert "cannot register this shard run" in caplog.text and str(tmp_path / host_share.RUNS_DIR) in caplog.text
    assert not list((tmp_path / host_share.RUNS_DIR).iterdir())  # nothing left behind


def test_a_run_uses_its_share_of_the_cores_and_gives_the_threads_back(tokenized, demo_model_dir, tmp_path, monkeypatch):
    seen: list[int] = []
    original = Backbone.forward

    def watched(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Backbone, "forward", watched)
    lock_dir = tmp_path / "locks"
    neighbour = HostShare(lock_dir)  # another shard run on this host
    keys = job_keys(tokenized, tmp_path / "shard-00", demo_model_dir, device_lock_dir=lock_dir)
    with _threads(2):
        run_shard(shard_job(**keys))
        assert torch.get_num_threads() == 2  # given back
    neighbour.close()
    assert set(seen) == {max(1, min(2, usable_cores() // 2))}
    seen.clear()
    with _threads(2):
        run_shard(shard_job(**{**keys, "output_dir": tmp_path / "fixed", "host_threads": 1}))
    assert set(seen) == {1}
