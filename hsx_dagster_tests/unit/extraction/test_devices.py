"""One run per GPU: claims, preference for the shard's own device, waiting, and release on death."""

import errno
import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from hsx_dagster.core.extraction import (
    DeviceBusyError,
    DeviceClaimError,
    candidate_devices,
    claim_device,
    claim_scheduled_device,
    devices,
    physical_gpu_id,
)

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
        DeviceBusyError,
        match=r"no free device among cuda:1, cuda:0.*"
        r"cuda:1 \(\S+-gpu1\): held by run A.*cuda:0 \(\S+-gpu0\): held by run B",
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


# --- under a scheduler: claims keyed by the physical GPU -------------------------------------


def test_runs_that_each_see_cuda_0_claim_their_own_physical_gpu(tmp_path):
    """Ray, Kubernetes and Slurm give each run one GPU and set CUDA_VISIBLE_DEVICES: every run sees `cuda:0`.
    Keyed by the GPU's UUID, two such runs on one node (or on a shared lock folder) do not collide."""
    first = claim_device(["cuda:0"], 0, owner="run A", lock_dir=tmp_path, physical_id=lambda d: "GPU-1111aaaa")
    second = claim_device(["cuda:0"], 0, owner="run B", lock_dir=tmp_path, physical_id=lambda d: "GPU-2222bbbb")
    assert first.device == second.device == "cuda:0"
    assert "GPU-1111aaaa" in first.how and "GPU-2222bbbb" in second.how
    # a third run given the first one's GPU (a scheduler that double-books, or a run started by hand) waits
    with pytest.raises(DeviceBusyError, match=r"cuda:0 \(GPU-1111aaaa\): held by run A"):
        claim_device(["cuda:0"], 0, owner="run C", lock_dir=tmp_path, physical_id=lambda d: "GPU-1111aaaa")
    first.release()
    second.release()


def test_the_physical_id_comes_from_the_uuid_else_from_cuda_visible_devices():
    assert physical_gpu_id(0, uuid_of=lambda i: "GPU-abcd", visible="3") == "GPU-abcd"
    no_uuid = lambda i: None  # noqa: E731 (a driver that cannot tell)
    # CUDA_VISIBLE_DEVICES names the physical GPU at each visible position: index 0 of "3,1" is GPU 3 of the host
    assert physical_gpu_id(0, uuid_of=no_uuid, visible="3,1", host="node-a") == "node-a-gpu3"
    assert physical_gpu_id(1, uuid_of=no_uuid, visible="3,1", host="node-a") == "node-a-gpu1"
    assert physical_gpu_id(0, uuid_of=no_uuid, visible="GPU-77ef,GPU-88ab", host="node-a") == "GPU-77ef"
    assert physical_gpu_id(2, uuid_of=no_uuid, visible="", host="node-b") == "node-b-gpu2"


def test_two_scheduled_runs_without_uuids_are_told_apart_by_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "gpu_uuid", lambda index: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    first = claim_device(["cuda:0"], 0, owner="run A", lock_dir=tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    second = claim_device(["cuda:0"], 0, owner="run B", lock_dir=tmp_path)
    assert "CUDA_VISIBLE_DEVICES=0 set by the scheduler" in first.how
    assert "CUDA_VISIBLE_DEVICES=1 set by the scheduler" in second.how
    first.release()
    second.release()


def test_scheduler_claims_take_no_lock_and_say_so(tmp_path):
    claim = claim_scheduled_device(["cuda:0"], 0, visible="GPU-1111aaaa")
    assert claim.device == "cuda:0" and claim._lock is None
    assert claim.how.startswith("none: CUDA_VISIBLE_DEVICES=GPU-1111aaaa set by the scheduler")
    with pytest.raises(DeviceClaimError, match=r"CUDA_VISIBLE_DEVICES is not set.*extraction\.device_claim: lock"):
        claim_scheduled_device(["cuda:0"], 0, visible="")


@pytest.mark.parametrize("refusal", [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_lock_folder_that_refuses_flock_is_named_with_what_to_set(tmp_path, monkeypatch, refusal):
    """Lustre without -o flock answers ENOSYS; no such filesystem exists here, so flock is made to answer it."""
    real_flock = fcntl.flock

    def refusing_flock(handle, operation):
        if operation & fcntl.LOCK_EX:
            raise OSError(refusal, os.strerror(refusal))
        return real_flock(handle, operation)

    monkeypatch.setattr(fcntl, "flock", refusing_flock)
    with pytest.raises(DeviceClaimError) as caught:
        claim_device(["cuda:0"], 0, owner="run A", lock_dir=tmp_path / "locks", physical_id=lambda d: "GPU-1")
    message = str(caught.value)
    assert str(tmp_path / "locks") in message and "refuses flock" in message
    assert "extraction.device_lock_dir" in message and "extraction.device_claim: scheduler" in message


def test_a_shard_run_fails_on_a_refused_lock_before_the_model_loads(tmp_path, monkeypatch, tokenized, demo_model_dir):
    """The whole shard run: the claim comes before the shard folder is opened and before any weight is read."""
    from hsx_dagster.core.extraction import shard_run
    from hsx_dagster_tests.support.helpers import shard_job

    monkeypatch.setattr(devices, "candidate_devices", lambda names, count: ["cuda:0"])
    monkeypatch.setattr(devices, "visible_gpus", lambda: 1)

    def refusing_flock(handle, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", refusing_flock)
    loaded = []
    monkeypatch.setattr(shard_run, "load_backbone", lambda *a, **k: loaded.append(a))
    job = shard_job(
        shard="shard-00",
        shard_index=0,
        tokenized_dir=tokenized,
        output_dir=tmp_path / "out" / "hidden_states" / "shard-00",
        model_path=demo_model_dir,
        layer_ids=[1, 2],
        device_lock_dir=tmp_path / "lustre-locks",
    )
    with pytest.raises(DeviceClaimError, match="lustre-locks is on a filesystem that refuses flock"):
        shard_run.run_shard(job)
    assert loaded == [] and not (tmp_path / "out").exists()
