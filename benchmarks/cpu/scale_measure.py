"""Wall time, CPU time and peak memory of a command and of every process it starts, as the kernel counts them.

The measuring process makes itself a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), so a process that a
Dagster command starts and leaves behind (a run worker launched through a code server, a step process) is
re-parented here instead of to init: every descendant is reaped here or by its own parent, and ``wait4`` gives
each one's CPU seconds. A sampler thread reads ``/proc`` every ``SAMPLE_S``: each process's command line (to name
Dagster's step processes), its high-water mark (``VmHWM``) and the sum of the tree's resident memory.

A process's peak RSS is its sampled ``VmHWM``; ``ru_maxrss`` only for a process gone before its first sample. The
kernel folds into ``ru_maxrss`` the memory of the process that forked it, as it stood at the fork (the old address
space's high-water mark is kept at exec): a step started by a 800 MB parent would read 800 MB whatever it used.
``VmHWM`` belongs to the address space the program runs in. For the same reason the measuring script stays small.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
SAMPLE_S = 0.2
LINGER_S = 30.0  # how long descendants may outlive the command before they are ended


def become_subreaper() -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class ProcessFigures:
    pid: int
    command: str
    peak_rss_bytes: int
    cpu_s: float


@dataclass
class Measured:
    argv: list[str]
    returncode: int
    wall_s: float
    cpu_s: float  # user + system of the command and every descendant
    peak_rss_bytes: int  # the largest single process (its VmHWM)
    peak_tree_rss_bytes: int  # the largest sum of the tree's resident memory seen by the sampler
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    others_cores: float | None  # cores other processes kept busy meanwhile (/proc/stat minus this tree)
    processes: list[ProcessFigures] = field(default_factory=list)
    output_tail: str = ""


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        found: list[int] = []
        for task in tasks:
            found += [int(c) for c in (task / "children").read_text().split()]
        return found
    except OSError:
        return []


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class _Sampler(threading.Thread):
    """Every SAMPLE_S: the descendants of this process, their command lines and high-water marks, the tree's RSS."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.commands: dict[int, str] = {}
        self.hwm_kib: dict[int, int] = {}
        self.peak_tree_kib = 0

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            tree, todo = [], _children(me)
            while todo:
                pid = todo.pop()
                tree.append(pid)
                todo += _children(pid)
            total = 0
            for pid in tree:
                command = _command(pid)  # read again: a forked child execs after its first sample
                if command:
                    self.commands[pid] = command
                self.hwm_kib[pid] = max(self.hwm_kib.get(pid, 0), _status_kib(pid, "VmHWM"))
                total += _status_kib(pid, "VmRSS")
            self.peak_tree_kib = max(self.peak_tree_kib, total)
            self.stop.wait(SAMPLE_S)


def _busy_cpu_s() -> float | None:
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_measured(argv: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> Measured:
    """Run ``argv`` to its end (output to ``log``) and every descendant it leaves behind, measured."""
    become_subreaper()
    load_before, busy_before = os.getloadavg(), _busy_cpu_s()
    sampler = _Sampler()
    sampler.start()
    started = time.perf_counter()
    with log.open("wb") as out:
        child = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    reaped: dict[int, tuple[int, object]] = {}
    returncode, ended = None, None
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG if ended is not None else 0)
        except ChildProcessError:
            break
        if pid == 0:  # descendants still running after the command ended: asked to end, then ended
            late = time.perf_counter() - (ended or 0.0)
            if late > LINGER_S:
                for left in _children(os.getpid()):
                    os.kill(left, signal.SIGTERM if late < LINGER_S + 10 else signal.SIGKILL)
            time.sleep(0.5)
            continue
        reaped[pid] = (status, usage)
        if pid == child.pid:
            returncode, ended = os.waitstatus_to_exitcode(status), time.perf_counter()
            child.returncode = returncode  # reaped here: Popen must not wait for it again
    wall = (ended or time.perf_counter()) - started
    sampler.stop.set()
    sampler.join()
    busy_after = _busy_cpu_s()
    processes = [
        ProcessFigures(
            pid,
            sampler.commands.get(pid, "?")[:300],
            (sampler.hwm_kib.get(pid) or usage.ru_maxrss) * 1024,  # type: ignore[attr-defined]
            usage.ru_utime + usage.ru_stime,  # type: ignore[attr-defined]
        )
        for pid, (_, usage) in reaped.items()
    ]
    cpu = sum(p.cpu_s for p in processes)
    # processes reaped by their own parents (Dagster's step processes): their peak as sampled, CPU in the parent's
    processes += [
        ProcessFigures(pid, sampler.commands.get(pid, "?")[:300], kib * 1024, 0.0)
        for pid, kib in sampler.hwm_kib.items()
        if pid not in reaped
    ]
    others = None
    if busy_before is not None and busy_after is not None and wall > 0:
        others = round(max(0.0, busy_after - busy_before - cpu) / wall, 2)
    return Measured(
        argv=argv,
        returncode=returncode if returncode is not None else -1,
        wall_s=round(wall, 3),
        cpu_s=round(cpu, 2),
        peak_rss_bytes=max((p.peak_rss_bytes for p in processes), default=0),
        peak_tree_rss_bytes=sampler.peak_tree_kib * 1024,
        load_before=load_before,
        load_after=os.getloadavg(),
        others_cores=others,
        processes=processes,
        output_tail=log.read_text(errors="replace")[-3000:],
    )


def peak_of(measured: Measured, pid: int) -> int | None:
    """The peak RSS of process ``pid`` (e.g. a Dagster step's, named by its events), None when it was not seen."""
    return next((p.peak_rss_bytes for p in measured.processes if p.pid == pid), None)


def plain_write_rate(folder: Path, size: int = 1 << 30) -> float:
    """Bytes per second of a plain write of ``size`` bytes with one fsync at the end, in ``folder``."""
    path = folder / ".plain-write-probe"
    block = os.urandom(1 << 20)
    started = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(size // len(block)):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return size / seconds
