"""The batch shape of a shard run: fixed by the user, or found by a short probe on the shard's own batches.

`extraction.batch_size` and `extraction.max_batch_tokens` are ``auto`` by default. A shard run then probes:
its next batches (longest first, so the memory-hungriest ones) are cut with a few candidate shapes, timed
with the device's own clock (CUDA events on a GPU, the wall clock on a CPU), and the shape with the most real
tokens per second is kept. Every probed batch is real work, stored like any other; nothing is computed twice,
and only the shard's pending samples are taken, so a resumed run never redoes a committed sample.

The candidates form a grid of token budgets and rows caps (batch_shape_space.py): the budget binds long rows,
the cap short ones, and a device's best shape is rarely on a line tying one to the other (2-core CPU: 8,192
tokens, at most 16 rows). A probe tries the axis that cuts the next batch first (later probes alternate), one
step at a time, from the direction the axis last moved in, then the other way, while a step is more than 3%
faster; the rows cap only where the token budget alone takes 8 rows or more. Each step compares incumbent and
candidate on alternating batches, run once more when close (batch_shape_compare.py). On a GPU the largest
candidate is bounded by the free memory, with a 20% margin, using the activation bytes per token measured on
the first batch; an out-of-memory error lowers the budget for the rest of the run, whoever chose it.

Lengths change along a length-sorted shard, so the probe runs again, from the current shape, when the
throughput falls well below what the probe measured (under 70% over 8 batches), when the longest sample is
half as long as at the last probe, or when a neighbour that cut the same batches starts to cut others. What
probing costs is the time the losing shapes took beyond what the winner would have needed for the same
tokens: all probes together stay within 3% of the run's estimated time, spent where each choice runs
(`ProbeBudget`); the estimate comes from the probe's own throughput, so on a machine that gets busier the
share of the real run can differ (each shard's metadata shows what was lost). With an explicit number for
one of the two settings, only the other one is probed; with both, nothing is. docs/configuration.md says
why each rule is there.

The shaper's states (warm-up, comparing, running) and the events that move it from one to the next are a table,
`TRANSITIONS` in batch_shape_states.py; every change of state goes through `BatchShaper._transition`.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable

import torch

from hsx_dagster.core.extraction.batch_shape_compare import Comparison, ProbeBudget
from hsx_dagster.core.extraction.batch_shape_space import (
    LADDERS,
    MAX_ROWS,
    ROW_TOKENS,
    ROWS_TO_PROBE,
    Axis,
    Grid,
    Position,
    binding_axis,
    start_shape,
)
from hsx_dagster.core.extraction.batch_shape_states import BatchRole, ProbeWalk, ShaperEvent, ShaperState, next_state
from hsx_dagster.core.extraction.batch_shape_summary import (
    BatchShapeSummary,
    ProbeLog,
    Shape,
    ShapeTimes,
    probe_message,
)
from hsx_dagster.core.extraction.batching import Batch, LengthOrder
from hsx_dagster.core.extraction.timing import Lap
from hsx_dagster.core.settings.choices import parse_auto_or_positive

__all__ = ["BUDGET_FRACTION", "LADDERS", "MAX_ROWS", "ROW_TOKENS", "WINDOW", "BatchShaper", "Shape", "start_shape"]

log = logging.getLogger(__name__)

BATCHES_PER_SIDE = 2  # batches of each side in one comparison (incumbent, candidate, candidate, incumbent)
BUDGET_FRACTION = 0.03  # of the run's estimated time, for the cost of every probe together
MEMORY_MARGIN = 0.2  # share of the free device memory the largest candidate leaves unused
DROP = 0.7  # re-probe when throughput over the last WINDOW batches is under this share of the probe's
WINDOW = 8
LENGTH_CHANGE = 0.5  # re-probe when the longest sample is this share of the one at the last probe
SAME_BATCHES = "same batches as the current shape"


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
        log_line: Callable[[str], None] | None = None,
        shard: str = "",
        start: Shape | None = None,
    ) -> None:
        self.rows = parse_auto_or_positive(batch_size)  # None: auto
        self.tokens = parse_auto_or_positive(max_batch_tokens)
        self.device = device
        self.order = order
        self.batches_per_side = max(1, batches_per_side)
        self._log_line = log_line or log.info
        self.shard = shard
        self.run_tokens = order.remaining_tokens
        self.grid = Grid.of(self.rows, self.tokens, device.type, torch.get_num_threads(), start)
        self.position: Position = self.grid.start
        self.cap: int | None = None  # lowered token budget (out of memory, or the GPU's free memory)
        self.cap_reason = ""
        self.probes: list[ProbeLog] = []
        self.probe_s = 0.0  # device time of every measured probe batch (all of it real work)
        self.probe_batches = 0
        self.budget = ProbeBudget(budget_fraction, self.run_tokens)
        self.rate: float | None = None  # the current shape's tokens/s as last measured
        self._skipped_for_budget = 0
        self._tried_at_start: set[tuple[Axis, int]] = set()  # (axis, direction) the run's first probe has tried
        # a fixed shape has nothing to probe: it runs from the start (batch_shape_states.py has the states)
        self.state = ShaperState.WARMUP if self.grid.axes else ShaperState.RUN
        self._role: BatchRole | None = None  # what the batch being run is for (None: none, or one no shape chose)
        self._walk = ProbeWalk(candidate=self.position)  # the probe under way
        self._momentum: dict[Axis, int] = {axis: 1 for axis in self.grid.axes}  # where each axis last moved
        self._first_axis: Axis | None = None  # the axis the last probe tried first
        self._comparison = Comparison(self.batches_per_side)
        self._window: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._unresolved: deque[tuple[Lap, int]] = deque()
        self._memory_before = 0
        self._warmup_shape = self.current
        self._reference_length = 0  # the longest sample when the shape was last probed
        self._blocked: dict[Axis, Position] = {}  # neighbours that cut the same batches: tried once they differ

    # --- what the engine calls ---------------------------------------------------------------

    @property
    def auto(self) -> bool:
        return bool(self.grid.axes)

    @property
    def current(self) -> Shape:
        return self.shape(self.position)

    def shape(self, position: Position) -> Shape:
        return self.grid.shape(position, self.cap)

    def next_shape(self) -> tuple[Shape, bool]:
        """The shape of the next batch, and whether its time must be read before the one after it is cut."""
        if self.state is ShaperState.COMPARE:
            self._role = self._comparison.schedule[0]
            return self.shape(self._side_position(self._role)), True
        if self.state is ShaperState.WARMUP:
            self._role = BatchRole.WARMUP
            self._warmup_shape = self.current
            if self.device.type == "cuda":
                self._memory_before = torch.cuda.memory_allocated(self.device)
            return self.current, True
        self._role = BatchRole.RUN
        return self.current, self.device.type == "mps"

    def record(self, batch: Batch, lap: Lap) -> None:
        """A batch cut with the shape `next_shape` gave has run."""
        role, self._role = self._role, None
        if role is BatchRole.WARMUP:
            self._after_warmup(batch, lap)
        elif role is not None and role.compared:
            self._after_compare_batch(role, batch, lap)
        elif role is BatchRole.RUN and self.auto:
            self._monitor(batch, lap)

    def record_unplanned(self) -> None:
        """A batch that no shape chose ran (a piece of a batch split after an out-of-memory error)."""
        self._role = None

    def out_of_memory(self, batch: Batch, used: Shape) -> int:
        """A batch cut with ``used`` did not fit: lower the token budget for the rest of the run (as a
        fixed shape always did) and return it. A comparison under way is given up; its candidate lost."""
        cap = max(batch.longest, min(used.max_batch_tokens, batch.computed_tokens // 2))
        self.cap = cap if self.cap is None else min(self.cap, cap)
        self.cap_reason = "out of memory"
        role, self._role = self._role, None
        self._transition(ShaperEvent.OUT_OF_MEMORY)
        if self.state is ShaperState.COMPARE and role is not None and role.compared:
            incumbent, candidate = self.current, self.shape(self._walk.candidate)
            self.probes[-1].steps.append(
                {"incumbent": str(incumbent), "candidate": str(candidate), "result": "out of memory"}
            )
            self._walk.won_last = False
            larger = (
                candidate.max_batch_tokens > incumbent.max_batch_tokens or candidate.batch_size > incumbent.batch_size
            )
            self._next_step(candidate_lost=role is BatchRole.CANDIDATE or larger)
        # during the warm-up: the next batch, cut under the lowered budget, warms up again
        return self.cap

    def summary(self) -> BatchShapeSummary:
        table = [row for probe in self.probes for row in probe.rows()]
        modes = {("tokens", "rows"): "auto", ("tokens",): "auto max_batch_tokens", ("rows",): "auto batch_size"}
        return BatchShapeSummary(
            mode=modes.get(self.grid.axes, "fixed"),
            batch_size=self.current.batch_size,
            max_batch_tokens=self.current.max_batch_tokens,
            probes=tuple(p.record() for p in self.probes),
            probe_table=tuple(table),
            probe_batches=self.probe_batches,
            probe_s=round(self.probe_s, 4),
            probe_overhead_s=round(self.budget.spent_s, 4),
            probe_budget_s=round(self.budget.run_s(self.rate), 4),
            probes_skipped_for_budget=self._skipped_for_budget,
            token_cap=self.cap,
            token_cap_reason=self.cap_reason or None,
        )

    def _transition(self, event: ShaperEvent) -> None:
        """Move to the state TRANSITIONS (batch_shape_states.py) gives; an event it has none for raises."""
        self.state = next_state(self.state, event)

    def _side_position(self, role: BatchRole) -> Position:
        """Where a comparison's batch is cut: at the candidate, or at the incumbent (the current position)."""
        return self._walk.candidate if role is BatchRole.CANDIDATE else self.position

    # --- the probe ----------------------------------------------------------------------------

    def _after_warmup(self, batch: Batch, lap: Lap) -> None:
        seconds = lap.seconds(block=True) or 0.0
        self.probe_s += seconds
        self.probe_batches += 1
        self.rate = batch.real_tokens / seconds if seconds > 0 else None
        if self.device.type == "cuda" and "tokens" in self.grid.axes:
            self._bound_by_free_memory(batch)
        warmed = ShapeTimes()
        if seconds > 0:  # the first batch goes in the table, as the first measurement of the starting shape
            warmed.add(batch.real_tokens, seconds)
        self._transition(ShaperEvent.WARMUP_RECORDED)
        self._start_probe("start of the shard run", warmed=(self._warmup_shape, warmed))

    def _bound_by_free_memory(self, batch: Batch) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        per_token = max(1.0, (peak - self._memory_before) / max(1, batch.computed_tokens))
        free, _total = torch.cuda.mem_get_info(self.device)
        available = free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        bound = int(available * (1 - MEMORY_MARGIN) / per_token)
        if bound < self.grid.tokens[-1] and (self.cap is None or bound < self.cap):
            self.cap = max(self.grid.tokens[0], bound)
            self.cap_reason = f"free device memory ({available / 2**30:.1f} GiB, {per_token / 2**10:.0f} KiB/token)"

    def _start_probe(
        self, reason: str, first: Axis | None = None, warmed: tuple[Shape, ShapeTimes] | None = None
    ) -> None:
        """A probe tries each axis in turn: ``first``, else the one the last probe did not start with, else the
        one that cuts the next batch; each from the direction it last moved in, then the other way if that step
        lost; an axis whose next step does not fit the budget ends there."""
        self.probes.append(ProbeLog(len(self.probes), reason, self.order.next_length))
        if warmed is not None and warmed[1].batches:
            self.probes[-1].shapes[warmed[0]] = warmed[1]
        self._reference_length = self.order.next_length
        self._blocked = {}
        if first is None and self._first_axis is not None:  # the other axis than last time gets the budget first
            first = next((axis for axis in self.grid.axes if axis != self._first_axis), None)
        binding = first or (binding_axis(self.current, self.order.next_length) if len(self.order) else "tokens")
        self._walk = ProbeWalk(candidate=self.position, axes=sorted(self.grid.axes, key=lambda axis: axis != binding))
        self._first_axis = self._walk.axes[0] if self._walk.axes else None
        self._walk.begin_axis(self._momentum)
        self._begin_step()

    def _end_axis(self, why: str) -> None:
        self._walk.end_axis(why, self._momentum, named=len(self.grid.axes) > 1)

    def _begin_step(self) -> None:
        """Start comparing the incumbent with its next neighbour on the current axis, or end the axis and
        go on with the next one, or end the probe."""
        walk = self._walk
        while walk.axes:
            axis = walk.axes[0]
            candidate, reason = self._neighbour(axis, walk.direction)
            if reason is None and not self._affordable(candidate, self._may_spend_all(axis)):
                self._end_axis("time budget")
                continue
            if reason is None:
                if self.probes[-1].number == 0:
                    self._tried_at_start.add((axis, walk.direction))
                walk.candidate = candidate
                self._comparison = Comparison(self.batches_per_side)
                self._transition(ShaperEvent.STEP_STARTED)
                return
            if not walk.moved and not walk.switched:
                walk.turn()
                continue
            self._end_axis(reason)
        stopped = not self.probes[-1].steps and any(end.endswith("time budget") for end in walk.ends)
        self._finish("time budget" if stopped else "; ".join(walk.ends))

    def _neighbour(self, axis: Axis, direction: int) -> tuple[Position, str | None]:
        """The first neighbour along ``axis`` that cuts other batches than the shape, or why there is none;
        a neighbour skipped for cutting the same batches is remembered, to be tried once they differ."""
        if axis == "rows" and "tokens" in self.grid.axes and self._rows_in_budget() < ROWS_TO_PROBE:
            return self.position, f"the token budget fits fewer than {ROWS_TO_PROBE} rows"
        candidate = self.grid.step(self.position, axis, direction)
        reason = self._unusable(candidate)
        first_same = candidate if reason == SAME_BATCHES else None
        while reason == SAME_BATCHES:
            candidate = self.grid.step(candidate, axis, direction)
            reason = self._unusable(candidate)
        if first_same is not None and reason is not None:  # nothing further either: try it once its batches differ
            self._blocked[axis] = first_same
            reason = SAME_BATCHES
        return candidate, reason

    def _rows_in_budget(self) -> int:
        """Rows of the next length the token budget alone would take."""
        return self.current.max_batch_tokens // max(1, self.order.next_length)

    def _unusable(self, candidate: Position) -> str | None:
        if not self.grid.inside(candidate):
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

    def _may_spend_all(self, axis: Axis) -> bool:
        """Whether the next step may spend from the budget of the whole run, not only of the lengths it decides
        for: a step after one that won (a better shape pays off beyond the lengths it was found on), and the
        first step each way on each axis in the run's first probe (the starting shape is a guess)."""
        if self._walk.won_last:
            return True
        return self.probes[-1].number == 0 and (axis, self._walk.direction) not in self._tried_at_start

    def _affordable(self, candidate: Position, whole_run: bool) -> bool:
        """Whether the worst case of one more step fits the probe budget (batch_shape_compare.ProbeBudget)."""
        ahead = self.order.tokens_longer_than(int(LENGTH_CHANGE * self._reference_length))
        return self.budget.allows(
            self.rate, self.order.remaining_tokens, ahead, self._upcoming(candidate) * self.batches_per_side, whole_run
        )

    def _upcoming(self, candidate: Position) -> int:
        """Real tokens of the candidate's next batch."""
        shape = self.shape(candidate)
        return self.order.peek(shape.batch_size, shape.max_batch_tokens).real_tokens

    def _after_compare_batch(self, side: BatchRole, batch: Batch, lap: Lap) -> None:
        seconds = lap.seconds(block=True) or 0.0
        self.probe_s += seconds
        self.probe_batches += 1
        comparison = self._comparison
        comparison.add(side, batch.real_tokens, seconds)
        shape = self.shape(self._side_position(side))
        self.probes[-1].shapes.setdefault(shape, ShapeTimes()).add(batch.real_tokens, seconds)
        over_budget = side is BatchRole.CANDIDATE and self.budget.exhausted_by(comparison)
        if not comparison.schedule or not len(self.order) or comparison.clear_loss(side) or over_budget:
            self._decide()

    def _decide(self) -> None:
        comparison, walk = self._comparison, self._walk
        ratio = comparison.ratio
        if ratio is None:
            self._finish("no samples left")
            return
        if len(self.order) and comparison.extend_if_close(
            self.budget.spent_s, self.budget.allowed_s, self._upcoming(walk.candidate)
        ):
            self._transition(ShaperEvent.COMPARISON_EXTENDED)
            return
        self._transition(ShaperEvent.COMPARISON_DECIDED)
        won = comparison.won()
        self.budget.spent_s += comparison.loss_s()
        self.probes[-1].steps.append(
            {
                "incumbent": str(self.current),
                "candidate": str(self.shape(walk.candidate)),
                "incumbent_tokens_per_s": round(comparison.incumbent.rate, 1),
                "candidate_tokens_per_s": round(comparison.candidate.rate, 1),
                "ratio": round(ratio, 3),
                "result": "moved" if won else "stayed",
                **({"batches_a_side": 2 * comparison.per_side} if comparison.extended else {}),
            }
        )
        self.rate = (comparison.candidate if won else comparison.incumbent).rate
        walk.won_last = won
        if won:
            self.position, walk.moved = walk.candidate, True
        self._next_step(candidate_lost=not won)

    def _next_step(self, candidate_lost: bool) -> None:
        walk = self._walk
        if candidate_lost and (walk.moved or walk.switched):
            self._end_axis("the next step was slower")
        elif candidate_lost:
            walk.turn()
        self._begin_step()

    def _finish(self, why: str) -> None:
        probe = self.probes[-1]
        probe.chosen, probe.ended = self.current, why
        self._transition(ShaperEvent.PROBE_FINISHED)
        self._walk.axes = []
        self._window.clear()
        self._unresolved.clear()
        if probe.number > 0 and not probe.steps:
            self._log_line(
                f"{self.shard}: batch shape kept at {self.current}: {probe.reason}; not probed again: {why}."
            )
            return
        totals = (self.probe_s, self.budget.spent_s, self.budget.run_s(self.rate))
        self._log_line(probe_message(self.shard, probe.record(), probe.rows(), *totals))

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
        reason, rate, first = self._reprobe_reason()
        if reason is None:
            return
        if self.order.remaining_tokens < 4 * self.batches_per_side * self.current.max_batch_tokens:
            return  # too little left to gain anything
        self._transition(ShaperEvent.REPROBE)
        self._start_probe(reason, first)
        if self.state is ShaperState.RUN and not self.probes[-1].steps:  # nothing to try: ask again after a change
            if self.probes.pop().ended == "time budget":
                self._skipped_for_budget += 1
            self._reference_length = self.order.next_length
            self.rate = rate or self.rate

    def _reprobe_reason(self) -> tuple[str | None, float | None, Axis | None]:
        """Why the shape should be probed again (None: it should not), the throughput of the last batches, and
        the axis to try first."""
        rate = None
        if len(self._window) == WINDOW and self.rate:
            rates = [t / s for t, s in self._window if s > 0]  # the median: one slow batch is noise, not a drop
            rate = float(statistics.median(rates)) if rates else self.rate
            if rate < DROP * self.rate:
                return f"throughput dropped to {rate:,.0f} tokens/s, {rate / self.rate:.0%} of the probe's", rate, None
        started = self._reference_length
        if started and self.order.next_length <= LENGTH_CHANGE * started:
            reason = f"the longest sample left is {self.order.next_length} tokens, {started} at the last probe"
            return reason, rate, None
        for axis, blocked in self._blocked.items():
            if self._unusable(blocked) is None:
                k = 0 if axis == "tokens" else 1
                self._momentum[axis] = 1 if blocked[k] > self.position[k] else -1
                return f"{self.shape(blocked)} now cuts other batches than {self.current}", rate, axis
        return None, rate, None
