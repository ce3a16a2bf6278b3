"""The free-disk check counts what the other running shards will still write (shared output folders)."""

import shutil
import subprocess
import sys

import pytest

from hsx_dagster.core.extraction import (
    RESERVATIONS_DIR,
    InsufficientDiskError,
    check_free_disk,
    pending_writes,
    reserve,
    run_shard,
)
from hsx_dagster_tests.support.helpers import shard_job


def test_what_another_shard_still_writes_shrinks_as_it_writes(tmp_path):
    records = tmp_path / RESERVATIONS_DIR
    other_dir = tmp_path / "hidden_states" / "shard-01"
    other_dir.mkdir(parents=True)
    (other_dir / "old-chunk.safetensors").write_bytes(b"x" * 300)  # committed before this run started
    with reserve(records, "shard-01", other_dir, needed=1_000):
        mine = reserve(records, "shard-00", tmp_path / "hidden_states" / "shard-00", needed=50)
        assert [(p.shard, p.remaining) for p in pending_writes(records, own=mine)] == [("shard-01", 1_000)]
        (other_dir / "chunk-0001.safetensors").write_bytes(b"x" * 400)
        assert [p.remaining for p in pending_writes(records, own=mine)] == [600]
        mine.release()
    assert pending_writes(records) == [] and not list(records.iterdir())  # released records are gone


def test_the_check_sets_aside_what_others_will_write_and_names_them(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    check_free_disk(tmp_path, free // 2)  # alone it fits
    with pytest.raises(InsufficientDiskError, match=r"other running shards will still write .* \(shard-01 "):
        check_free_disk(tmp_path, free // 2, others=[("shard-01", free // 2), ("shard-02", 0)])


HOLD = """
import sys, time
from pathlib import Path
from hsx_dagster.core.extraction.disk_reservations import reserve
root = Path(sys.argv[1])
held = reserve(root / "disk_reservations", "shard-01", root / "hidden_states" / "shard-01", int(sys.argv[2]))
print("reserved", flush=True)
time.sleep(600)
"""


def test_a_shard_run_counts_a_live_run_in_another_process_and_ignores_a_dead_one(tmp_path, tokenized, demo_model_dir):
    out = tmp_path / "out"
    job = shard_job(
        tokenized_dir=tokenized,
        output_dir=out / "hidden_states" / "shard-00",
        model_path=demo_model_dir,
        layer_ids=[1, 2],
        batch_size=8,
        max_batch_tokens=4096,
    )
    out.mkdir()
    promised = shutil.disk_usage(out).free - 1_000  # another shard will fill the disk but for 1 KB
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(out), str(promised)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "reserved"
        with pytest.raises(InsufficientDiskError, match=r"other running shards will still write .*\(shard-01 "):
            run_shard(job)
    finally:
        other.kill()  # SIGKILL: its record stays on disk, but its lock goes with it
        other.wait()
    assert len(list((out / RESERVATIONS_DIR).glob("shard-01.*.json"))) == 1
    result = run_shard(job)  # the dead run's record is ignored (and removed)
    assert result.report.samples > 0 and not list((out / RESERVATIONS_DIR).iterdir())
