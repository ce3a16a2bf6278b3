"""Shared fixtures: the embedded demo (built once, deterministically, by the same code as `make demo`)."""

import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from hsx_dagster.core.inputs import Conversation, iter_records
from hsx_dagster.demo.build import MODEL_PATH, OPENAI_PATH, SHAREGPT_PATH, build_demo
from hsx_dagster_tests.support.paths import REPO

MEMORY_SCRATCH = Path("/dev/shm")
MEMORY_SCRATCH_MIN_FREE = 4 * 2**30


def _scratch_in_memory() -> None:
    """Scratch files (tmp_path, Dagster's test instances, subprocesses') on the machine's tmpfs: the pipeline
    fsyncs every chunk it commits and Dagster's SQLite each event, which slows the quick loop on a disk
    (docs/benchmarks.md).
    A TMPDIR the user set wins; without a roomy, writable tmpfs nothing changes."""
    if "TMPDIR" in os.environ or not (MEMORY_SCRATCH.is_dir() and os.access(MEMORY_SCRATCH, os.W_OK | os.X_OK)):
        return
    if shutil.disk_usage(MEMORY_SCRATCH).free < MEMORY_SCRATCH_MIN_FREE:
        return
    os.environ["TMPDIR"] = str(MEMORY_SCRATCH)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


_scratch_in_memory()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test-quick` runs one pytest worker per core: each gets one core's worth of threads. Torch's
    # default (a thread per core in every process) oversubscribes, and its spinning threads made the
    # parallel loop slower than a serial one. (Imported here only: the controller runs no test.)
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_root() -> Path:
    build_demo(REPO / "data")  # a no-op when `make data` already built it
    return REPO / "data"


@pytest.fixture(scope="session")
def demo_paths(demo_root) -> list[Path]:
    return [demo_root / SHAREGPT_PATH, demo_root / OPENAI_PATH]


@pytest.fixture(scope="session")
def demo_model_dir(demo_root) -> Path:
    return demo_root / MODEL_PATH


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model_dir))


@pytest.fixture(scope="session")
def llama3_tokenizer(demo_model_dir, tmp_path_factory):
    """The demo vocabulary behind a Llama-3-style template: a second, different chat template."""
    from transformers import AutoTokenizer

    from hsx_dagster_tests.support.llama3_tokenizer import make_llama3_style_tokenizer

    out = tmp_path_factory.mktemp("llama3-tokenizer")
    make_llama3_style_tokenizer(demo_model_dir, out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="session")
def demo_conversations(demo_paths) -> list[Conversation]:
    return [r for path in demo_paths for r in iter_records(path) if isinstance(r, Conversation)]


@pytest.fixture(scope="session")
def dense_model_dir(demo_model_dir, tmp_path_factory) -> Path:
    """A standard dense (Llama) model with the demo tokenizer, next to the hybrid demo model."""
    from hsx_dagster.demo.model import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(out, demo_model_dir, arch="llama", num_layers=6, hidden_size=64, seed=1)
    return out


@pytest.fixture(scope="session")
def small_inputs(demo_conversations, tmp_path_factory) -> Path:
    """28 demo conversations spread over the length range (short to ~1,000 tokens), as JSONL."""
    import json

    ordered = sorted(demo_conversations, key=lambda c: sum(len(m.content) for m in c.messages))
    usable = ordered[: int(len(ordered) * 0.93)]  # leave out the very long tail: the reference runs per sample
    picked = [usable[int(i * (len(usable) - 1) / 27)] for i in range(28)]
    path = tmp_path_factory.mktemp("inputs") / "small.jsonl"
    path.write_text("".join(json.dumps({"messages": c.as_chat()}) + "\n" for c in picked))
    return path


@pytest.fixture(scope="module")
def tokenized(small_inputs, demo_model_dir, tmp_path_factory) -> Path:
    """`small_inputs` tokenized for the demo model in one shard (samples up to 1,024 tokens), once per module:
    the extraction tests' input."""
    from hsx_dagster_tests.support.helpers import tokenize

    out = tmp_path_factory.mktemp("tok") / "tokenized"
    tokenize([small_inputs], demo_model_dir, out, shards=1, max_length=1024)
    return out


# The modules that take minutes, longest first (the fresh-clone CI run on 2 cores). `make test` runs a module per
# worker (`--dist loadfile`) in collection order, each worker taking the next module when it is free: starting the
# longest first keeps both workers busy to the end. pytest-xdist's own order (most tests first) ran these last, and
# one worker alone through the tail of the longest.
LONGEST_MODULES = (
    "hsx_dagster_tests/end_to_end/test_browser.py",
    "hsx_dagster_tests/end_to_end/trainers/test_acceptance.py",
    "hsx_dagster_tests/end_to_end/test_ray_cluster.py",
    "hsx_dagster_tests/end_to_end/test_benchmarks.py",
    "hsx_dagster_tests/unit/regenerate/test_regeneration.py",
    "hsx_dagster_tests/end_to_end/test_postgres.py",
    "hsx_dagster_tests/defs/test_definitions.py",
    "hsx_dagster_tests/end_to_end/test_reliability_crash.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {module: index for index, module in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def pytest_unconfigure(config):
    # Interpreter shutdown garbage-collects every object torch, transformers and Dagster made: seconds per
    # process (each pytest-xdist worker too). Frozen objects are skipped, and no test is left to need them.
    gc.freeze()
