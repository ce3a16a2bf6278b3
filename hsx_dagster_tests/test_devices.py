"""One run per GPU: claims, preference for the shard's own device, waiting, and release on death."""

import subprocess
import sys
import threading
import time

import pytest

from hsx_dagster.core.extraction.devices import DeviceBusyError, candidate_devices, claim_device

GPUS = ["cuda:0", "cuda:1"]


def test_candidates_expand_auto_and_check_ids():
    assert candidate_devices(["auto"], 0) == ["cpu"]
    assert candidate_devices(["auto"], 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert candidate_devices(["cuda:1", "cuda", "cuda:1"], 2) == ["cuda:1", "cuda:0"]
    with pytest.raises(RuntimeError, match="asks for 'cuda' but no CUDA device is visible"):
        candidate_devices(["cuda"], 0)
    with pytest.raises(RuntimeError, match="cuda:4 is not available on this machine"):
        candidate_devices(["cuda:4"], 2)


def test_two_runs_never_share_a_gpu(tmp_path):
    first = claim_device(GPUS, 1, owner="run A", lock_dir=tmp_path)
    assert first.device == "cuda:1"  # the shard's own device first
    second = claim_device(GPUS, 1, owner="run B", lock_dir=tmp_path)
    assert second.device == "cuda:0"  # its own is taken: any free one
    with pytest.raises(
        DeviceBusyError, match=r"no free device among cuda:1, cuda:0.*cuda:1: held by run A.*cuda:0: held by run B"
    ):
        claim_device(GPUS, 1, owner="run C", lock_dir=tmp_path, wait_s=0)
    first.release()
    with claim_device(GPUS, 0, owner="run C", lock_dir=tmp_path) as third:
        assert third.device == "cuda:1"
    second.release()


def test_a_waiting_run_gets_the_device_when_it_frees(tmp_path):
    holder = claim_device(["cuda:0"], 0, owner="run A", lock_dir=tmp_path)
    threading.Timer(0.5, holder.release).start()
    started = time.monotonic()
    with claim_device(["cuda:0"], 0, owner="run B", lock_dir=tmp_path, wait_s=30, poll_s=0.1) as claim:
        assert claim.device == "cuda:0" and time.monotonic() - started < 10


def test_a_killed_run_leaves_no_device_locked(tmp_path):
    code = (
        "import sys, time; from pathlib import Path; from hsx_dagster.core.extraction.devices import claim_device;"
        f"c = claim_device(['cuda:0'], 0, owner='doomed', lock_dir=Path({str(tmp_path)!r}));"
        "print('claimed', flush=True); time.sleep(600)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "claimed"
        with pytest.raises(DeviceBusyError, match="held by doomed"):
            claim_device(["cuda:0"], 0, owner="next", lock_dir=tmp_path, wait_s=0)
    finally:
        process.kill()  # SIGKILL: no clean-up code runs
        process.wait()
    with claim_device(["cuda:0"], 0, owner="next", lock_dir=tmp_path) as claim:
        assert claim.device == "cuda:0"


def test_cpu_runs_share_the_cpu(tmp_path):
    with (
        claim_device(["cpu"], 0, owner="a", lock_dir=tmp_path) as a,
        claim_device(["cpu"], 0, owner="b", lock_dir=tmp_path) as b,
    ):
        assert a.device == b.device == "cpu"
    assert not list(tmp_path.iterdir())
