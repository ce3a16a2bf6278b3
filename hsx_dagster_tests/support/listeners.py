"""What a set of live processes listens on, and what each socket outside loopback answers a stranger.

For the security checks of the live tests (docs/security.md): a socket on 127.0.0.1 is out of a stranger's reach;
any other one is asked, without credentials, for ``GET /`` over plain HTTP, and its answer classified: `refused`
(401 or 403), `not-http` (a gRPC server such as Ray's GCS and raylets, which check the token themselves), `metrics`
(a Prometheus exporter's page) or `open` (anything else: the finding the tests exist to catch).
"""

from __future__ import annotations

import http.client
from dataclasses import dataclass

import psutil

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@dataclass(frozen=True)
class Listener:
    process: str
    ip: str
    port: int
    answer: str  # loopback, refused, not-http, metrics, open: ...


def listeners(pids: set[int]) -> list[Listener]:
    """Every TCP socket the processes ``pids`` listen on, each with what it answers a request without credentials."""
    found = []
    for connection in psutil.net_connections(kind="inet"):
        if connection.status != psutil.CONN_LISTEN or connection.pid not in pids:
            continue
        ip, port = connection.laddr.ip, connection.laddr.port
        try:
            name = psutil.Process(connection.pid).name()
        except psutil.Error:
            continue
        found.append(Listener(name, ip, port, "loopback" if ip in LOOPBACK else _answer(ip, port)))
    return found


def _answer(ip: str, port: int) -> str:
    # a wildcard address is reached through any interface; the loopback one stands for them all here
    host = "127.0.0.1" if ip in ("0.0.0.0", "::") else ip.removeprefix("::ffff:")
    connection = http.client.HTTPConnection(host, port, timeout=5)
    try:
        connection.request("GET", "/")
        response = connection.getresponse()
        body = response.read(200)
    except (http.client.HTTPException, ConnectionError):
        return "not-http"
    except OSError as error:
        return f"open: unreachable from here ({error})"
    finally:
        connection.close()
    if response.status in (401, 403):
        return "refused"
    if response.status == 200 and body.startswith(b"# HELP"):
        return "metrics"
    return f"open: HTTP {response.status} {body[:80]!r}"
