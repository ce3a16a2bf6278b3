"""The states of `BatchShaper` (batch_shape.py) and the events that move it between them, as one table.

A shaper with an ``auto`` setting starts in WARMUP: its first batch runs in the starting shape and is timed (it
warms the model up and, on a GPU, measures the memory a token takes). Then a probe starts and the shaper is in
COMPARE until the probe ends: its batches alternate between the incumbent shape and a candidate, one step after the
other. In RUN the chosen shape cuts every batch, while its throughput and the lengths left are watched; a re-probe
goes back to COMPARE. A shaper with both settings fixed starts in RUN and stays there.

`TRANSITIONS` is the whole of it: `BatchShaper._transition` moves only along its entries and refuses any other.
`BatchRole` says what the batch being run is for, which decides what its timing is used for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hsx_dagster.core.extraction.batch_shape_space import AXIS_NAMES, Axis, Position


class ShaperState(Enum):
    WARMUP = "warmup"  # the first batch of an auto run: timed, then the first probe starts
    COMPARE = "compare"  # a probe is under way: incumbent and candidate on alternating batches
    RUN = "run"  # the chosen shape cuts the batches; a drop in throughput or a change of lengths probes again


class BatchRole(Enum):
    """What the batch being run is for (the shaper's state when `next_shape` cut it, and in COMPARE its side)."""

    WARMUP = "warmup"
    INCUMBENT = "incumbent"  # a comparison's batch cut in the current shape
    CANDIDATE = "candidate"  # a comparison's batch cut in the neighbour it is compared with
    RUN = "run"

    @property
    def compared(self) -> bool:
        return self in (BatchRole.INCUMBENT, BatchRole.CANDIDATE)


class ShaperEvent(Enum):
    WARMUP_RECORDED = "the warm-up batch was timed"
    STEP_STARTED = "a comparison of the incumbent with a neighbour started"
    COMPARISON_EXTENDED = "a close comparison runs once more"
    COMPARISON_DECIDED = "a comparison ended: the probe moved to the candidate or stayed"
    PROBE_FINISHED = "the probe ended: no step left to take"
    OUT_OF_MEMORY = "a batch did not fit the device"
    REPROBE = "the throughput dropped or the lengths changed: probe again"


# (state, event) -> next state. A probe first chooses its next step in COMPARE: when none is left (or none could be
# taken at all) PROBE_FINISHED follows at once, so a probe with nothing to try ends in RUN without running a batch.
# Out of memory lowers the token budget for the rest of the run in every state (BatchShaper.out_of_memory).
TRANSITIONS: dict[tuple[ShaperState, ShaperEvent], ShaperState] = {
    # the run's first probe starts, from the starting shape
    (ShaperState.WARMUP, ShaperEvent.WARMUP_RECORDED): ShaperState.COMPARE,
    # the next batch, cut under the lowered token budget, warms up again
    (ShaperState.WARMUP, ShaperEvent.OUT_OF_MEMORY): ShaperState.WARMUP,
    # each step of the probe: the incumbent against one neighbour, once more where close, then decided
    (ShaperState.COMPARE, ShaperEvent.STEP_STARTED): ShaperState.COMPARE,
    (ShaperState.COMPARE, ShaperEvent.COMPARISON_EXTENDED): ShaperState.COMPARE,
    (ShaperState.COMPARE, ShaperEvent.COMPARISON_DECIDED): ShaperState.COMPARE,
    # a comparison's batch did not fit: the comparison is given up (BatchShaper.out_of_memory); then as after a decision
    (ShaperState.COMPARE, ShaperEvent.OUT_OF_MEMORY): ShaperState.COMPARE,
    (ShaperState.COMPARE, ShaperEvent.PROBE_FINISHED): ShaperState.RUN,
    # from the current shape
    (ShaperState.RUN, ShaperEvent.REPROBE): ShaperState.COMPARE,
    (ShaperState.RUN, ShaperEvent.OUT_OF_MEMORY): ShaperState.RUN,
}


class TransitionError(RuntimeError):
    """An event `TRANSITIONS` has no entry for in the shaper's state: a bug in `BatchShaper`, not in the inputs."""


def next_state(state: ShaperState, event: ShaperEvent) -> ShaperState:
    """The state `TRANSITIONS` gives after ``event`` in ``state``; TransitionError where it gives none."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        allowed = ", ".join(e.name for s, e in TRANSITIONS if s is state)
        raise TransitionError(
            f"batch shaper: {event.name} ({event.value}) cannot happen in state {state.name}; allowed there: {allowed}"
        ) from None


@dataclass
class ProbeWalk:
    """Where the probe under way is: a probe walks the grid one step at a time, along one axis after the other,
    first in the direction the axis last moved in, then the other way; a new probe starts a new walk."""

    candidate: Position  # the neighbour compared with the incumbent (the shaper's ``position``)
    axes: list[Axis] = field(default_factory=list)  # the axes still to try, the current one first
    direction: int = 1  # on the current axis: +1 larger, -1 smaller
    moved: bool = False  # the current axis has moved (a step won)
    switched: bool = False  # the current axis has turned the other way
    ends: list[str] = field(default_factory=list)  # why each axis stopped
    won_last: bool = False  # the last step moved

    def begin_axis(self, momentum: dict[Axis, int]) -> None:
        """Start on the axis now first, in the direction ``momentum`` says it last moved in."""
        self.direction = momentum[self.axes[0]] if self.axes else 1
        self.moved = self.switched = False

    def end_axis(self, why: str, momentum: dict[Axis, int], named: bool) -> None:
        """Stop the current axis for ``why`` (with the axis's name where ``named``), remember in ``momentum`` the
        direction it moved in, and begin the next one."""
        axis = self.axes.pop(0)
        if self.moved:
            momentum[axis] = self.direction
        self.ends.append(f"{AXIS_NAMES[axis]}: {why}" if named else why)
        self.begin_axis(momentum)

    def turn(self) -> None:
        """Try the other direction on the current axis."""
        self.direction, self.switched = -self.direction, True
