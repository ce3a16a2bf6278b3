"""Where a running shard stands: what the extraction loop hands its ``on_batch_progress`` callback after each batch.

The ETA is the time until the shard is done (materialized), not only until its last batch ran. It is
weighted by tokens, not samples: batches are cut longest first, so the first samples carry far more
tokens than the last, and a per-sample rate would overstate the time left several times over at the
start of a shard. A batch also has a fixed cost (a pass through every layer, padding, copies) that a
rate per token leaves out, and that fixed cost is most of the time of the short batches at the end:
`BatchCostModel` fits both from the batches measured so far. What follows the last batch (writing
the chunk still in memory, the shard's summary, the materialization) is added as
`Progress.after_loop_s`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hsx_dagster.core.extraction.batch_shape import BatchShaper
from hsx_dagster.core.extraction.batching import Batch, LengthOrder
from hsx_dagster.core.units import format_bytes, format_count, format_duration, format_rate, format_share


# kw_only: nine required figures, counts and seconds side by side, so each is named where a Progress is made and
# none can land in another's place
@dataclass(frozen=True, kw_only=True)
class Progress:
    shard: str
    samples_done: int  # by this run
    samples_total: int  # this run's pending samples
    tokens_done: int
    tokens_total: int
    bytes_written: int  # committed to chunks so far by this run
    elapsed_s: float
    forward_s: float  # of elapsed_s, in the model's forward pass (measured batches)
    device: str
    samples_resumed: int = 0  # committed by earlier runs
    loop_left_s: float | None = None  # the batches left, as `BatchCostModel` prices them; None: not known yet
    after_loop_s: float = 0.0  # what follows the last batch until the shard is materialized

    @property
    def estimated(self) -> bool:
        """Whether the time left comes from measured batch costs (not the bare rate per token of the first ones)."""
        return self.loop_left_s is not None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def forward_share(self) -> float:
        return min(self.forward_s / self.elapsed_s, 1.0) if self.elapsed_s > 0 else 0.0

    @property
    def fraction(self) -> float:
        """Share of this run's tokens done."""
        return self.tokens_done / self.tokens_total if self.tokens_total else 1.0

    @property
    def eta_s(self) -> float:
        """Seconds until the shard is materialized: the batches left, then what follows them."""
        if self.loop_left_s is not None:
            return self.loop_left_s + self.after_loop_s
        rate = self.tokens_per_s
        return (self.tokens_total - self.tokens_done) / rate + self.after_loop_s if rate > 0 else math.inf

    def line(self) -> str:
        """One complete sentence for the run log."""
        return (
            f"{self.shard}: {format_count(self.samples_done)} of {format_count(self.samples_total)} samples and "
            f"{format_share(self.fraction)} of the tokens done in {format_duration(self.elapsed_s)}, "
            f"{format_rate(self.tokens_per_s, 'tokens')}, {format_share(self.forward_share)} of the time in the "
            f"forward pass, {format_bytes(self.bytes_written)} committed; about {format_duration(self.eta_s)} left."
        )

    def metadata(self) -> dict[str, str]:
        """The figures as people read them, one entry per quantity (Dagster metadata, the report)."""
        entries = {
            "progress": f"{format_share(self.fraction)} of tokens",
            "samples": f"{format_count(self.samples_done)} of {format_count(self.samples_total)}",
            "tokens": f"{format_count(self.tokens_done)} of {format_count(self.tokens_total)}",
            "committed": format_bytes(self.bytes_written),
            "throughput": format_rate(self.tokens_per_s, "tokens"),
            "forward share": format_share(self.forward_share),
            "elapsed": format_duration(self.elapsed_s),
            "time left": format_duration(self.eta_s),
            "device": self.device,
        }
        if self.samples_resumed:
            entries["resumed"] = f"{format_count(self.samples_resumed)} samples committed by earlier runs"
        return entries


MIN_FITTED_BATCHES = 3  # measured batches (after the first) before the rest is priced
SPREAD_TO_FIT = 0.2  # batch sizes in tokens must vary this much (standard deviation over mean) to fit three costs


