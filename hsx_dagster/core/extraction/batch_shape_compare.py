"""One step of the batch shape probe, and what probing may cost: `Comparison` times the incumbent shape and a
candidate on alternating batches and says which is faster; `ProbeBudget` keeps the cost of every probe of a
run within its share of the run, spent where the choices run. Both only count: `BatchShaper` (batch_shape.py)
decides what to compare and when. No wall clock here: the seconds come from the device's timer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hsx_dagster.core.extraction.batch_shape_states import BatchRole
from hsx_dagster.core.extraction.batch_shape_summary import ShapeTimes

MIN_GAIN = 0.03  # a step is taken when the candidate is faster by more than this
UNSURE = 0.15  # a comparison closer than this is run once more, by as many batches again, where the budget allows
CLEAR_LOSS = 0.7  # a candidate this much slower on its first batch has lost: its second batch is not run
WORST_CASE_LOSS = 0.5  # a step is started only if losing half of the candidate's time still fits the budget
LATER_SHARE = 0.0  # of the budget of the samples after the lengths a probe decides for, what it may spend


@dataclass
class Comparison:
    """Incumbent (I) and candidate (C) on alternating batches: I, C, C, I with two a side (the schedule holds
    each batch's `BatchRole`). Neighbours in the length order and in time, so neither the shrinking lengths of a
    length-sorted shard nor a moment of load on the machine favours one side."""

    per_side: int
    schedule: list[BatchRole] = field(default_factory=list)
    sides: dict[BatchRole, ShapeTimes] = field(
        default_factory=lambda: {BatchRole.INCUMBENT: ShapeTimes(), BatchRole.CANDIDATE: ShapeTimes()}
    )
    extended: bool = False

    def __post_init__(self) -> None:
        self.schedule = self.schedule or self._round()

    def _round(self) -> list[BatchRole]:
        incumbent, candidate = BatchRole.INCUMBENT, BatchRole.CANDIDATE
        return [incumbent] + [candidate] * self.per_side + [incumbent] * (self.per_side - 1)

    @property
    def incumbent(self) -> ShapeTimes:
        return self.sides[BatchRole.INCUMBENT]

    @property
    def candidate(self) -> ShapeTimes:
        return self.sides[BatchRole.CANDIDATE]

    def add(self, side: BatchRole, tokens: int, seconds: float) -> None:
        self.sides[side].add(tokens, seconds)
        self.schedule.pop(0)

    @property
    def ratio(self) -> float | None:
        """Candidate tokens/s over the incumbent's; None until both sides ran."""
        if not self.incumbent.rate or not self.candidate.rate:
            return None
        return self.candidate.rate / self.incumbent.rate

    def clear_loss(self, side: BatchRole) -> bool:
        """The candidate's batch just ran so much slower that a second one would tell nothing new."""
        ratio = self.ratio
        return side is BatchRole.CANDIDATE and ratio is not None and ratio < CLEAR_LOSS

    def candidate_loss_s(self) -> float:
        """What the candidate's batches took beyond the incumbent's rate so far."""
        if not self.incumbent.rate:
            return 0.0
        return max(0.0, self.candidate.seconds - self.candidate.tokens / self.incumbent.rate)

    def won(self) -> bool:
        ratio = self.ratio
        return ratio is not None and ratio > 1 + MIN_GAIN

    def loss_s(self) -> float:
        """What the losing side took beyond what the winner would have needed for the same tokens."""
        winner, loser = (self.candidate, self.incumbent) if self.won() else (self.incumbent, self.candidate)
        return max(0.0, loser.seconds - loser.tokens / winner.rate) if winner.rate else 0.0

    def extend_if_close(self, spent_s: float, budget_s: float, upcoming_tokens: int) -> bool:
        """Run the comparison once more when, at its end, it is closer than UNSURE: two batches a side tell a few
        percent from noise badly, and a close call is cheap to extend, the loser losing little per batch.
        ``upcoming_tokens``: the candidate's next batch; ``spent_s`` of ``budget_s`` are spent already."""
        ratio = self.ratio
        if self.extended or self.schedule or ratio is None or abs(ratio - 1) >= UNSURE:
            return False
        worst = UNSURE * upcoming_tokens * self.per_side / self.incumbent.rate
        if spent_s + self.candidate_loss_s() + worst > budget_s:
            return False
        self.extended = True
        self.schedule = self._round()
        return True


@dataclass
class ProbeBudget:
    """BUDGET_FRACTION of the run's estimated time (at the rate measured last) for every probe together, spent
    where the choices run: by the end of the lengths a probe decides for (until the longest sample halves), the
    probes may have cost that share of the time of every token up to there. So the few long samples at the head
    of a shard cannot use up what its bulk is probed with. A step may draw on the whole run's budget instead
    where it is likely to pay beyond its lengths (`BatchShaper` says when)."""

    fraction: float
    run_tokens: int
    spent_s: float = 0.0  # the losing sides' time beyond the winner's rate, every probe together
    allowed_s: float = 0.0  # what the probes may have cost by the end of the current probe's lengths

    def run_s(self, rate: float | None) -> float:
        return self.fraction * self.run_tokens / rate if rate else 0.0

    def allows(self, rate: float | None, remaining: int, ahead: int, upcoming_tokens: int, whole_run: bool) -> bool:
        """Whether the worst case of a step on ``upcoming_tokens`` fits. ``remaining`` tokens are left in the run,
        ``ahead`` of them in the lengths the probe decides for."""
        if not rate:
            return True
        later = 1.0 if whole_run else LATER_SHARE
        covered = self.run_tokens - remaining + ahead + later * (remaining - ahead)
        self.allowed_s = self.fraction * covered / rate
        return self.spent_s + WORST_CASE_LOSS * upcoming_tokens / rate <= self.allowed_s

    def exhausted_by(self, comparison: Comparison) -> bool:
        """A losing candidate has already cost the rest of the budget: decide now rather than finish its side."""
        return bool(self.allowed_s) and self.spent_s + comparison.candidate_loss_s() > self.allowed_s
