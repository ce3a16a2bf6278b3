"""Before a run is handed to a Ray cluster: this process can authenticate to it, and the cluster asks it to.

A Ray cluster without token authentication runs whatever anyone who reaches its dashboard port submits (the
ShadowRay attack, CVE-2023-48022), so a launch refuses one. Ray's clients (the job client dagster-ray's
`RayRunLauncher` uses) send the token only when ``RAY_AUTH_MODE=token`` is set, and read it from the file
``RAY_AUTH_TOKEN_PATH`` names (else ``~/.ray/auth_token``); the token itself never goes on a command line or in an
environment variable, where every child process and process listing would carry it (docs/security.md).

`ray_access_problem` answers what is wrong, in words that name the variable or file to set, or None when the
launch may go ahead; it asks the cluster twice (once without credentials, which must be refused, once with the
token, which must be let in) and changes nothing there.
"""

from __future__ import annotations

import os
import stat
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

SECURITY_DOC = "docs/security.md"
JOBS_API = "/api/jobs/"
TIMEOUT_S = 15.0


def token_file(environ: Mapping[str, str]) -> Path:
    """Where Ray's clients read the token: ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    named = environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(named).expanduser() if named else Path.home() / ".ray" / "auth_token"


def ray_access_problem(address: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """What stops this process from launching runs on the Ray cluster at ``address`` (its dashboard's URL), or
    None."""
    if not address:
        return "the Ray run launcher has no address: set DAGSTER_RAY_ADDRESS to the head's dashboard, e.g. http://ray-head:8265"
    token, problem = _token(environ)
    if token is None:
        return problem
    if not address.startswith(("http://", "https://")):
        return None  # a ray:// client address: the token goes over gRPC, which the cluster checks itself
    return _cluster_problem(address, token, token_file(environ))


def _token(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The token this process would send, or None and what is wrong with the way it is handed over."""
    if environ.get("RAY_AUTH_TOKEN"):
        return None, (
            "RAY_AUTH_TOKEN holds the Ray token in the environment, where every child process inherits it: unset it, "
            f"put the token in a file only you can read (chmod 600) and set RAY_AUTH_TOKEN_PATH to it ({SECURITY_DOC})"
        )
    if environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None, (
            "RAY_AUTH_MODE is not `token`, so no Ray token would be sent: set RAY_AUTH_MODE=token and "
            f"RAY_AUTH_TOKEN_PATH to the file holding the cluster's token ({SECURITY_DOC})"
        )
    path = token_file(environ)
    if not path.is_file():
        return None, (
            f"no Ray token at {path}: set RAY_AUTH_TOKEN_PATH to the file holding the cluster's token "
            f"(`ray get-auth-token --generate` creates one for a new cluster; {SECURITY_DOC})"
        )
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return (
            None,
            f"the Ray token {path} (RAY_AUTH_TOKEN_PATH) is readable by others (mode {mode:o}): chmod 600 {path}",
        )
    token = path.read_text(encoding="utf-8").strip()
    return (token, "") if token else (None, f"the Ray token file {path} (RAY_AUTH_TOKEN_PATH) is empty")


def _cluster_problem(address: str, token: str, path: Path) -> str | None:
    """The cluster must refuse a request without credentials and let this token in."""
    without = _status(address, {})
    if isinstance(without, str):
        return without
    if without < 400:
        return (
            f"the Ray cluster at {address} answers its Jobs API without a token (HTTP {without}): anyone who reaches "
            f"it can run code on every node. Start every node with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH "
            f"({SECURITY_DOC})"
        )
    with_token = _status(address, {"Authorization": f"Bearer {token}"})
    if isinstance(with_token, str):
        return with_token
    if with_token in (401, 403):
        return (
            f"the Ray cluster at {address} refuses the token in {path} (HTTP {with_token}): RAY_AUTH_TOKEN_PATH must "
            f"name the file the cluster's nodes were started with ({SECURITY_DOC})"
        )
    return f"the Ray cluster at {address} answers its Jobs API with HTTP {with_token}" if with_token >= 400 else None


def _status(address: str, headers: dict[str, str]) -> int | str:
    """The HTTP status of a GET of the Jobs API, or what stopped the request."""
    request = urllib.request.Request(address.rstrip("/") + JOBS_API, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        return f"cannot reach the Ray cluster's dashboard at {address} (DAGSTER_RAY_ADDRESS): {reason}"