class BatchCostModel:
    """What one batch of the run costs in wall time, fitted by least squares over the batches measured so far
    from three parts, none negative: a fixed part per batch (a pass through every layer, copies), a part per
    token, and a part per token and per token of its row's length (attention, and whatever else grows with the
    row): longest first, the short batches at the end cost more per token than a rate per token says at batch
    size 1 and less when the rows fill a token budget. The first batch is left out: it also warms the model and
    its kernels up, a cost the rest of the run does not pay. Until the batches differ in size (longest first,
    the first ones are alike) they tell the parts apart no better than noise: the rate per token prices them.
    Running sums only, so adding a batch costs the same at the first and the millionth."""

    def __init__(self) -> None:
        self.warmed_up = False
        self.batches = 0
        self.gram = np.zeros((3, 3))  # sums of products of the parts' amounts, per batch
        self.moments = np.zeros(3)  # sums of each part's amount times the batch's seconds
        self.row_length = np.zeros(2)  # sums of the batches' mean row length (token-weighted) and of its square

    def add(self, tokens: int, squared_lengths: int, seconds: float) -> None:
        """One batch: its real tokens, the sum of its rows' squared lengths, its wall time."""
        if not self.warmed_up:
            self.warmed_up = True
            return
        amounts = np.array([1.0, tokens, squared_lengths], dtype=np.float64)
        self.batches += 1
        self.gram += np.outer(amounts, amounts)
        self.moments += amounts * seconds
        mean_length = squared_lengths / max(tokens, 1)
        self.row_length += (mean_length, mean_length**2)

    def costs(self) -> np.ndarray | None:
        """Seconds per batch, per token and per token-length, or None before MIN_FITTED_BATCHES batches."""
        if self.batches < MIN_FITTED_BATCHES or self.gram[0, 1] <= 0:
            return None
        mean, mean_square = self.row_length / self.batches
        if mean_square - mean**2 <= (SPREAD_TO_FIT * mean) ** 2:
            return np.array([0.0, self.moments[0] / self.gram[0, 1], 0.0])  # seconds over tokens: the rate
        return self._non_negative_fit()

    def _non_negative_fit(self) -> np.ndarray:
        """The least squares fit with no negative part: the best of the fits on each subset of the parts whose
        solution has none (three parts: seven subsets, each a tiny linear system)."""
        scale = 1 / np.sqrt(np.diag(self.gram))  # parts of such different sizes are compared scaled to one
        gram, moments = self.gram * np.outer(scale, scale), self.moments * scale
        best, best_error = np.zeros(3), np.inf
        for subset in ([0], [1], [2], [0, 1], [0, 2], [1, 2], [0, 1, 2]):
            sub_gram, sub_moments = gram[np.ix_(subset, subset)], moments[subset]
            if np.linalg.cond(sub_gram) > 1e10:  # parts that move together: a smaller subset covers them
                continue
            part = np.linalg.solve(sub_gram, sub_moments)
            error = float(part @ sub_gram @ part - 2 * part @ sub_moments)  # the squared error less sum(seconds^2)
            if (part >= 0).all() and error < best_error:
                best, best_error = np.zeros(3), error
                best[subset] = part
        return best * scale

    def seconds_left(self, batches_left: float, tokens_left: int, squared_lengths_left: int) -> float | None:
        costs = self.costs()
        if costs is None:
            return None
        return float(costs @ np.array([batches_left, tokens_left, squared_lengths_left], dtype=np.float64))


class TimeLeft:
    """The extraction's time left after each batch: the batches' wall times (the host's share of a batch counts
    too) priced by `BatchCostModel`, applied to the pieces waiting after an out-of-memory split and to the rows
    not cut yet, in batches of the current shape."""

    def __init__(self, order: LengthOrder, retry: deque[Batch], shaper: BatchShaper, lengths: np.ndarray) -> None:
        self.order, self.retry, self.shaper, self.lengths = order, retry, shaper, lengths
        self.costs = BatchCostModel()
        self.batch_started = time.perf_counter()
        self.left_s: float | None = None  # after the last batch

    def after(self, batch: Batch) -> None:
        now = time.perf_counter()
        self.costs.add(batch.real_tokens, self._squares(batch), now - self.batch_started)
        self.batch_started = now
        order, shape = self.order, self.shaper.current
        batches = len(self.retry) + (order.batches_left(shape.batch_size, shape.max_batch_tokens) if len(order) else 0)
        tokens = sum(piece.real_tokens for piece in self.retry) + order.remaining_tokens
        squares = sum(self._squares(piece) for piece in self.retry) + order.remaining_squared_lengths
        self.left_s = self.costs.seconds_left(batches, tokens, squares)

    def restart(self) -> None:
        """The batch just run (formed again, replay.py) is not one the cost model prices: time from here."""
        self.batch_started = time.perf_counter()

    def _squares(self, batch: Batch) -> int:
        return int((self.lengths[list(batch.rows)] ** 2).sum())


def progress_logger(log_line: Callable[[str], None], every_s: float, shaper: BatchShaper) -> Callable[[Progress], None]:
    """Without a caller's ``on_batch_progress`` (which gets every batch's progress and decides how often to show
    it), a progress line through ``log_line`` every ``every_s`` of extraction."""
    last_shown = 0.0

    def show(progress: Progress) -> None:
        nonlocal last_shown
        if progress.elapsed_s - last_shown >= every_s:
            last_shown = progress.elapsed_s
            log_line(f"{progress.line()} Batches of at most {shaper.current}.")

    return show
