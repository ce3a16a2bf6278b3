"""The contestants of the host-path benchmark (host_path.py), each run in a child process of its own.

The child measures itself: CPU seconds (user + system, every thread) and wall time of the contestant's work alone
(imports, sample generation and the free backbone's tensor come before), its peak RSS (the kernel's high-water
mark, reset just before the work where Linux allows), the bytes it stored, and the cores other processes kept busy.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import REPO

CHILD_FLAG = "--host-path-child"
MEAN_TOKENS = 335
SEED = 0


@dataclass(frozen=True)
class Config:
    hidden: int
    slots: int  # stored vectors per token: slots - 1 layers and the final norm's output
    dtype: str
    gb: float  # GB of bfloat16 states per run: the number of samples follows
    chunk_mb: float
    max_batch_tokens: int
    batch_size: int
    device: str = "cpu"

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def tokens(self) -> int:
        return int(self.gb * 1e9 / (self.slots * self.hidden * 2))


def run_child(name: str, config: Config, scratch: Path, previous: Path | None) -> dict:
    """Run contestant ``name`` in a fresh Python process and return what it measured."""
    request = {"contestant": name, "config": config.to_dict(), "scratch": str(scratch), "previous": str(previous or "")}
    command = [sys.executable, str(REPO / "benchmarks" / "shared" / "host_path.py"), CHILD_FLAG, json.dumps(request)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"host path contestant {name!r} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def contestant_main(request: dict) -> dict:
    """In the child: set up (not measured), then run and measure the contestant."""
    name, config, scratch = request["contestant"], Config(**request["config"]), Path(request["scratch"])
    if name == "previous":
        sys.path.insert(0, request["previous"])  # that checkout's hsx_dagster comes first
    if name == "plain write":
        return _measured(lambda: _plain_write(config, scratch))
    if name == "floor":
        return _measured(lambda: _plain_write(config, scratch, hash_too=True))
    if name == "sha256sum":
        return _measured(lambda: _sha256sum(scratch / "pipeline"))
    from benchmarks.shared.host_path_work import device_only, pipeline, prepare

    work = prepare(config)
    if name == "device":
        return _measured(lambda: device_only(work))
    if name == "pipeline buffered":
        return _measured(lambda: pipeline(work, scratch / "pipeline-buffered", direct_io="off"))
    return _measured(lambda: pipeline(work, scratch / ("pipeline" if name == "pipeline" else name)))


def _measured(work) -> dict:
    from benchmarks.shared.measure import busy_cpu_seconds, peak_rss_bytes, reset_peak_rss

    reset_peak_rss()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    busy, started = busy_cpu_seconds(), time.perf_counter()
    stored = work()
    wall = time.perf_counter() - started
    stored, extra = stored if isinstance(stored, tuple) else (stored, {})
    after = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # sha256sum runs as a child of the child
    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime) + children.ru_utime + children.ru_stime
    busy_end = busy_cpu_seconds()
    others = max(0.0, busy_end - busy - cpu) / wall if busy is not None and busy_end is not None else None
    return {
        "wall_s": round(wall, 4),
        "cpu_s": round(cpu, 4),
        "user_s": round(after.ru_utime - usage.ru_utime + children.ru_utime, 4),
        "system_s": round(after.ru_stime - usage.ru_stime + children.ru_stime, 4),
        "peak_rss": peak_rss_bytes() or after.ru_maxrss * 1024,
        "bytes": int(stored),
        "others_cores": round(others, 3) if others is not None else 0.0,
        **extra,  # the pipeline's own account of its CPU time by part, and how it wrote
    }


def _plain_write(config: Config, scratch: Path, hash_too: bool = False) -> int:
    """The bytes a pipeline run stores (bfloat16: ``gb``; fp8: about half), as files of chunk_mb, each written
    from memory and fsynced: what the disk does with no host work around it. ``hash_too``: and one sha256 of each
    file's bytes from the same memory: the floor of the host path (one write with fsync, one hash per byte)."""
    import hashlib

    import numpy as np

    total = int(config.gb * 1e9 * (0.5 if config.dtype == "float8_e4m3" else 1.0))
    chunk = int(config.chunk_mb * 2**20)
    data = np.random.default_rng(SEED).integers(0, 256, size=chunk, dtype=np.uint8)
    folder = scratch / "plain-write"
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for number in range((total + chunk - 1) // chunk):
        size = min(chunk, total - written)
        descriptor = os.open(folder / f"file-{number:06d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)[:size]
            if hash_too:
                hashlib.sha256(view).hexdigest()
            while view.nbytes:
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        written += size
    return written


def _sha256sum(folder: Path) -> int:
    files = sorted(str(path) for path in folder.glob("chunk-*.safetensors"))
    subprocess.run(["sha256sum", *files], check=True, capture_output=True)
    return sum(os.path.getsize(path) for path in files)
