"""A shard run that kills itself with SIGKILL at a chosen moment, for the crash tests.

It runs in a child process (forked from a forkserver that has imported this module, so a child
starts in milliseconds). The kill points are made by wrapping production functions from here;
production code has no test hooks.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import torch
import transformers.models.auto.modeling_auto

with contextlib.suppress(ImportError):  # the demo model's architecture, likewise
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401

from hsx_dagster.core.extraction import Backbone, decoder_layers, run_shard
from hsx_dagster.core.storage import atomic, format, shard_store
from hsx_dagster_tests.support.helpers import shard_job

NOT_KILLED = 3  # exit status when the run finished without reaching its kill point


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class HalfWrittenFile:
    """A file whose first write puts half of its bytes on disk, then calls ``then`` (which kills
    the process or raises, as a crash or a full disk would)."""

    def __init__(self, handle, then) -> None:
        self._handle = handle
        self._then = then

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._handle.close()

    def write(self, data) -> int:
        self._handle.write(data[: len(data) // 2])
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._then()
        return 0

    def __getattr__(self, name):
        return getattr(self._handle, name)


def run_and_kill(job: dict, point: str, at: int) -> None:
    """Run the shard; die at the ``at``-th occurrence of ``point``:

    - forward: inside a forward pass (after its first decoder layer);
    - chunk_write: half-way through writing a chunk's temporary file;
    - after_commit: right after a chunk is committed (between chunks);
    - index_append: half-way through appending the chunk's line to index.jsonl.
    """
    torch.set_num_threads(1)  # the same arithmetic as the parent's reference run
    count = 0

    def reached() -> bool:
        nonlocal count
        count += 1
        return count == at

    if point == "forward":
        original_forward = Backbone.forward

        def forward(self, *args, **kwargs):
            if reached():
                decoder_layers(self.model)[0].register_forward_hook(lambda *hook_args: _die())
            return original_forward(self, *args, **kwargs)

        Backbone.forward = forward
    elif point in ("chunk_write", "index_append"):
        real_open = open

        def open_in_store(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            name = Path(file).name
            if point == "chunk_write":
                wanted = name.startswith(".chunk-") and "w" in mode
            else:
                wanted = name == format.SHARD_INDEX_FILE and "a" in mode
            return HalfWrittenFile(handle, _die) if wanted and reached() else handle

        atomic.open = open_in_store  # a module global shadows the builtin in atomic.py only
    elif point == "after_commit":
        original_commit = shard_store.ShardStore.commit

        def commit(self, *args, **kwargs):
            record = original_commit(self, *args, **kwargs)
            if reached():
                _die()
            return record

        shard_store.ShardStore.commit = commit
    else:
        raise ValueError(f"unknown kill point {point!r}")
    run_shard(shard_job(**job))
    os._exit(NOT_KILLED)


def heal_and_kill(folder: Path, tokenized_dir: Path, point: str) -> None:
    """Run the shard checks with healing on ``folder`` (a damaged chunk in it); die part-way through setting the
    chunk aside: ``logged`` (the removal recorded, the file not moved yet) or ``moved`` (the file moved aside, the
    index not rewritten yet)."""
    from hsx_dagster.core.dataset import check_shard
    from hsx_dagster.core.storage import chunk_removal

    if point == "logged":
        chunk_removal.finish_removals = lambda directory: _die()  # type: ignore[assignment]
    elif point == "moved":
        real_replace = chunk_removal.os.replace

        def replace_then_die(source, target):
            real_replace(source, target)
            _die()

        chunk_removal.os = type("os", (), {"replace": staticmethod(replace_then_die)})  # type: ignore[assignment]
    else:
        raise ValueError(f"unknown kill point {point!r}")
    check_shard(folder, tokenized_dir, "shard-00", heal=True)
    os._exit(NOT_KILLED)
