"""Every documented profile as written (docs/security.md): no command binds a service to every interface, every UI
listens on loopback, every Ray cluster starts with token authentication, and no profile carries a secret. The live
tests run these profiles (test_ray_cluster.py, test_ui.py, test_postgres.py); this reads every place a user copies
a command or a profile from, including those no test can start (Slurm, KubeRay, Kubernetes)."""

import re

import pytest
import yaml

from hsx_dagster.defs_support.ray_access import ray_access_problem
from hsx_dagster_tests.support.paths import REPO

PROFILES = sorted((REPO / "deploy").rglob("*.y*ml")) + sorted((REPO / "deploy").rglob("*.conf"))
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "Makefile", REPO / ".ci" / "run"]
EVERY_INTERFACE = re.compile(r"(?<![\d.])0\.0\.0\.0(?![\d/])|--host[= ]::(?!\d)|-h ::(?!\d)")
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|API_KEY", re.IGNORECASE)


def lines_with(pattern: str) -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(REPO)), line.strip())
        for path in DOCS + PROFILES
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.search(pattern, line)
    ]


def test_no_documented_command_or_profile_binds_every_interface():
    found = [
        (str(path.relative_to(REPO)), line.strip())
        for path in DOCS + PROFILES
        for line in path.read_text(encoding="utf-8").splitlines()
        if EVERY_INTERFACE.search(line)
    ]
    assert found == []


def test_every_ui_command_listens_on_loopback():
    commands = lines_with(r"(dagster-webserver|dagster dev)( \$\(\w+\))? -[mhpfw] |ray start .*--head")
    assert len(commands) >= 5  # make ui, the cluster's webserver, the own-machines and Slurm heads, the watchers'
    for where, line in commands:
        if "ray start" in line:
            assert "--dashboard-host=127.0.0.1" in line, (where, line)
        else:
            assert re.search(r"-h 127\.0\.0\.1\b", line), (where, line)


def test_every_document_that_starts_ray_starts_it_with_token_authentication():
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        if re.search(r"^\s*(srun .*)?ray start", text, re.MULTILINE):
            assert "RAY_AUTH_MODE=token" in text and "RAY_AUTH_TOKEN_PATH=" in text, path
            assert "--auth=trust" not in text, path


def test_no_profile_holds_or_hands_on_a_secret():
    for path in (REPO / "deploy").rglob("*.y*ml"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(password|postgresqlPassword|token)\s*:", text, re.MULTILINE), path
    ray = yaml.safe_load((REPO / "deploy" / "ray" / "dagster.yaml").read_text())
    env_vars = ray["run_launcher"]["config"]["ray"]["env_vars"]
    assert "PGPASSFILE" in env_vars and [name for name in env_vars if SECRET_NAME.search(name)] == []
    for profile in ("dagster.yaml", "ray/dagster.yaml"):
        storage = yaml.safe_load((REPO / "deploy" / profile).read_text())["storage"]["postgres"]["postgres_db"]
        assert "password" not in storage  # libpq reads it from PGPASSFILE


def test_every_kuberay_container_authenticates_with_the_token_from_a_mounted_secret():
    cluster = yaml.safe_load((REPO / "deploy" / "kuberay" / "raycluster.yaml").read_text())["spec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]]
    pods += [group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    assert cluster["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for pod in pods:
        secrets = {volume["name"]: volume["secret"] for volume in pod["volumes"] if "secret" in volume}
        assert {secret["secretName"] for secret in secrets.values()} == {"ray-token", "hsx-pgpass"}
        assert all(secret["defaultMode"] == 0o400 for secret in secrets.values())
        for container in pod["containers"]:
            env = {entry["name"]: entry["value"] for entry in container["env"]}
            assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"].startswith("/etc/ray-token/")
            # files' names only: a variable named like a secret must name its file
            holding = [name for name in env if SECRET_NAME.search(name) and not name.endswith(("_PATH", "FILE"))]
            assert "PGPASSFILE" in env and holding == []
            mounted = {mount["name"] for mount in container["volumeMounts"]}
            assert set(secrets) <= mounted


def test_the_proxy_asks_for_a_login_over_tls_and_forwards_to_loopback_only():
    site = (REPO / "deploy" / "proxy" / "hsx-dagster.conf").read_text()
    assert re.search(r"^\s*listen \d+ ssl;", site, re.MULTILINE) and "auth_basic_user_file" in site
    assert re.findall(r"proxy_pass (\S+);", site) == ["http://127.0.0.1:3000"]


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({}, "RAY_AUTH_MODE is not `token`"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "abc"}, "unset it"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "{tmp}/nope"}, "no Ray token at {tmp}/nope"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "{tmp}/shared"}, "chmod 600 {tmp}/shared"),
        (
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "{tmp}/empty"},
            "{tmp}/empty (RAY_AUTH_TOKEN_PATH) is empty",
        ),
    ],
)
def test_a_launch_without_a_usable_token_is_refused_before_the_cluster_is_asked(tmp_path, environ, named):
    (tmp_path / "shared").write_text("0" * 64)
    (tmp_path / "shared").chmod(0o644)
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    environ = {key: value.format(tmp=tmp_path) for key, value in environ.items()}
    # the address is never asked: every one of these is known before a request
    problem = ray_access_problem("http://192.0.2.1:8265", environ)
    assert problem is not None and named.format(tmp=tmp_path) in problem
