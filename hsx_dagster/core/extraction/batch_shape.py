"""The batch shape of a shard run: fixed by the user, or found by a short probe on the shard's own batches.

`extraction.batch_size` and `extraction.max_batch_tokens` are ``auto`` by default. A shard run then
starts with a *probe*: the next batches of the shard (longest first, so the memory-hungriest ones) are
cut with a few candidate shapes and timed with the device's own clock (CUDA events on a GPU, the
wall clock on a CPU), and the shape with the most real tokens per second is kept. Every probed batch
is real work: its states are stored like any other batch's, nothing is computed twice, and only the
shard's pending samples are ever taken, so a resumed run never redoes a committed sample.

Candidates are powers of two of the token budget (the rows cap follows as budget // 32, so only
samples shorter than 32 tokens ever meet it), starting from a size that suits the device and moving
one step at a time, up first, then down, while a step is faster by more than 2%. Each step compares
the incumbent and the candidate on alternating batches (incumbent, candidate, candidate, incumbent):
neighbours in length and in time, so neither the shrinking lengths of a length-sorted shard nor a
moment of load on the machine favours one side. On a GPU the largest candidate is bounded by the free
memory, with a 20% margin, using the activation bytes per token measured on the first batch. An
out-of-memory error lowers the budget for the rest of the run, whoever chose it, as before.

Lengths change along a length-sorted shard, so the probe runs again, from the current shape, when
the throughput falls well below what the probe measured (under 70% over 8 batches) or when the
longest sample is half as long as at the last probe. What probing costs is the time the losing
shapes took beyond what the winner would have needed for the same tokens; all probes of a run
together stay within a budget of 3% of the run's estimated time (a probe step whose worst case does
not fit is not started, and a losing candidate that has used up the rest of the budget is stopped after
its batch). The estimate comes from the probe's own throughput, so when the run slows down later (a
busy machine) the share of the real run can differ; each shard's metadata shows what was lost.
With an explicit number for one of the two settings, only the other one is
probed; with both, nothing is.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable

import torch

from hsx_dagster.core.choices import parse_auto_or_positive
from hsx_dagster.core.extraction.batch_shape_summary import (
    BatchShapeSummary,
    ProbeLog,
    Shape,
    ShapeTimes,
    probe_message,
)
from hsx_dagster.core.extraction.batching import Batch, LengthOrder
from hsx_dagster.core.extraction.timing import Lap

log = logging.getLogger(__name__)

ROW_TOKENS = 32  # auto rows cap = token budget // ROW_TOKENS
MAX_ROWS = 4096
# Token budgets tried per device kind: (smallest, start, largest), powers of two.
# On a CPU one sample of a few hundred tokens already keeps the cores busy: small batches, up from 2K if faster.
LADDERS = {"cpu": (2**8, 2**11, 2**15), "mps": (2**10, 2**13, 2**16), "cuda": (2**12, 2**15, 2**19)}
MIN_GAIN = 0.02  # a step is taken when the candidate is faster by more than this
CLEAR_LOSS = 0.7  # a candidate this much slower on its first batch has lost: its second batch is not run
BATCHES_PER_SIDE = 2  # batches of each side in one comparison (incumbent, candidate, candidate, incumbent)
BUDGET_FRACTION = 0.03  # of the run's estimated time, for the cost of every probe together
MEMORY_MARGIN = 0.2  # share of the free device memory the largest candidate leaves unused
DROP = 0.7  # re-probe when throughput over the last WINDOW batches is under this share of the probe's
WINDOW = 8
LENGTH_CHANGE = 0.5  # re-probe when the longest sample is this share of the one at the last probe
SAME_BATCHES = "same batches as the current shape"
WORST_CASE_LOSS = 0.5  # a step is started only if losing half of the candidate's time still fits the budget


class BatchShaper:
    """Chooses the shape of every batch of one shard run; the engine asks `next_shape`, cuts the batch,
    runs it, then reports it with `record` (or `out_of_memory`)."""

    def __init__(
        self,
        batch_size: int | str | None,
        max_batch_tokens: int | str | None,
        device: torch.device,
        order: LengthOrder,
        *,
        budget_fraction: float = BUDGET_FRACTION,
        batches_per_side: int = BATCHES_PER_SIDE,
        report: Callable[[str], None] | None = None,
        shard: str = "",
    ) -> None:
        self.rows = parse_auto_or_positive(batch_size)  # None: auto
        self.tokens = parse_auto_or_positive(max_batch_tokens)
        self.device = device
        self.order = order
        self.budget_fraction = budget_fraction
        self.batches_per_side = max(1, batches_per_side)
        self._report = report or log.info
        self.shard = shard
        self.run_tokens = order.remaining_tokens
        self.cap: int | None = None  # lowered token budget (out of memory, or the GPU's free memory)
        self.cap_reason = ""
        self.probes: list[ProbeLog] = []
        self.overhead_s = 0.0  # the losing sides' time beyond the winner's rate, every probe together
        self.probe_s = 0.0  # device time of every measured probe batch (all of it real work)
        self.probe_batches = 0
        self.budget_s = 0.0
        self.rate: float | None = None  # the current shape's tokens/s as last measured
        self._skipped_for_budget = 0
        if self.rows is not None and self.tokens is not None:  # the user's numbers: nothing to probe
            self.axis, self.values, self.index = "fixed", [0], 0
        elif self.tokens is None:  # the token budget is probed; rows follow it, or are the user's
            self.axis = "tokens"
            low, start, high = LADDERS.get(device.type, LADDERS["cuda"])
            self.values = [2**k for k in range(low.bit_length() - 1, high.bit_length())]
            self.index = self.values.index(start)
        else:  # the user fixed the token budget: the rows cap is probed
            self.axis = "rows"
            top = min(MAX_ROWS, self.tokens)
            self.values = [2**k for k in range(top.bit_length())]
            self.index = max(k for k, v in enumerate(self.values) if v <= max(1, self.tokens // ROW_TOKENS))
        self.state = "fixed" if self.axis == "fixed" else "warmup"
        self._pending = ""  # what the batch being run is for: warmup, I, C, run
        self._schedule: list[str] = []
        self._candidate = self.index
        self._direction = 1
        self._moved = False
        self._switched = False
        self._sides: dict[str, ShapeTimes] = {}
        self._window: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._unresolved: deque[tuple[Lap, int]] = deque()
        self._memory_before = 0
        self._warmup_shape = self.current
        self._reference_length = 0  # the longest sample when the shape was last probed
        self._blocked: int | None = None  # a neighbour that cut the same batches as the shape: tried once they differ

    # --- what the engine calls ---------------------------------------------------------------

    @property
    def auto(self) -> bool:
        return self.axis != "fixed"

    @property
    def current(self) -> Shape:
        return self.shape(self.index)

    def shape(self, index: int) -> Shape:
        if self.axis == "fixed":
            rows, tokens = self.rows, self.tokens
        elif self.axis == "tokens":
            tokens = self.values[index]
            rows = self.rows if self.rows is not None else max(1, min(MAX_ROWS, tokens // ROW_TOKENS))
        else:
            rows, tokens = self.values[index], self.tokens
        assert rows is not None and tokens is not None
        if self.cap is not None and tokens > self.cap:
            tokens = self.cap
            if self.axis == "tokens" and self.rows is None:
                rows = max(1, min(MAX_ROWS, tokens // ROW_TOKENS))
        return Shape(rows, tokens)

    def next_shape(self) -> tuple[Shape, bool]:
        """The shape of the next batch, and whether its time must be read before the one after it is cut."""
        if self.state == "compare":
            side = self._schedule[0]
            self._pending = side
            return self.shape(self._candidate if side == "C" else self.index), True
        self._pending = self.state
        if self.state == "warmup":
            self._warmup_shape = self.current
            if self.device.type == "cuda":
                self._memory_before = torch.cuda.memory_allocated(self.device)
        return self.current, self.state == "warmup" or (self.state == "run" and self.device.type == "mps")

    def record(self, batch: Batch, lap: Lap) -> None:
        """A batch cut with the shape `next_shape` gave has run."""
        pending, self._pending = self._pending, ""
        if pending == "warmup":
            self._after_warmup(batch, lap)
        elif pending in ("I", "C"):
            self._after_compare_batch(pending, batch, lap)
        elif pending == "run":
            self._monitor(batch, lap)

    def record_unplanned(self) -> None:
        """A batch that no shape chose ran (a piece of a batch split after an out-of-memory error)."""
        self._pending = ""

    def out_of_memory(self, batch: Batch, used: Shape) -> int:
        """A batch cut with ``used`` did not fit: lower the token budget for the rest of the run (as a
        fixed shape always did) and return it. A comparison under way is given up; its candidate lost."""
        cap = max(batch.longest, min(used.max_batch_tokens, batch.computed_tokens // 2))
        self.cap = cap if self.cap is None else min(self.cap, cap)
        self.cap_reason = "out of memory"
        pending, self._pending = self._pending, ""
        if self.state == "compare" and pending in ("I", "C"):
            probe = self.probes[-1]
            probe.steps.append(
                {
                    "incumbent": str(self.current),
                    "candidate": str(self.shape(self._candidate)),
                    "result": "out of memory",
                }
            )
            self._next_step(candidate_lost=pending == "C" or self._candidate > self.index)
        # during the warm-up: the next batch, cut under the lowered budget, warms up again
        return self.cap

    def summary(self) -> BatchShapeSummary:
        table = [row for probe in self.probes for row in probe.rows()]
        modes = {"fixed": "fixed", "tokens": "auto" if self.rows is None else "auto max_batch_tokens"}
        return BatchShapeSummary(
            mode=modes.get(self.axis, "auto batch_size"),
            batch_size=self.current.batch_size,
            max_batch_tokens=self.current.max_batch_tokens,
            probes=tuple(p.record() for p in self.probes),
            probe_table=tuple(table),
            probe_batches=self.probe_batches,
            probe_s=round(self.probe_s, 4),
            probe_overhead_s=round(self.overhead_s, 4),
            probe_budget_s=round(self.budget_s, 4),
            probes_skipped_for_budget=self._skipped_for_budget,
            token_cap=self.cap,
            token_cap_reason=self.cap_reason or None,
        )

    # --- the probe ----------------------------------------------------------------------------

    def _after_warmup(self, batch: Batch, lap: Lap) -> None:
        seconds = lap.seconds(block=True) or 0.0
        self.probe_s += seconds
        self.probe_batches += 1
        self.rate = batch.real_tokens / seconds if seconds > 0 else None
        if self.device.type == "cuda" and self.axis == "tokens":
            self._bound_by_free_memory(batch)
        warmed = ShapeTimes()
        if seconds > 0:  # the first batch goes in the table, as the first measurement of the starting shape
            warmed.add(batch.real_tokens, seconds)
        self._start_probe("start of the shard run", warmed=(self._warmup_shape, warmed))

    def _bound_by_free_memory(self, batch: Batch) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        per_token = max(1.0, (peak - self._memory_before) / max(1, batch.computed_tokens))
        free, _total = torch.cuda.mem_get_info(self.device)
        available = free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        bound = int(available * (1 - MEMORY_MARGIN) / per_token)
        if bound < self.values[-1] and (self.cap is None or bound < self.cap):
            self.cap = max(self.values[0], bound)
            self.cap_reason = f"free device memory ({available / 2**30:.1f} GiB, {per_token / 2**10:.0f} KiB/token)"

    def _start_probe(self, reason: str, direction: int = 1, warmed: tuple[Shape, ShapeTimes] | None = None) -> None:
        self.probes.append(ProbeLog(len(self.probes), reason, self.order.next_length))
        if warmed is not None and warmed[1].batches:
            self.probes[-1].shapes[warmed[0]] = warmed[1]
        self._reference_length = self.order.next_length
        self._blocked = None
        self._direction, self._moved, self._switched = direction, False, direction == -1
        self._candidate = self.index
        self._begin_step()

    def _begin_step(self) -> None:
        """Start comparing the incumbent with its next neighbour, or end the probe."""
        while True:
            candidate = self.index + self._direction
            reason = self._unusable(candidate)
            first_same = candidate if reason == SAME_BATCHES else None
            while reason == SAME_BATCHES:  # skip to the first neighbour that cuts other batches
                candidate += self._direction
                reason = self._unusable(candidate)
            if first_same is not None and reason is not None:
                self._blocked, reason = first_same, SAME_BATCHES  # tried again once its batches differ
            if reason is None:
                if not self._affordable(candidate):
                    self._finish("time budget")
                    return
                self._candidate = candidate
                self._schedule = ["I"] + ["C"] * self.batches_per_side + ["I"] * (self.batches_per_side - 1)
                self._sides = {"I": ShapeTimes(), "C": ShapeTimes()}
                self.state = "compare"
                return
            if self._direction == 1 and not self._moved and not self._switched:
                self._direction, self._switched = -1, True
                continue
            self._finish(reason)
            return

    def _unusable(self, candidate: int) -> str | None:
        if not 0 <= candidate < len(self.values):
            return "end of the candidates"
        if not len(self.order):
            return "no samples left"
        shape, incumbent = self.shape(candidate), self.current
        if shape == incumbent:
            return f"token budget capped at {self.cap:,} ({self.cap_reason})"
        if len(self.order.peek(shape.batch_size, shape.max_batch_tokens).rows) == len(
            self.order.peek(incumbent.batch_size, incumbent.max_batch_tokens).rows
        ):
            return SAME_BATCHES
        return None

    def _affordable(self, candidate: int) -> bool:
        """Whether the worst case of one more step still fits the run's probe budget."""
        if not self.rate:
            return True
        self.budget_s = self.budget_fraction * self.run_tokens / self.rate
        shape = self.shape(candidate)
        upcoming = self.order.peek(shape.batch_size, shape.max_batch_tokens).real_tokens * self.batches_per_side
        return self.overhead_s + WORST_CASE_LOSS * upcoming / self.rate <= self.budget_s

    def _after_compare_batch(self, side: str, batch: Batch, lap: Lap) -> None:
        seconds = lap.seconds(block=True) or 0.0
        self.probe_s += seconds
        self.probe_batches += 1
        self._sides[side].add(batch.real_tokens, seconds)
        shape = self.shape(self._candidate if side == "C" else self.index)
        self.probes[-1].shapes.setdefault(shape, ShapeTimes()).add(batch.real_tokens, seconds)
        self._schedule.pop(0)
        incumbent, candidate = self._sides["I"], self._sides["C"]
        clear_loss = side == "C" and incumbent.rate and candidate.rate < CLEAR_LOSS * incumbent.rate
        if not self._schedule or not len(self.order) or clear_loss or self._over_budget(side):
            self._decide()

    def _over_budget(self, side: str) -> bool:
        """A losing candidate has already cost the rest of the budget: decide now rather than finish its side."""
        incumbent, candidate = self._sides["I"], self._sides["C"]
        if side != "C" or not incumbent.rate or not self.budget_s:
            return False
        return self.overhead_s + candidate.seconds - candidate.tokens / incumbent.rate > self.budget_s

    def _decide(self) -> None:
        incumbent, candidate = self._sides["I"], self._sides["C"]
        if not incumbent.batches or not candidate.batches or not incumbent.rate or not candidate.rate:
            self._finish("no samples left")
            return
        ratio = candidate.rate / incumbent.rate
        won = ratio > 1 + MIN_GAIN
        winner, loser = (candidate, incumbent) if won else (incumbent, candidate)
        self.overhead_s += max(0.0, loser.seconds - loser.tokens / winner.rate)
        self.probes[-1].steps.append(
            {
                "incumbent": str(self.current),
                "candidate": str(self.shape(self._candidate)),
                "incumbent_tokens_per_s": round(incumbent.rate, 1),
                "candidate_tokens_per_s": round(candidate.rate, 1),
                "ratio": round(ratio, 3),
                "result": "moved" if won else "stayed",
            }
        )
        self.rate = winner.rate
        if won:
            self.index, self._moved = self._candidate, True
        self._next_step(candidate_lost=not won)

    def _next_step(self, candidate_lost: bool) -> None:
        if candidate_lost and (self._moved or self._switched or self._direction == -1):
            self._finish("the next step was slower")
            return
        if candidate_lost:
            self._direction, self._switched = -1, True
        self._begin_step()

    def _finish(self, why: str) -> None:
        probe = self.probes[-1]
        probe.chosen, probe.ended = self.current, why
        self.state = "run"
        self._window.clear()
        self._unresolved.clear()
        if probe.number > 0 and not probe.steps:
            self._report(f"{self.shard}: batch shape kept at {self.current}: {probe.reason}; not probed again: {why}.")
            return
        totals = (self.probe_s, self.overhead_s, self.budget_s)
        self._report(probe_message(self.shard, probe.record(), probe.rows(), *totals))

    # --- after the probe: watch for the throughput dropping or the lengths changing ----------------

    def _monitor(self, batch: Batch, lap: Lap) -> None:
        self._unresolved.append((lap, batch.real_tokens))
        while self._unresolved:
            seconds = self._unresolved[0][0].seconds(block=False)
            if seconds is None:
                break
            self._window.append((self._unresolved.popleft()[1], seconds))
        if not len(self.order):
            return
        reason, rate, direction = None, None, 1
        started = self._reference_length
        if len(self._window) == WINDOW and self.rate:
            rates = [t / s for t, s in self._window if s > 0]  # the median: one slow batch is noise, not a drop
            rate = float(statistics.median(rates)) if rates else self.rate
            if rate < DROP * self.rate:
                reason = f"throughput dropped to {rate:,.0f} tokens/s, {rate / self.rate:.0%} of the probe's"
        if reason is None and started and self.order.next_length <= LENGTH_CHANGE * started:
            reason = f"the longest sample left is {self.order.next_length} tokens, {started} at the last probe"
        if reason is None and self._blocked is not None and self._unusable(self._blocked) is None:
            reason = f"{self.shape(self._blocked)} now cuts other batches than {self.current}"
            direction = 1 if self._blocked > self.index else -1
        if reason is None:
            return
        if self.order.remaining_tokens < 4 * self.batches_per_side * self.current.max_batch_tokens:
            return  # too little left to gain anything
        self._start_probe(reason, direction)
        if self.state == "run" and not self.probes[-1].steps:  # nothing could be tried: ask again after a change
            if self.probes.pop().ended == "time budget":
                self._skipped_for_budget += 1
            self._reference_length = self.order.next_length
            self.rate = rate or self.rate
