"""The UI: the webserver on 127.0.0.1 serves the three assets, the shard partitions, the checks and
the sensors, read through its GraphQL API as the UI reads them; and the way in from other machines,
deploy/proxy/hsx-dagster.conf (nginx: TLS and a login), lets in only a request with credentials."""

import base64
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
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


@pytest.fixture(scope="module")
def webserver(tmp_path_factory):
    """The webserver on 127.0.0.1 and a free port, once it answers; its port."""
    home = tmp_path_factory.mktemp("home")
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "HSX_SHARDS": "3"}
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    command = str(Path(sys.executable).with_name("dagster-webserver"))
    process = subprocess.Popen(
        [command, "-h", "127.0.0.1", "-p", str(port), "-m", "hsx_dagster.definitions"],
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
                graphql(f"http://127.0.0.1:{port}")
                break
            except OSError:
                assert time.monotonic() < deadline, "webserver did not answer within 120 s"
                time.sleep(1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


def graphql(url: str, headers: dict | None = None, context: ssl.SSLContext | None = None) -> dict:
    request = urllib.request.Request(
        f"{url}/graphql",
        data=json.dumps({"query": QUERY}).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return json.loads(response.read())["data"]


def test_webserver_graphql_shows_assets_partitions_checks_and_the_retry_sensor(webserver):
    data = graphql(f"http://127.0.0.1:{webserver}")
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


def test_the_proxy_asks_for_a_login_over_tls_and_passes_a_request_that_has_one(webserver, tmp_path):
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if nginx is None:  # in CI a missing nginx fails the test instead of skipping it
        (pytest.fail if os.environ.get("HSX_PROXY_TEST") == "required" else pytest.skip)(
            "nginx is not installed (.ci/run installs nginx-light)"
        )
    port = free_port()
    certificate = ["-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"]
    files = ["-keyout", str(tmp_path / "tls.key"), "-out", str(tmp_path / "tls.crt")]
    openssl_req = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    subprocess.run([*openssl_req, *certificate, *files], check=True, capture_output=True)
    hashed = subprocess.run(
        ["openssl", "passwd", "-6", "-stdin"], input="s3cret-watcher\n", check=True, capture_output=True, text=True
    )
    (tmp_path / "htpasswd").write_text(f"alice:{hashed.stdout.strip()}\n")
    # the profile as shipped, its machine-specific places replaced by this test's
    site = (REPO / "deploy" / "proxy" / "hsx-dagster.conf").read_text()
    for shipped, here in {
        "listen 443 ssl;": f"listen 127.0.0.1:{port} ssl;",
        "http://127.0.0.1:3000": f"http://127.0.0.1:{webserver}",
        "/etc/hsx-dagster/": f"{tmp_path}/",
    }.items():
        assert shipped in site
        site = site.replace(shipped, here)
    (tmp_path / "site.conf").write_text(site)
    (tmp_path / "nginx.conf").write_text(
        f"""daemon off;
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log;
{"user root;" if os.geteuid() == 0 else ""}
events {{}}
http {{
    access_log {tmp_path}/access.log;
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
    include {tmp_path}/site.conf;
}}
"""
    )
    proxy = subprocess.Popen(
        [nginx, "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(tmp_path / "nginx.conf")],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    trusted = ssl.create_default_context(cafile=str(tmp_path / "tls.crt"))
    url = f"https://127.0.0.1:{port}"
    login = {"Authorization": "Basic " + base64.b64encode(b"alice:s3cret-watcher").decode()}
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proxy.poll() is None, proxy.stderr.read()
            try:
                data = graphql(url, login, trusted)
                break
            except (ConnectionError, urllib.error.URLError) as error:
                if isinstance(error, urllib.error.HTTPError):
                    raise
                assert time.monotonic() < deadline, f"nginx did not answer within 30 s: {error}"
                time.sleep(0.2)
        assert "hidden_states" in {"/".join(n["assetKey"]["path"]) for n in data["assetNodes"]}
        wrong = {"Authorization": "Basic " + base64.b64encode(b"alice:guess").decode()}
        for headers in ({}, wrong):
            with pytest.raises(urllib.error.HTTPError) as refused:
                graphql(url, headers, trusted)
            assert refused.value.code == 401 and "Basic" in refused.value.headers["WWW-Authenticate"]
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # TLS, not plain HTTP
            graphql(url, login, ssl.create_default_context())
    finally:
        os.kill(proxy.pid, signal.SIGQUIT)  # nginx's graceful stop: the master ends its workers
        proxy.wait(timeout=30)
