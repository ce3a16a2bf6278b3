"""The isolated trainer environment: speculators 0.9, hs-connectors 0.9 and SpecForge 0.2 beside a CPU torch.

Built once into ``.venv-trainers/`` at the repository root and reused while the requirement files and the torch pin
are unchanged (a stamp records their digest); a lock makes parallel test workers wait for one build. speculators
pins transformers <= 5.19 and SpecForge torch 2.11 and sglang, so they cannot live in the project's ``.venv``:
their own dependencies are never installed (``no-deps.txt``), what their reading and model code needs is listed in
``requirements.txt``, and torch comes from the pin in constraints.txt (CPU wheel; never a CUDA one).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hsx_dagster_tests.support.paths import REPO

HERE = Path(__file__).resolve().parent
ENV = REPO / ".venv-trainers"
SCRIPTS = HERE / "scripts"
_STAMP = ENV / ".hsx-stamp"


def _torch_pin() -> str:
    lines = (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines()
    return next(line.strip() for line in lines if line.strip().startswith("torch=="))


def _digest() -> str:
    parts = [(HERE / name).read_text(encoding="utf-8") for name in ("requirements.txt", "no-deps.txt")]
    parts += [_torch_pin(), sys.version]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _pip(*args: str) -> None:
    subprocess.run([str(ENV / "bin" / "python"), "-m", "pip", "install", "--quiet", *args], check=True)


def trainer_python() -> Path:
    """The trainer environment's interpreter, building the environment first when it is missing or stale."""
    lock_path = REPO / ".venv-trainers.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (_STAMP.is_file() and _STAMP.read_text() == _digest()):
            shutil.rmtree(ENV, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(ENV)], check=True)
            constraint = ENV / "torch-constraint.txt"
            constraint.write_text(_torch_pin() + "\n")
            _pip("-c", str(constraint), "-r", str(HERE / "requirements.txt"))
            _pip("--no-deps", "-r", str(HERE / "no-deps.txt"))
            _STAMP.write_text(_digest())
    return ENV / "bin" / "python"


def run_script(script: str, *args: object, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<script>`` in the trainer environment with this checkout's ``hsx_dagster`` importable (without
    its Dagster dependencies: only the Dagster-free core is imported there); fails with the script's output."""
    completed = run_trainer_python(str(SCRIPTS / script), *args, timeout=timeout)
    assert completed.returncode == 0, f"{script} failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"
    return completed


def run_trainer_python(*args: object, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The trainer environment's Python with ``args`` (a script, or ``-m`` and a module of this checkout, such as a
    benchmark's command), run from the checkout with it importable; the caller judges the exit status."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [str(trainer_python()), *map(str, args)], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
