"""A real two-node Ray cluster on this machine, for the live cluster test (test_ray_cluster.py).

Each node is `ray start --block` in its own session, on free ports and a private temp folder, with GPU slots
that need no GPU (Ray only counts them and sets CUDA_VISIBLE_DEVICES for each job it places). Every process a
node starts, however deep (raylet, workers, a job's driver and its children, even those Ray detaches into
their own session), inherits a marker in its environment; stopping or killing a node sends SIGKILL to exactly
the processes that carry its marker, by pid. Nothing else on the machine is touched (no `ray stop`).

The cluster runs with token authentication, as docs/security.md says: `RAY_AUTH_MODE=token` on every node and every
client, the token in a file only its owner reads (`RAY_AUTH_TOKEN_PATH`), never on a command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

MARK = "HSXTEST_RAY_NODE"  # not HSX_: that prefix is the settings' environment overrides
NODE_PORTS = (
    "node-manager-port",
    "object-manager-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
)
HEAD_PORTS = ("port", "dashboard-port", "ray-client-server-port")
# A lost node is noticed within about 3 s instead of Ray's default 15-30 s (the test waits for it).
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}


def free_ports(count: int) -> list[int]:
    sockets = []
    for _ in range(count):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        sockets.append(probe)
    ports = [probe.getsockname()[1] for probe in sockets]
    for probe in sockets:
        probe.close()
    return ports


def marked_pids(mark: str, session: int | None = None) -> list[int]:
    """Processes whose environment carries ``MARK=mark``, or that belong to the session ``session``: Ray's own
    processes rename themselves (``ray::IDLE``) over their environment, but keep the session of `ray start`; the
    processes it detaches into a session of their own (a job's driver) keep their environment."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            in_session = session is not None and _session_of(int(entry)) == session
            if in_session or needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found


def kill_marked(mark: str, session: int | None = None, timeout_s: float = 30.0) -> list[int]:
    """SIGKILL, by pid, every process `marked_pids` finds, until none is left; the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while pids := [pid for pid in marked_pids(mark, session) if not _is_zombie(pid)]:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += pids
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} ({mark}) survived SIGKILL")
        time.sleep(0.2)
    return sorted(set(killed))


def _session_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


@dataclass
class RayNode:
    name: str
    mark: str
    process: subprocess.Popen
    log: Path
    killed: bool = False

    def kill(self, timeout_s: float = 30.0) -> list[int]:
        """SIGKILL every process of this node, by pid, until none is left; the pids killed."""
        killed = kill_marked(self.mark, self.process.pid, timeout_s)
        self.process.wait(timeout=10)
        self.killed = True
        return killed


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@dataclass
class RayCluster:
    """A head and one worker node; `start`, then `stop` (always)."""

    root: Path
    bin_dir: Path
    gpus_per_node: int = 2
    cpus_per_node: int = 1
    nodes: list[RayNode] = field(default_factory=list)
    dashboard_port: int = 0
    gcs_port: int = 0

    @property
    def token_file(self) -> Path:
        return self.root.parent / "ray-auth-token"

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def environment(self) -> dict[str, str]:
        """What every node and every client of the cluster runs with: the token's file, never the token."""
        return {
            **{key: value for key, value in os.environ.items() if key != "RAY_AUTH_TOKEN"},
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ['PATH']}",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_file),
        }

    def start(self, timeout_s: float = 180.0) -> None:
        self.token_file.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(secrets.token_hex(32))
        ports = dict(zip(HEAD_PORTS, free_ports(len(HEAD_PORTS))))
        self.gcs_port, self.dashboard_port = ports["port"], ports["dashboard-port"]
        head_args = [
            "--head",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            f"--temp-dir={self.root}",
            f"--system-config={json.dumps(HEALTH_CHECKS)}",
            *(f"--{name}={port}" for name, port in ports.items()),
        ]
        self._start_node("head", head_args)
        self._wait(lambda: len(self.alive_nodes()) == 1, timeout_s, "the head node")
        self._start_node("worker", [f"--address=127.0.0.1:{self.gcs_port}"])
        self._wait(lambda: len(self.alive_nodes()) == 2, timeout_s, "the worker node")

    def _start_node(self, name: str, args: list[str]) -> None:
        mark = f"{name}-{uuid.uuid4().hex[:12]}"
        log = self.root.parent / f"ray-{name}.log"
        node_ports = [f"--{port_name}={port}" for port_name, port in zip(NODE_PORTS, free_ports(len(NODE_PORTS)))]
        command = [
            str(self.bin_dir / "ray"),
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.cpus_per_node}",
            f"--num-gpus={self.gpus_per_node}",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
            *node_ports,
            *args,
        ]
        with open(log, "w") as out:
            process = subprocess.Popen(
                command,
                env={**self.environment(), MARK: mark},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.nodes.append(RayNode(name, mark, process, log))

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready():
                    return
            except Exception:  # the dashboard is not up yet
                pass
            for node in self.nodes:
                if node.process.poll() is not None:
                    raise RuntimeError(f"Ray {node.name} exited: {node.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not join within {timeout_s:.0f} s")
            time.sleep(0.5)

    def node(self, name: str) -> RayNode:
        return next(node for node in self.nodes if node.name == name)

    def auth_headers(self) -> dict[str, str]:
        """This process's credentials, sent explicitly: its Ray library read RAY_AUTH_MODE when first imported."""
        return {"Authorization": f"Bearer {self.token}"}

    def job_client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard_url, headers=self.auth_headers())

    def _state(self, resource: str, **options) -> list:
        from ray.util.state import StateApiClient
        from ray.util.state.common import ListApiOptions, StateResource

        client = StateApiClient(self.dashboard_url, headers={"Content-Type": "application/json", **self.auth_headers()})
        return client.list(
            StateResource(resource), options=ListApiOptions(timeout=10, **options), raise_on_missing_output=False
        )

    def alive_nodes(self) -> list[dict]:
        """Ray's view of its nodes (state API): node_id, is_head_node, state, resources_total."""
        return [
            {"node_id": n.node_id, "is_head_node": n.is_head_node, "resources_total": n.resources_total}
            for n in self._state("nodes")
            if n.state == "ALIVE"
        ]

    def gpus_by_job(self) -> dict[str, float]:
        """Ray job submission id -> the GPUs Ray gave its driver (what its supervisor actor holds, per the state
        API: the resources the job asked for)."""
        prefix = "_ray_internal_job_actor_"
        actors = self._state("actors", filters=[("class_name", "=", "JobSupervisor")], detail=True, limit=1000)
        return {
            actor.name[len(prefix) :]: float((actor.required_resources or {}).get("GPU", 0))
            for actor in actors
            if actor.name and actor.name.startswith(prefix)
        }

    def stop(self) -> None:
        """Every process of every node, worker first; then the temp folder."""
        for node in reversed(self.nodes):
            if not node.killed:
                node.kill()
