"""Assign samples to shards: stable membership, balanced by tokens.

A sample keeps the shard it was first assigned to for as long as it exists in the inputs (its id is a hash of
the conversation, so the same conversation in another file or position is the same sample): growing the inputs
never moves a committed sample, so a shard run extracts only its new samples. New samples go, longest first, to
the shard with the fewest tokens at that moment (existing samples counted), so new work evens the shards out.

Extraction time is about proportional to tokens, and the slowest shard sets the finishing time of the whole job,
so shards are balanced by tokens, not by sample count. Longest-processing-time-first greedy is within 4/3 of
optimal in the worst case and, with many small samples, within a fraction of a percent in practice.

Changing the shard count: more shards keep every sample where it is and the new shards take new samples only
(the balance recovers as data is added); with fewer shards, the samples of the dropped shards are new samples
of the remaining ones (docs/reliability.md, "Growing and shrinking the inputs").
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def assign_shards(
    num_tokens: Sequence[int] | np.ndarray,
    sample_ids: Sequence[int] | np.ndarray,
    shards: int,
    previous: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Shard index for each sample (same order as the inputs). ``previous`` (sample ids, shard indices) is the
    earlier assignment: a sample found there keeps its shard if that shard still exists. Deterministic: ties
    break by sample id."""
    tokens = np.asarray(num_tokens, dtype=np.int64)
    ids = np.asarray(sample_ids, dtype=np.int64)
    assignment = np.full(len(tokens), -1, dtype=np.int32)
    if shards <= 1 or len(tokens) == 0:
        return np.zeros(len(tokens), dtype=np.int32)
    if previous is not None:
        assignment[:] = previous_shards(ids, *previous)
        assignment[assignment >= shards] = -1  # a dropped shard: its samples are new to the remaining ones
    kept = assignment >= 0
    loads = np.bincount(assignment[kept], weights=tokens[kept], minlength=shards).astype(np.int64)
    new = np.flatnonzero(~kept)
    # Longest first; lexsort's last key is the primary one.
    order = new[np.lexsort((ids[new], -tokens[new]))]
    heap = [(int(load), shard) for shard, load in enumerate(loads)]
    heapq.heapify(heap)
    for position in order:
        load, shard = heapq.heappop(heap)
        assignment[position] = shard
        heapq.heappush(heap, (load + int(tokens[position]), shard))
    return assignment


def previous_shards(ids: np.ndarray, known_ids: np.ndarray, known_shards: np.ndarray) -> np.ndarray:
    """The shard index ``known_*`` gives each of ``ids``, -1 for an id not among them."""
    if len(known_ids) == 0:
        return np.full(len(ids), -1, dtype=np.int32)
    order = np.argsort(known_ids, kind="stable")
    sorted_ids = np.asarray(known_ids, dtype=np.int64)[order]
    where = np.clip(np.searchsorted(sorted_ids, ids), 0, len(sorted_ids) - 1)
    found = sorted_ids[where] == ids
    return np.where(found, np.asarray(known_shards, dtype=np.int32)[order][where], -1).astype(np.int32)


def shard_loads(num_tokens: Sequence[int] | np.ndarray, assignment: np.ndarray, shards: int) -> np.ndarray:
    return np.bincount(assignment, weights=np.asarray(num_tokens, dtype=np.float64), minlength=shards).astype(np.int64)


def imbalance(loads: np.ndarray) -> float:
    """Largest shard over the mean shard (1.0 is perfect balance)."""
    mean = float(np.mean(loads)) if len(loads) else 0.0
    return float(np.max(loads)) / mean if mean > 0 else 1.0
