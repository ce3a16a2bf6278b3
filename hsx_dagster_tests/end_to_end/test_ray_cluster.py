"""Shard runs on a live two-node Ray cluster through dagster-ray's RayRunLauncher (deploy/ray/), with a node
killed in the middle of a shard.

Real components only: a Ray head and a worker node started here (two GPU slots each: Ray counts them and sets
CUDA_VISIBLE_DEVICES, no GPU needed), a throwaway PostgreSQL server, the Ray profile's Dagster instance and its
daemon. Four shards of the demo are launched the way docs/cluster.md says; the test asserts where they ran, kills
the worker node while one of its shards has committed chunks but is not done, and follows the recovery: the run
fails, the retry sensor's backfill re-runs the shard on the head node, which resumes from its last committed
chunk; the daemon then assembles the dataset (its parity check with a GPU of its own). The assembled dataset must
hold exactly the samples of a single-machine run, and the chunks committed before the kill must be unchanged.

Security (docs/security.md), on the same cluster: it runs with token authentication and PostgreSQL with a password;
a job submitted without the token or with a wrong one is refused, and so is a launch without the token (before any
run exists); no process of the cluster or of Dagster answers a stranger outside loopback (Ray's gRPC ports check the
token themselves; its Prometheus exporters serve metrics only); and neither secret appears in any Ray job's
runtime environment, entrypoint or log, any Dagster run's tags, config or event log, or the processes' logs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, DagsterInstance, DagsterRunStatus, RunsFilter

from hsx_dagster.core.dataset import DrafterDataset, assemble
from hsx_dagster.core.extraction import ShardJob, run_shard
from hsx_dagster.core.settings import load_settings
from hsx_dagster.core.storage import COMPLETE_FILE, SHARD_INDEX_FILE, read_index
from hsx_dagster_tests.end_to_end.test_postgres import pg_password, postgres  # noqa: F401 (the server fixture)
from hsx_dagster_tests.support.helpers import write_settings
from hsx_dagster_tests.support.listeners import listeners
from hsx_dagster_tests.support.paths import REPO
from hsx_dagster_tests.support.ray_cluster import MARK, RayCluster, kill_marked, marked_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ray_jobs = pytest.importorskip("ray.job_submission", reason="the ray extra: pip install -e '.[ray]'")
pytest.importorskip("dagster_ray", reason="the ray extra: pip install -e '.[ray]'")

BIN = Path(sys.executable).parent
SHARDS = ["shard-00", "shard-01", "shard-02", "shard-03"]
HIDDEN_STATES = AssetKey("hidden_states")


@pytest.fixture(scope="module")
def ray_cluster():
    root = Path(tempfile.mkdtemp(prefix="hsxray-"))  # short: Ray's socket paths live under it
    cluster = RayCluster(root / "ray", BIN)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def demo_subset(demo_conversations, tmp_path) -> Path:
    """120 demo conversations of every length but the longest tail, as JSONL: 30 per shard."""
    ordered = sorted(demo_conversations, key=lambda c: sum(len(m.content) for m in c.messages))[:-200]
    picked = [ordered[int(i * (len(ordered) - 1) / 119)] for i in range(120)]
    path = tmp_path / "demo-subset.jsonl"
    path.write_text("".join(json.dumps({"messages": c.as_chat()}) + "\n" for c in picked))
    return path


def test_four_shards_on_two_ray_nodes_survive_a_node_kill(ray_cluster, postgres, demo_subset, demo_model_dir, tmp_path):  # noqa: F811
    settings_file = write_settings(
        tmp_path / "hsx.yaml",
        dataset={"paths": [demo_subset], "max_length": 1024},
        model={"path": demo_model_dir},
        shards=4,
        output_dir="shared",  # every node mounts it (here: one machine)
        # one sample per pass: the local run batches the same way, so its states are bit for bit the cluster's;
        # small chunks: a shard commits many, so the kill lands between two
        extraction={"batch_size": 1, "max_batch_tokens": 4096, "chunk_mb": 0.25},
        operations={"ray_run_config": REPO / "deploy" / "ray" / "shard-run-config.yaml", "retry_every_s": 30},
        drafter={"parity_samples": 2},
    )
    home = tmp_path / "dagster_home"
    home.mkdir()
    profile = yaml.safe_load((REPO / "deploy" / "ray" / "dagster.yaml").read_text())
    profile["run_monitoring"]["poll_interval_seconds"] = 2  # the profile's 30 s, shortened for the test
    (home / "dagster.yaml").write_text(yaml.safe_dump(profile))
    env = {
        **ray_cluster.environment(),  # RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH: the token's file
        **postgres,  # PGPASSFILE: the database's password in libpq's file
        "DAGSTER_HOME": str(home),
        "HSX_CONFIG": str(settings_file),
        "DAGSTER_RAY_ADDRESS": ray_cluster.dashboard_url,
    }
    module = ["-m", "hsx_dagster.definitions"]
    mark = f"dagster-{os.getpid()}"  # the daemon, the launch and their code servers: stopped by pid at the end
    started = []
    try:
        # as docs/cluster.md says: the daemon, the tokenized dataset here, then every shard through Ray at once
        daemon = start_marked([str(BIN / "dagster-daemon"), "run", *module], {**env, MARK: mark}, tmp_path, "daemon")
        started.append(daemon)
        tokenize = subprocess.run(
            [str(BIN / "dagster"), "asset", "materialize", *module, "--select", "tokenized_dataset"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert tokenize.returncode == 0, tokenize.stderr[-3000:]
        client = ray_cluster.job_client()
        os.environ.update(postgres)  # this process's instance: the run storage the launch would have written to
        check_strangers_are_refused(ray_cluster, client, env, tmp_path)
        launch = start_marked(
            [sys.executable, "-m", "hsx_dagster.launch", "--together", *SHARDS], {**env, MARK: mark}, tmp_path, "launch"
        )
        started.append(launch)
        settings = load_settings(settings_file)
        nodes = {node["node_id"]: ("head" if node["is_head_node"] else "worker") for node in ray_cluster.alive_nodes()}
        with DagsterInstance.from_config(str(home)) as instance:
            check_no_open_listener(ray_cluster, client, mark)
            killed = kill_the_worker_mid_shard(ray_cluster, client, instance, settings, nodes)
            assert launch.wait(timeout=600) == 1  # the shards of the killed node failed (and are named)
            first_runs = ray_runs(ray_cluster, client, instance, nodes)
            local = extract_locally(settings, tmp_path / "local")  # while the daemon's sensors wait for their tick
            wait_for_recovery(instance, tmp_path)
            check_placement(first_runs, instance, killed)
            check_recovery(ray_cluster, client, instance, nodes, settings, killed)
            check_same_samples(settings.drafter_dir, local)
            check_no_secret_shown([pg_password(postgres), ray_cluster.token], ray_cluster, client, instance, tmp_path)
    finally:
        for process in started:
            kill_marked(mark, process.pid)
            process.wait(timeout=30)
        for key in postgres:
            os.environ.pop(key, None)


def check_strangers_are_refused(cluster: RayCluster, client, env: dict, folder: Path) -> None:
    """A job submitted without the token, or with a wrong one, is refused; so is a launch without the token or
    with a wrong one, before any run exists, naming what to set."""
    import urllib.error
    import urllib.request

    wrong = folder / "wrong-token"
    wrong.write_text("0" * 64)
    wrong.chmod(0o600)
    job = json.dumps({"entrypoint": "echo anyone can run code here"}).encode()
    for headers, status in (({}, 401), ({"Authorization": "Bearer " + "0" * 64}, 403)):
        request = urllib.request.Request(f"{cluster.dashboard_url}/api/jobs/", data=job, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == status
    assert client.list_jobs() == []
    launch = [sys.executable, "-m", "hsx_dagster.launch", "shard-00"]
    without_token = {key: value for key, value in env.items() if not key.startswith("RAY_AUTH")}
    for environment, named in (
        (without_token, "RAY_AUTH_MODE"),
        ({**env, "RAY_AUTH_TOKEN_PATH": str(wrong)}, "refuses"),
    ):
        refused_launch = subprocess.run(
            launch, env=environment, cwd=folder, capture_output=True, text=True, timeout=300
        )
        assert refused_launch.returncode == 2 and "nothing launched" in refused_launch.stderr, refused_launch.stderr
        assert named in refused_launch.stderr and "RAY_AUTH_TOKEN_PATH" in refused_launch.stderr
    assert client.list_jobs() == []
    with DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        assert instance.get_runs(RunsFilter(job_name="hidden_states_shard")) == []


def check_no_open_listener(cluster: RayCluster, client, mark: str) -> None:
    """Once shard runs are running: no process of the cluster or of Dagster (the daemon, the launch, their code
    servers, the runs' workers) answers outside loopback without credentials."""
    deadline = time.monotonic() + 300
    while not any(job.status == ray_jobs.JobStatus.RUNNING for job in client.list_jobs()):
        assert time.monotonic() < deadline, "no shard run started"
        time.sleep(0.2)
    pids = {pid for node in cluster.nodes for pid in marked_pids(node.mark, node.process.pid)}
    pids |= set(marked_pids(mark))
    found = listeners(pids)
    assert len(found) > 5, found  # the dashboard, GCS, raylets, agents...
    assert [listener for listener in found if listener.answer.startswith("open")] == []


def check_no_secret_shown(secrets: list[str], cluster: RayCluster, client, instance, folder: Path) -> None:
    """Neither secret in any Ray job (runtime environment, entrypoint, metadata, log), any Dagster run (tags,
    config, event log), the launch's and the daemon's output, or any log Ray wrote."""
    from dagster import serialize_value

    shown = {}
    alive = {node["node_id"] for node in cluster.alive_nodes()}
    for job in client.list_jobs():
        shown[f"Ray job {job.submission_id}"] = json.dumps(job.dict(), default=str)
        try:
            shown[f"Ray job {job.submission_id}'s log"] = client.get_job_logs(job.submission_id)
        except RuntimeError:  # its driver ran on the killed node, whose agent served its log
            assert job.driver_node_id not in alive, job
    for run in instance.get_runs():
        shown[f"run {run.run_id}'s tags and config"] = json.dumps([run.tags, run.run_config], default=str)
        shown[f"run {run.run_id}'s event log"] = "\n".join(
            serialize_value(entry) for entry in instance.all_logs(run.run_id)
        )
    # the launch's and the daemon's output, every run's stdout and stderr (compute logs), every log Ray wrote
    for root in (folder, cluster.root):
        for log in (path for pattern in ("*.log", "*.out", "*.err") for path in root.rglob(pattern)):
            shown[str(log)] = log.read_text(errors="replace")
    assert len(shown) > 20 and any("dagster-run-" in text for text in shown.values())
    leaks = [where for where, text in shown.items() for secret in secrets if secret in text]
    assert leaks == []


def start_marked(command: list[str], env: dict, folder: Path, name: str) -> subprocess.Popen:
    """A process in a session of its own, its output in ``folder/name.log``."""
    with open(folder / f"{name}.log", "w") as log:
        return subprocess.Popen(
            command, env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def kill_the_worker_mid_shard(cluster: RayCluster, client, instance, settings, nodes) -> dict:
    """Wait until a shard running on the worker node has committed chunks and is not done; kill the node; what its
    shard had committed then (chunk -> sha256, from the index)."""
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        for job in client.list_jobs():
            if job.status != ray_jobs.JobStatus.RUNNING or nodes.get(job.driver_node_id) != "worker":
                continue
            run = instance.get_run_by_id((job.metadata or {}).get("dagster/run-id", ""))
            shard = run.tags.get("dagster/partition") if run else None
            if shard is None:
                continue
            folder = settings.shard_dir(shard)
            if (
                (folder / SHARD_INDEX_FILE).exists()
                and len(read_index(folder)) >= 2
                and not (folder / COMPLETE_FILE).exists()
            ):
                cluster.node("worker").kill()
                records = read_index(folder)  # read after the kill: nothing writes any more
                committed = {r.chunk: hashlib.sha256((folder / r.chunk).read_bytes()).hexdigest() for r in records}
                assert all(committed[r.chunk] == r.sha256 for r in records)
                samples = sum(r.samples for r in records)
                return {"shard": shard, "run_id": run.run_id, "chunks": committed, "samples": samples}
        time.sleep(0.05)
    raise AssertionError("no shard on the worker node was caught between two committed chunks")


def ray_runs(cluster: RayCluster, client, instance, nodes) -> dict[str, dict]:
    """Dagster run id -> where Ray ran it: node, GPUs Ray gave it, the shard, and the GPU the run saw."""
    runs = {}
    gpus = cluster.gpus_by_job()
    for job in client.list_jobs():
        run_id = (job.metadata or {}).get("dagster/run-id")
        if run_id is None:
            continue
        run = instance.get_run_by_id(run_id)
        runs[run_id] = {
            "node": nodes.get(job.driver_node_id),
            "gpus": gpus.get(job.submission_id),
            "shard": run.tags.get("dagster/partition"),
            "visible": scheduler_gpu(instance, run_id),
            "status": run.status,
            "retry": run.tags.get("hsx/retry") == "true",
        }
    return runs


def scheduler_gpu(instance, run_id: str) -> str | None:
    """The CUDA_VISIBLE_DEVICES a shard run reported with its device claim (None: no GPU was given)."""
    for entry in instance.all_logs(run_id):
        message = entry.user_message or ""
        if "claim:" in message and "CUDA_VISIBLE_DEVICES=" in message:
            return message.split("CUDA_VISIBLE_DEVICES=", 1)[1].split()[0]
    return None


def extract_locally(settings, out: Path) -> Path:
    """The single-machine run: every shard from the same tokenized dataset, in this process, one thread (as each
    Ray job runs), assembled; its drafter folder."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for shard in SHARDS:
            job = ShardJob.from_settings(settings, shard)
            run_shard(replace(job, output_dir=out / "hidden_states" / shard))
    finally:
        torch.set_num_threads(threads)
    assemble(
        settings.tokenized_dir,
        out / "hidden_states",
        SHARDS,
        out / "drafter",
        val_fraction=settings.drafter.val_fraction,
        settings={"local": True},
    )
    return out / "drafter"


def wait_for_recovery(instance, tmp_path: Path) -> None:
    """Every shard materialized and drafter_dataset assembled by the daemon, its run (and checks) done."""
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        drafter = instance.fetch_materializations(AssetKey("drafter_dataset"), limit=1).records
        run = instance.get_run_by_id(drafter[0].event_log_entry.run_id) if drafter else None
        if run is not None and run.is_finished:
            assert run.status == DagsterRunStatus.SUCCESS, f"drafter_dataset's run {run.run_id}: {run.status}"
            return
        time.sleep(1)
    daemon_log = (tmp_path / "daemon.log").read_text()[-4000:]
    raise AssertionError(f"the daemon did not retry the shard and assemble the dataset in time:\n{daemon_log}")


def check_placement(first_runs: dict[str, dict], instance, killed: dict) -> None:
    # the four launched together (on a loaded machine the sensor's retries may already be among them)
    shard_runs = [run for run in first_runs.values() if run["shard"] and not run["retry"]]
    assert sorted(run["shard"] for run in shard_runs) == SHARDS
    assert all(run["gpus"] == 1 for run in shard_runs)
    by_node: dict[str, list[str]] = {}
    for run in shard_runs:
        by_node.setdefault(run["node"], []).append(run["visible"])
    # both nodes, each shard on a GPU of its own: the two GPUs of each node once each
    assert {node: sorted(gpus) for node, gpus in by_node.items()} == {"head": ["0", "1"], "worker": ["0", "1"]}
    assert instance.get_run_by_id(killed["run_id"]).status == DagsterRunStatus.FAILURE


def check_recovery(cluster: RayCluster, client, instance, nodes, settings, killed: dict) -> None:
    shard = killed["shard"]
    runs = ray_runs(cluster, client, instance, nodes)
    retries = [r for rid, r in runs.items() if r["shard"] == shard and rid != killed["run_id"]]
    assert retries and all(r["node"] == "head" for r in retries)  # the node that remains
    retry_runs = instance.get_runs(RunsFilter(tags={"dagster/partition": shard, "hsx/retry": "true"}))
    assert len(retry_runs) == 1 and retry_runs[0].status == DagsterRunStatus.SUCCESS
    materialization = instance.fetch_materializations(HIDDEN_STATES, limit=20).records
    (latest,) = [
        r.asset_materialization
        for r in materialization
        if r.asset_materialization.partition == shard and r.event_log_entry.run_id == retry_runs[0].run_id
    ]
    meta = {key: value.value for key, value in latest.metadata.items()}
    # resumed: every sample committed before the kill kept, none extracted again
    assert meta["samples_resumed"] == killed["samples"]
    folder = settings.shard_dir(shard)
    records = {r.chunk: r for r in read_index(folder)}
    assert meta["samples_this_run"] + meta["samples_resumed"] == sum(r.samples for r in records.values())
    for chunk, digest in killed["chunks"].items():  # byte-identical
        assert chunk in records and hashlib.sha256((folder / chunk).read_bytes()).hexdigest() == digest
    drafter_runs = [r for r in runs.values() if r["shard"] is None and r["status"] == DagsterRunStatus.SUCCESS]
    assert drafter_runs and all(r["gpus"] == 1 for r in drafter_runs)  # the parity check's GPU


def check_same_samples(cluster_drafter: Path, local_drafter: Path) -> None:
    import torch

    cluster, local = DrafterDataset(cluster_drafter), DrafterDataset(local_drafter)
    assert sorted(cluster.sample_ids) == sorted(local.sample_ids) and len(cluster) > 100
    where = {sample_id: i for i, sample_id in enumerate(local.sample_ids)}
    for index in range(len(cluster)):
        ours, theirs = cluster[index], local[where[cluster.sample_ids[index]]]
        assert ours.keys() == theirs.keys() and {"input_ids", "loss_mask", "hidden_states"} <= ours.keys()
        for key, value in ours.items():
            same = torch.equal(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key]
            assert same, (ours["sample_id"], key)
