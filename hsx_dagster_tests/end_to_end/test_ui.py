"""The UI: the webserver on 127.0.0.1 serves the three assets, the shard partitions, the checks and
the sensors, read through its GraphQL API as the UI reads them."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hsx_dagster_tests.support.helpers import free_port
from hsx_dagster_tests.support.paths import REPO

pytestmark = pytest.mark.slow  # servers, subprocesses or kills: left out of the quick loop

QUERY = """{
  assetNodes { assetKey { path } partitionKeys assetChecksOrError { ... on AssetChecks { checks { name blocking } } } }
  repositoriesOrError {
    ... on RepositoryConnection { nodes { schedules { name } sensors { name minIntervalSeconds } } }
  }
}"""


def test_webserver_graphql_shows_assets_partitions_checks_and_the_retry_sensor(tmp_path):
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "HSX_SHARDS": "3"}
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    webserver = str(Path(sys.executable).with_name("dagster-webserver"))
    process = subprocess.Popen(
        [webserver, "-h", "127.0.0.1", "-p", str(port), "-m", "hsx_dagster.definitions"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read()[-3000:]
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/graphql",
                    data=json.dumps({"query": QUERY}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=10) as response:
                    data = json.loads(response.read())["data"]
                break
            except OSError:
                assert time.monotonic() < deadline, "webserver did not answer within 120 s"
                time.sleep(1)
    finally:
        process.terminate()
        process.wait(timeout=30)
    nodes = {"/".join(n["assetKey"]["path"]): n for n in data["assetNodes"]}
    assert set(nodes) == {
        *("conversations", "target_model", "tokenized_dataset", "hidden_states", "drafter_dataset"),
        *("speculators_dataset", "specforge_dataset"),  # the trainers' exports, materialized only when asked
    }
    assert nodes["hidden_states"]["partitionKeys"] == ["shard-00", "shard-01", "shard-02"]
    checks = {c["name"]: c["blocking"] for c in nodes["drafter_dataset"]["assetChecksOrError"]["checks"]}
    assert checks == {
        "drafter_coverage": True,
        "drafter_integrity": True,
        "drafter_numerics": True,
        "drafter_parity": True,
    }
    shard_checks = {c["name"]: c["blocking"] for c in nodes["hidden_states"]["assetChecksOrError"]["checks"]}
    assert shard_checks == {"shard_coverage": True, "shard_integrity": True, "shard_numerics": True}
    repositories = data["repositoriesOrError"]["nodes"]
    assert [s for repo in repositories for s in repo["schedules"]] == []
    sensors = {s["name"]: s["minIntervalSeconds"] for repo in repositories for s in repo["sensors"]}
    assert sensors["retry_failed_shards"] == 900  # operations.retry_every_s
