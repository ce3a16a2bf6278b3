"""Length-sorted batching under two budgets: rows per batch and computed tokens per batch.

Right-padded batches compute ``rows x longest row`` token positions; sorting by length keeps the
padding small, and the token budget keeps the activation memory of one forward pass bounded
whatever the lengths. Batches run longest first, so an out-of-memory error shows up in the first
minutes of a run, not hours in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    rows: tuple[int, ...]  # positions in the shard's sample list, longest first
    longest: int
    real_tokens: int

    @property
    def computed_tokens(self) -> int:
        return len(self.rows) * self.longest


def plan_batches(num_tokens: Sequence[int] | np.ndarray, batch_size: int, max_batch_tokens: int) -> list[Batch]:
    """Group samples into batches, longest first; a sample longer than the token budget runs alone."""
    lengths = np.asarray(num_tokens, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    batches: list[Batch] = []
    rows: list[int] = []
    longest = 0
    for position in order.tolist():
        length = int(lengths[position])
        # Sorted descending, so the first row of a batch is its longest.
        if rows and (len(rows) + 1 > batch_size or (len(rows) + 1) * longest > max_batch_tokens):
            batches.append(Batch(tuple(rows), longest, int(lengths[rows].sum())))
            rows = []
        if not rows:
            longest = length
        rows.append(position)
    if rows:
        batches.append(Batch(tuple(rows), longest, int(lengths[rows].sum())))
    return batches


def padding_efficiency(batches: Sequence[Batch]) -> float:
    """Real tokens over computed tokens (1.0: no padding at all)."""
    computed = sum(batch.computed_tokens for batch in batches)
    return sum(batch.real_tokens for batch in batches) / computed if computed else 1.0
