"""Where the batch shape probe may go: the token budgets and row caps it tries on each kind of device, where
it starts, and which part of the run's probe budget a probe may spend.

A shape is a point of a grid of two axes, both powers of two: the token budget (most computed tokens in one
forward pass) and the rows cap (most rows). For the next batch only one of them binds: the token budget for
rows longer than budget / rows, the rows cap for shorter ones. A fixed setting is an axis of one value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hsx_dagster.core.extraction.batch_shape_summary import Shape

ROW_TOKENS = 32  # the rows cap a token budget starts with where nothing else is known: budget // ROW_TOKENS
MAX_ROWS = 4096
# Token budgets tried per device kind: (smallest, largest), powers of two.
LADDERS = {"cpu": (2**8, 2**15), "mps": (2**10, 2**16), "cuda": (2**12, 2**19)}
# Where both settings `auto` start (token budget, rows cap). On a GPU, large batches from the start (rows hardly ever
# cap them). On a CPU the work of a forward pass is split over its threads, and each thread is fastest with about
# 4K tokens in at most 8 rows (more runs out of cache: with one thread the demo's hybrid model ran 25K tokens/s at
# 4K tokens per batch and 12-17K at 16-32K; fewer leaves the per-pass overhead, which one thread pays, unshared):
# 8,192 x 16 with 2 threads, the fastest shape of the sweep in docs/benchmarks.md on two CPUs.
STARTS = {"mps": (2**13, 2**8), "cuda": (2**15, 2**10)}
CPU_TOKENS_PER_THREAD, CPU_ROWS_PER_THREAD = 2**12, 8
Axis = Literal["tokens", "rows"]  # the token budget, the rows cap
AXES: tuple[Axis, ...] = ("tokens", "rows")
AXIS_NAMES: dict[Axis, str] = {"tokens": "token budget", "rows": "rows cap"}
# Beside a probed token budget, the rows cap is probed where the token budget alone takes at least this many rows:
# on a few long rows a lower cap cuts the batches as a smaller token budget would, but it caps the short rows of
# the bulk too, which are nothing like them (a cap of 2 rows found at the head of a shard cuts its bulk in 2s).
ROWS_TO_PROBE = 8

Position = tuple[int, int]  # (token budget index, rows cap index) in a grid


def start_shape(device_type: str, threads: int) -> tuple[int, int]:
    """(token budget, rows cap) both settings `auto` start with on a device of ``device_type`` (a CPU: with
    ``threads`` threads)."""
    if device_type != "cpu":
        return STARTS.get(device_type, STARTS["cuda"])
    low, high = LADDERS["cpu"]
    tokens = min(high, max(low, _power_of_two_at_most(CPU_TOKENS_PER_THREAD * max(1, threads))))
    return tokens, min(MAX_ROWS, _power_of_two_at_most(CPU_ROWS_PER_THREAD * max(1, threads)))


def _power_of_two_at_most(value: int) -> int:
    return 2 ** (max(1, value).bit_length() - 1)


def powers_of_two(low: int, high: int) -> list[int]:
    return [2**k for k in range(max(0, low.bit_length() - 1), high.bit_length())]


@dataclass(frozen=True)
class Grid:
    """The shapes a run may use: ``tokens`` x ``rows`` (one value each where the user fixed it)."""

    tokens: tuple[int, ...]
    rows: tuple[int, ...]
    start: Position  # (token index, rows index)

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The probed axes, in the order AXES gives them."""
        return tuple(axis for axis, values in zip(AXES, (self.tokens, self.rows)) if len(values) > 1)

    def size(self, axis: Axis) -> int:
        return len(self.tokens if axis == "tokens" else self.rows)

    def shape(self, position: Position, cap: int | None = None) -> Shape:
        tokens = self.tokens[position[0]]
        if cap is not None:
            tokens = min(tokens, cap)
        return Shape(self.rows[position[1]], tokens)

    @staticmethod
    def step(position: Position, axis: Axis, by: int) -> Position:
        return (position[0] + by, position[1]) if axis == "tokens" else (position[0], position[1] + by)

    def inside(self, position: Position) -> bool:
        return 0 <= position[0] < len(self.tokens) and 0 <= position[1] < len(self.rows)

    @classmethod
    def of(
        cls, rows: int | None, tokens: int | None, device_type: str, threads: int = 1, start: Shape | None = None
    ) -> Grid:
        """The grid for the user's settings (None: auto) on a device of ``device_type`` (``threads``: a CPU's),
        starting from ``start`` where given (powers of two), else from the device's `start_shape`."""
        low, high = LADDERS.get(device_type, LADDERS["cuda"])
        first_tokens, first_rows = (
            (start.max_batch_tokens, start.batch_size) if start else start_shape(device_type, threads)
        )
        if rows is not None and tokens is not None:
            return cls((tokens,), (rows,), (0, 0))
        if tokens is not None:  # the user fixed the token budget: only the rows cap is probed
            values = tuple(powers_of_two(1, min(MAX_ROWS, tokens)))
            first = max(1, tokens // ROW_TOKENS)
            return cls((tokens,), values, (0, max(k for k, v in enumerate(values) if v <= first)))
        budgets = tuple(powers_of_two(low, high))
        if rows is not None:  # the user fixed the rows cap: only the token budget is probed
            return cls(budgets, (rows,), (budgets.index(first_tokens), 0))
        caps = tuple(powers_of_two(1, MAX_ROWS))
        return cls(budgets, caps, (budgets.index(first_tokens), caps.index(first_rows)))


def binding_axis(shape: Shape, longest: int) -> Axis:
    """Which limit cuts a batch whose longest row is ``longest``: the token budget, or the rows cap."""
    return "tokens" if shape.max_batch_tokens // max(1, longest) <= shape.batch_size else "rows"
