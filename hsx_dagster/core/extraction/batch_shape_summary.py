"""How a shard run's batch shape was chosen: what a probe measures while it runs (`Shape`, `ShapeTimes`,
`ProbeLog`), the typed record made from it (`BatchShapeSummary`), and its renderings.

`BatchShaper` keeps a `ProbeLog` per probe and `BatchShaper.summary` makes the record; it travels in
the run's `ExtractionReport`, is written into the shard's complete.json (``last_run.batch_shape``,
`to_dict`) and read back from there (`from_dict`); the Dagster metadata and the report show it with
`shape_label` and `probe_table_markdown`; `probe_message` is the log line that ends a probe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ProbeRow:
    """One shape as one probe measured it."""

    probe: int
    batch_size: int
    max_batch_tokens: int
    batches: int
    tokens: int
    seconds: float  # device time of its batches
    tokens_per_s: float
    vs_chosen: float | None  # its speed as a share of the shape the probe chose
    chosen: bool


@dataclass(frozen=True)
class ProbeRecord:
    """One probe: why it began, where it started, what it chose and why it stopped."""

    probe: int
    reason: str
    longest_tokens: int  # the longest sample left when it began
    chosen: str | None
    ended: str
    steps: tuple[dict[str, Any], ...]  # each comparison: incumbent, candidate, their rates and the result


@dataclass(frozen=True)
class Shape:
    batch_size: int  # most rows
    max_batch_tokens: int  # most computed tokens (rows x longest row)

    def __str__(self) -> str:
        return f"{self.max_batch_tokens:,} tokens x {self.batch_size} rows"

    @property
    def size(self) -> tuple[int, int]:
        """Sort key: the token budget first, then the rows."""
        return self.max_batch_tokens, self.batch_size


@dataclass
class ShapeTimes:
    """Batches, real tokens and device seconds one shape took (in a comparison, or over a probe)."""

    batches: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.batches += 1
        self.tokens += tokens
        self.seconds += seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ProbeLog:
    """One probe as it runs: every shape it timed, each comparison step, and what it chose."""

    number: int
    reason: str
    started_length: int
    shapes: dict[Shape, ShapeTimes] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    chosen: Shape | None = None
    ended: str = ""

    def rows(self) -> list[ProbeRow]:
        """The probe's shapes, smallest first, as rows of the summary's probe table."""
        best = self.shapes.get(self.chosen) if self.chosen else None
        return [
            ProbeRow(
                probe=self.number,
                batch_size=shape.batch_size,
                max_batch_tokens=shape.max_batch_tokens,
                batches=times.batches,
                tokens=times.tokens,
                seconds=round(times.seconds, 4),
                tokens_per_s=round(times.rate, 1),
                vs_chosen=round(times.rate / best.rate, 3) if best and best.rate else None,
                chosen=shape == self.chosen,
            )
            for shape, times in sorted(self.shapes.items(), key=lambda item: item[0].size)
        ]

    def record(self) -> ProbeRecord:
        chosen = str(self.chosen) if self.chosen else None
        return ProbeRecord(self.number, self.reason, self.started_length, chosen, self.ended, tuple(self.steps))


@dataclass(frozen=True)
class BatchShapeSummary:
    mode: str  # fixed | auto | auto max_batch_tokens | auto batch_size
    batch_size: int  # the shape the run ended with
    max_batch_tokens: int
    probes: tuple[ProbeRecord, ...]
    probe_table: tuple[ProbeRow, ...]
    probe_batches: int  # probed batches (all of them stored like any other)
    probe_s: float  # their device time
    probe_overhead_s: float  # what the slower shapes cost beyond the winner's rate
    probe_budget_s: float
    probes_skipped_for_budget: int
    token_cap: int | None  # a lowered token budget (out of memory, or the GPU's free memory)
    token_cap_reason: str | None

    def to_dict(self) -> dict[str, Any]:
        summary = asdict(self)
        summary["probes"] = [{**probe, "steps": list(probe["steps"])} for probe in summary["probes"]]
        summary["probe_table"] = list(summary["probe_table"])
        return summary

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchShapeSummary:
        return cls(
            **{
                **data,
                "probes": tuple(
                    ProbeRecord(**{**probe, "steps": tuple(probe.get("steps", ()))}) for probe in data["probes"]
                ),
                "probe_table": tuple(ProbeRow(**row) for row in data["probe_table"]),
            }
        )


def shape_label(summary: BatchShapeSummary | None) -> str:
    """``2,048 tokens x 64 rows (auto)``: the shape a run ended with, and how it was chosen."""
    if summary is None:
        return "none (nothing left to extract)"
    return f"{summary.max_batch_tokens:,} tokens x {summary.batch_size} rows ({summary.mode})"


def probe_table_markdown(summary: BatchShapeSummary | None) -> str:
    """The probe table (shape -> tokens/s, one line per shape and probe) and what each probe chose."""
    if summary is None or not summary.probe_table:
        fixed = summary is not None and summary.mode == "fixed"
        return "No probe: " + ("both batch limits are fixed." if fixed else "nothing was extracted.")
    # Seven short columns: the table fits the metadata column of Dagster's asset page at 1,600 px (nine, with
    # the two budgets' setting names as headers, needed a sideways scroll).
    lines = [
        "| probe | tokens\u00a0×\u00a0rows | batches | tokens | device\u00a0time | tokens/s | x\u00a0chosen |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary.probe_table:
        ratio = "**chosen**" if row.chosen else f"{row.vs_chosen:.3f}" if row.vs_chosen is not None else ""
        lines.append(
            f"| {row.probe} | {row.max_batch_tokens:,}\u00a0×\u00a0{row.batch_size:,} | {row.batches} | "
            f"{row.tokens:,} | {row.seconds:.3f}\u00a0s | {row.tokens_per_s:,.0f} | {ratio} |"
        )
    lines.append("")
    for probe in summary.probes:
        lines.append(f"- probe {probe.probe} ({probe.reason}): {probe.chosen}; stopped: {probe.ended}")
    lines.append(
        f"- {summary.probe_batches} probed batches (all stored), {summary.probe_s:.3f} s of device time; "
        f"{summary.probe_overhead_s:.3f} s lost to the slower shapes (budget {summary.probe_budget_s:.3f} s)"
    )
    if summary.token_cap:
        lines.append(f"- token budget capped at {summary.token_cap:,}: {summary.token_cap_reason}")
    return "\n".join(lines)


def probe_message(
    shard: str, probe: ProbeRecord, rows: list[ProbeRow], probe_s: float, overhead_s: float, budget_s: float
) -> str:
    """The log line that ends a probe: each shape's tokens/s, the choice and what probing has cost so far."""
    table = ", ".join(
        f"{row.max_batch_tokens:,} tokens x {row.batch_size} rows: {row.tokens_per_s:,.0f}" for row in rows
    )
    return (
        f"{shard}: batch shape probe {probe.probe} ({probe.reason}): "
        f"{table or 'nothing to compare'} tokens/s -> {probe.chosen} ({probe.ended}); "
        f"probing so far {probe_s:.2f} s of device time, {overhead_s:.2f} s lost to slower shapes "
        f"(budget {budget_s:.2f} s)"
    )
