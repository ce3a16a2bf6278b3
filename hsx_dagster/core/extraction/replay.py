"""Batches formed again exactly as they first ran, so a resumed shard is bit for bit an uninterrupted one.

A sample's states depend, in their last bits, on the batch it is computed in (the padded length, how the kernels
block the matrix products). Chunks end between batches, so a run that redoes uncommitted samples cuts them into the
same batches as before, except where a batch larger than a chunk was cut into several chunks and only some of them
committed (a crash between them, or a damaged one set aside). The writer logs such a batch (its samples, in order:
``split_batches.jsonl``) before the first of its chunks commits; a run that finds some of its samples pending runs
that batch again, whole, and stores only the pending ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsx_dagster.core.storage.atomic import read_lines
from hsx_dagster.core.storage.format import SPLIT_BATCHES_FILE


@dataclass(frozen=True)
class Replay:
    """A logged batch to run again: its table rows in the logged order, and which of them to store (pending)."""

    rows: np.ndarray
    keep: np.ndarray

    def halves(self) -> list[Replay]:
        """Two smaller batches (after the device ran out of memory on this one: the same samples, not the same
        batch any more)."""
        middle = len(self.rows) // 2
        return [Replay(self.rows[:middle], self.keep[:middle]), Replay(self.rows[middle:], self.keep[middle:])]


def plan_replays(directory: Path, sample_ids: np.ndarray, pending: np.ndarray) -> list[Replay]:
    """The logged batches of the shard in ``directory`` that hold a pending sample (``pending``: a mask over the rows
    of ``sample_ids``, the shard's tokenized samples), each once; samples that left the inputs are left out."""
    row_of = {int(sample_id): row for row, sample_id in enumerate(sample_ids.tolist())}
    claimed: set[int] = set()
    replays = []
    for entry in read_lines(Path(directory) / SPLIT_BATCHES_FILE):
        rows = np.array([row_of[i] for i in entry.get("sample_ids", []) if i in row_of], dtype=np.int64)
        if not len(rows) or not pending[rows].any() or claimed.issuperset(rows.tolist()):
            continue  # nothing left to redo, or the same batch logged again when it ran again
        keep = pending[rows] & ~np.isin(rows, list(claimed))
        claimed.update(rows.tolist())
        replays.append(Replay(rows, keep))
    return replays


def covered(replays: list[Replay], rows: int) -> np.ndarray:
    """A mask over ``rows`` table rows: those a replay stores."""
    mask = np.zeros(rows, dtype=bool)
    for replay in replays:
        mask[replay.rows[replay.keep]] = True
    return mask
