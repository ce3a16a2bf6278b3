"""The production instance (deploy/dagster.yaml) on a real PostgreSQL server: two shards
materialized concurrently by two CLI processes, then the retry schedule against the same storage.

The server is a throwaway cluster started here on 127.0.0.1 (.ci/run installs PostgreSQL)."""

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, AssetPartitionStatus, DagsterInstance, build_schedule_context

from hsx_dagster.core.settings import load_settings
from hsx_dagster.definitions import build_definitions

REPO = Path(__file__).resolve().parents[1]


def pg_binary(name: str) -> str | None:
    found = shutil.which(name)
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found or (candidates[-1] if candidates else None)


@pytest.fixture(scope="module")
def postgres():
    initdb, pg_ctl = pg_binary("initdb"), pg_binary("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL server binaries not installed (.ci/run installs them)")
    # Outside pytest's private temp folder: the server runs as the postgres user, who cannot enter it.
    root = Path(tempfile.mkdtemp(prefix="hsx-pg-"))
    root.chmod(0o777)
    data = root / "data"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run([*as_user, initdb, "-D", str(data), "-U", "hsx", "--auth=trust"], check=True, capture_output=True)
    subprocess.run(
        [*as_user, pg_ctl, "-D", str(data), "-w", "-l", str(data.parent / "log"),
         "-o", f"-h 127.0.0.1 -p {port} -k {data.parent}", "start"],
        check=True, capture_output=True,
    )
    try:
        subprocess.run([pg_binary("createdb") or "createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "hsx", "dagster"], check=True)
        yield {"DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": str(port), "DAGSTER_PG_USER": "hsx",
               "DAGSTER_PG_PASSWORD": "", "DAGSTER_PG_DB": "dagster"}
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_two_shards_concurrently_then_the_schedule_on_postgres(postgres, tmp_path, small_inputs, demo_model_dir):
    settings_file = tmp_path / "hsx.yaml"
    settings_file.write_text(
        f"dataset:\n  paths: [{small_inputs}]\n  max_length: 512\nmodel:\n  path: {demo_model_dir}\n  layers: [1, 4]\n"
        f"shards: 2\noutput_dir: out\nextraction:\n  devices: [cpu]\n  batch_size: 8\n"
    )
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO / "deploy" / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, **postgres, "DAGSTER_HOME": str(home), "HSX_CONFIG": str(settings_file)}
    dagster = str(Path(sys.executable).with_name("dagster"))
    module = ["asset", "materialize", "-m", "hsx_dagster.definitions"]
    first = subprocess.run([dagster, *module, "--select", "tokenized_dataset"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    shards = [
        subprocess.Popen([dagster, *module, "--select", "hidden_states", "--partition", shard], cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for shard in ("shard-00", "shard-01")
    ]
    for process in shards:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]

    os.environ.update(postgres)
    try:
        with DagsterInstance.from_config(str(home)) as instance:
            assert "Postgres" in type(instance.run_storage).__name__
            settings = load_settings(settings_file)
            defs = build_definitions(settings)
            statuses = instance.get_status_by_partition(AssetKey("hidden_states"), ["shard-00", "shard-01"], defs.resolve_assets_def("hidden_states").partitions_def)
            assert statuses == {"shard-00": AssetPartitionStatus.MATERIALIZED, "shard-01": AssetPartitionStatus.MATERIALIZED}
            schedule = defs.resolve_schedule_def("retry_failed_shards")
            tick = schedule.evaluate_tick(build_schedule_context(instance=instance, repository_def=defs.get_repository_def()))
            assert tick.skip_message == "no failed hidden_states shard"
    finally:
        for key in postgres:
            os.environ.pop(key, None)
    assert yaml.safe_load((home / "dagster.yaml").read_text())["run_retries"]["retry_on_asset_or_op_failure"] is False
