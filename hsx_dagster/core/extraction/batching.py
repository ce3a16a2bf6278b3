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


class LengthOrder:
    """Rows longest first, cut into batches from the front one at a time, each batch under its own
    budgets: what lets the batch shape change in the middle of a run (the shape probe) and after an
    out-of-memory error. Cutting the whole order with one shape gives `plan_batches`."""

    def __init__(self, num_tokens: Sequence[int] | np.ndarray) -> None:
        self.lengths = np.asarray(num_tokens, dtype=np.int64)
        self.order = np.argsort(-self.lengths, kind="stable")
        sorted_lengths = self.lengths[self.order]
        self._cumulative = np.concatenate([[0], np.cumsum(sorted_lengths)])
        self._cumulative_squares = np.concatenate([[0], np.cumsum(sorted_lengths**2)])
        self._sorted = sorted_lengths
        self.position = 0
        self._batch_shares: dict[tuple[int, int], np.ndarray] = {}  # per shape: suffix sums for `batches_left`

    def __len__(self) -> int:
        return len(self.order) - self.position

    @property
    def remaining_tokens(self) -> int:
        return int(self._cumulative[-1] - self._cumulative[self.position])

    @property
    def remaining_squared_lengths(self) -> int:
        """The sum of the squared lengths of the rows left (what attention's cost grows with)."""
        return int(self._cumulative_squares[-1] - self._cumulative_squares[self.position])

    def tokens_longer_than(self, length: int) -> int:
        """Tokens of the rows left that are longer than ``length``."""
        end = self.position + int(np.searchsorted(-self._sorted[self.position :], -length, side="left"))
        return int(self._cumulative[end] - self._cumulative[self.position])

    @property
    def next_length(self) -> int:
        """Length of the longest row left (0 when none is)."""
        return int(self._sorted[self.position]) if len(self) else 0

    def batches_left(self, batch_size: int, max_batch_tokens: int) -> float:
        """About how many batches the rows left make when cut with these budgets: each row counts for the share
        of a batch that rows of its length get. One suffix sum per shape, so asking after every batch is cheap."""
        key = (batch_size, max_batch_tokens)
        if key not in self._batch_shares:
            rows_per_batch = np.maximum(1, np.minimum(batch_size, max_batch_tokens // np.maximum(self._sorted, 1)))
            shares = np.cumsum((1.0 / rows_per_batch)[::-1])[::-1]
            self._batch_shares[key] = np.concatenate([shares, [0.0]])
        return float(self._batch_shares[key][self.position])

    def peek(self, batch_size: int, max_batch_tokens: int) -> Batch:
        """The batch `take` would cut with these budgets, without taking it."""
        if not len(self):
            raise IndexError("no rows left")
        longest = int(self._sorted[self.position])
        # Sorted descending, so the first row is the longest; a row longer than the budget runs alone.
        count = max(1, min(batch_size, max_batch_tokens // longest, len(self)))
        end = self.position + count
        real = int(self._cumulative[end] - self._cumulative[self.position])
        return Batch(tuple(int(row) for row in self.order[self.position : end]), longest, real)

    def take(self, batch_size: int, max_batch_tokens: int) -> Batch:
        batch = self.peek(batch_size, max_batch_tokens)
        self.position += len(batch.rows)
        return batch


def plan_batches(num_tokens: Sequence[int] | np.ndarray, batch_size: int, max_batch_tokens: int) -> list[Batch]:
    """Group samples into batches, longest first; a sample longer than the token budget runs alone."""
    order = LengthOrder(num_tokens)
    batches: list[Batch] = []
    while len(order):
        batches.append(order.take(batch_size, max_batch_tokens))
    return batches


def padding_efficiency(batches: Sequence[Batch]) -> float:
    """Real tokens over computed tokens (1.0: no padding at all)."""
    computed = sum(batch.computed_tokens for batch in batches)
    return sum(batch.real_tokens for batch in batches) / computed if computed else 1.0
