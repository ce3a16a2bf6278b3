"""The production instance (deploy/dagster.yaml) on a real PostgreSQL server: two shards
materialized concurrently by two CLI processes, then the retry sensor against the same storage.

The server is a throwaway cluster started here on 127.0.0.1 (.ci/run installs PostgreSQL), with a password
(scram-sha-256) as in production: the instance reads it from libpq's password file (PGPASSFILE), never from the
profile or the environment (docs/security.md)."""

import glob
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, AssetPartitionStatus, DagsterInstance, build_sensor_context

from hsx_dagster.core.settings import load_settings
from hsx_dagster.defs.build import build_definitions
from hsx_dagster.defs_support import pools
from hsx_dagster.defs_support.dagster_internals import pool_limits
from hsx_dagster.defs_support.pools import prepare_pool
from hsx_dagster_tests.support.dagster_internals import set_pool_limit
from hsx_dagster_tests.support.helpers import write_settings
from hsx_dagster_tests.support.paths import REPO

pytestmark = pytest.mark.slow  # servers, subprocesses or kills: left out of the quick loop


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
    password = secrets.token_urlsafe(24)
    # initdb (as the server's user) reads the superuser's password from a file, removed once it has
    password_file = root / "initdb-password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o644)
    try:
        subprocess.run(
            [*as_user, initdb, "-D", str(data), "-U", "hsx", "--auth=scram-sha-256", f"--pwfile={password_file}"],
            check=True,
            capture_output=True,
        )
    finally:
        password_file.unlink()
    pgpass = Path(tempfile.mkdtemp(prefix="hsx-pgpass-")) / "pgpass"  # private to this user, as libpq requires
    pgpass.write_text(f"127.0.0.1:{port}:*:hsx:{password}\n")
    pgpass.chmod(0o600)
    subprocess.run(
        [
            *as_user,
            pg_ctl,
            "-D",
            str(data),
            "-w",
            "-l",
            str(data.parent / "log"),
            "-o",
            f"-h 127.0.0.1 -p {port} -k {data.parent}",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    try:
        subprocess.run(
            [pg_binary("createdb") or "createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "hsx", "dagster"],
            env={**os.environ, "PGPASSFILE": str(pgpass)},
            check=True,
        )
        yield {
            "DAGSTER_PG_HOST": "127.0.0.1",
            "DAGSTER_PG_PORT": str(port),
            "DAGSTER_PG_USER": "hsx",
            "DAGSTER_PG_DB": "dagster",
            "PGPASSFILE": str(pgpass),
        }
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pgpass.parent, ignore_errors=True)


def pg_password(postgres_env: dict[str, str]) -> str:
    """The server's password, from the password file the fixture hands out (for tests that look for it in logs)."""
    return Path(postgres_env["PGPASSFILE"]).read_text().strip().rsplit(":", 1)[1]


def test_the_server_refuses_a_client_without_the_password(postgres):
    psql = pg_binary("psql") or "psql"
    connect = [
        psql,
        "-h",
        "127.0.0.1",
        "-p",
        postgres["DAGSTER_PG_PORT"],
        "-U",
        "hsx",
        "-d",
        "dagster",
        "-c",
        "select 1",
    ]
    without = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    refused = subprocess.run(connect, env={**without, "PGPASSWORD": "wrong"}, capture_output=True, text=True)
    assert refused.returncode != 0 and "password authentication failed" in refused.stderr
    assert (
        subprocess.run(connect, env={**without, "PGPASSFILE": postgres["PGPASSFILE"]}, capture_output=True).returncode
        == 0
    )


def test_two_shards_concurrently_then_the_retry_sensor_on_postgres(postgres, tmp_path, small_inputs, demo_model_dir):
    settings_file = write_settings(
        tmp_path / "hsx.yaml",
        dataset={"paths": [small_inputs], "max_length": 512},
        model={"path": demo_model_dir, "layers": [1, 4]},
        shards=2,
        output_dir="out",
        extraction={"devices": ["cpu"], "batch_size": 8},
    )
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO / "deploy" / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, **postgres, "DAGSTER_HOME": str(home), "HSX_CONFIG": str(settings_file)}
    dagster = str(Path(sys.executable).with_name("dagster"))
    module = ["asset", "materialize", "-m", "hsx_dagster.definitions"]
    first = subprocess.run(
        [dagster, *module, "--select", "tokenized_dataset"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    # The pool exists before the shards race to claim it (dagster-io/dagster#33552).
    assert "pool `gpu`: limit 8" in first.stderr
    shards = [
        subprocess.Popen(
            [dagster, *module, "--select", "hidden_states", "--partition", shard],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
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
            statuses = instance.get_status_by_partition(
                AssetKey("hidden_states"),
                ["shard-00", "shard-01"],
                defs.resolve_assets_def("hidden_states").partitions_def,
            )
            assert statuses == {
                "shard-00": AssetPartitionStatus.MATERIALIZED,
                "shard-01": AssetPartitionStatus.MATERIALIZED,
            }
            sensor = defs.resolve_sensor_def("retry_failed_shards")
            tick = sensor.evaluate_tick(
                build_sensor_context(instance=instance, repository_def=defs.get_repository_def())
            )
            assert tick.skip_message == "no failed hidden_states shard"
    finally:
        for key in postgres:
            os.environ.pop(key, None)
    assert yaml.safe_load((home / "dagster.yaml").read_text())["run_retries"]["retry_on_asset_or_op_failure"] is False


@pytest.fixture
def production_instance(postgres, tmp_path, monkeypatch):
    for key, value in postgres.items():
        monkeypatch.setenv(key, value)
    shutil.copy(REPO / "deploy" / "dagster.yaml", tmp_path / "dagster.yaml")
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        yield instance


def pool_rows(instance, pool):
    return [(limit.limit, limit.from_default) for limit in pool_limits(instance) if limit.name == pool]


def test_a_pool_is_prepared_once_when_processes_race_for_it(production_instance):
    barrier = threading.Barrier(6)
    limits, errors = [], []

    def prepare():
        barrier.wait()
        try:
            limits.append(prepare_pool(production_instance, logging.getLogger("race"), pool="race"))
        except Exception as error:  # collected, so the assertion below names it
            errors.append(error)

    threads = [threading.Thread(target=prepare) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and limits == [8] * 6
    assert pool_rows(production_instance, "race") == [(8, True)]


def test_the_process_that_loses_the_insert_reads_the_winners_row(production_instance, monkeypatch):
    log = logging.getLogger("race")
    assert prepare_pool(production_instance, log, pool="lost") == 8  # the winner
    read_pool = pools.pool_limit
    reads = []

    def missing_at_first_read(instance, pool):
        reads.append(pool)
        return None if len(reads) == 1 else read_pool(instance, pool)

    # The loser read "no row" just before the winner inserted it, then inserts it again.
    monkeypatch.setattr(pools, "pool_limit", missing_at_first_read)
    assert prepare_pool(production_instance, log, pool="lost") == 8
    assert pool_rows(production_instance, "lost") == [(8, True)]


def test_an_explicit_pool_limit_is_left_alone(production_instance):
    set_pool_limit(production_instance, "explicit", 3)
    assert prepare_pool(production_instance, logging.getLogger("pool"), pool="explicit") == 3
    assert pool_rows(production_instance, "explicit") == [(3, False)]
