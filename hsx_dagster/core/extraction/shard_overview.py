"""Every shard of a dataset at a glance, read from the output files alone: its state, samples, size,
throughput, device and share of time in the forward pass, with totals over all shards.

The Dagster layer adds what only the instance knows (a running shard, failed checks, retries used);
`python -m hsx_dagster.report` prints the same rows. A low forward share is said in words: a device
that spends most of the wall time waiting on the host is the first thing a person watching a
long extraction needs to know.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hsx_dagster.core.dataset.assembly import shard_status
from hsx_dagster.core.extraction.engine import ExtractionReport
from hsx_dagster.core.inputs.tokenized import TokenizedSummary
from hsx_dagster.core.storage.format import COMPLETE_FILE, TOKENIZED_SUMMARY_FILE
from hsx_dagster.core.storage.shard_store import read_quarantine, shard_totals
from hsx_dagster.core.units import format_bytes, format_count, format_duration, format_rate, format_share

LOW_FORWARD_SHARE = 0.5  # below this share of the wall time in the forward pass, the device mostly waits
STATE_WORDS = {"missing": "not started", "incomplete": "incomplete", "complete": "complete", "stale": "stale"}


@dataclass(frozen=True)
class ShardRow:
    shard: str
    state: str  # not started, incomplete, complete, stale; the Dagster layer adds running, failed check, retrying
    samples: int  # committed
    samples_total: int  # in the tokenized shard
    tokens: int
    bytes: int
    quarantined: int = 0
    tokens_per_s: float | None = None  # of the last run that extracted anything
    forward_share: float | None = None
    elapsed_s: float | None = None
    device: str = ""
    failed_checks: tuple[str, ...] = ()
    retries: str = ""  # "1 of 3", filled in by the Dagster layer

    def with_instance_facts(self, state: str | None, failed_checks: Sequence[str], retries: str) -> ShardRow:
        return replace(self, state=state or self.state, failed_checks=tuple(failed_checks), retries=retries)


def shard_rows(hidden_states_dir: Path, shard_keys: Sequence[str], tokenized_dir: Path) -> list[ShardRow]:
    """One row per shard key, from the tokenized summary and each shard's folder."""
    expected = {}
    if (Path(tokenized_dir) / TOKENIZED_SUMMARY_FILE).is_file():
        expected = {load.shard: load.samples for load in TokenizedSummary.read(tokenized_dir).shards}
    states = shard_status(hidden_states_dir, shard_keys, tokenized_dir) if expected else {}
    rows = []
    for shard in shard_keys:
        folder = Path(hidden_states_dir) / shard
        state = states.get(shard, "missing")
        row = ShardRow(shard, STATE_WORDS[state], 0, expected.get(shard, 0), 0, 0)
        if state != "missing":
            totals = shard_totals(folder)
            row = replace(
                row,
                samples=totals.samples,
                tokens=totals.tokens,
                bytes=totals.bytes,
                quarantined=len(read_quarantine(folder)),
            )
        if (folder / COMPLETE_FILE).is_file():
            run = ExtractionReport.from_dict(
                json.loads((folder / COMPLETE_FILE).read_text(encoding="utf-8"))["last_run"]
            )
            if run.samples:  # a run that found everything done says nothing about speed
                row = replace(
                    row,
                    tokens_per_s=run.tokens_per_s,
                    forward_share=run.forward_share,
                    elapsed_s=run.elapsed_s,
                    device=run.device,
                )
            else:
                row = replace(row, device=run.device)
        rows.append(row)
    return rows


def total_line(rows: Sequence[ShardRow]) -> str:
    """``2,760 samples, 1,181,848 tokens, 459.8 MB in 2 of 2 shards complete``."""
    done = sum(row.state == "complete" for row in rows)
    return (
        f"{format_count(sum(r.samples for r in rows))} of {format_count(sum(r.samples_total for r in rows))} samples, "
        f"{format_count(sum(r.tokens for r in rows))} tokens, {format_bytes(sum(r.bytes for r in rows))}; "
        f"{done} of {len(rows)} shards complete"
    )


def low_forward_share_note(rows: Sequence[ShardRow]) -> str | None:
    """A sentence naming the shards whose device spent under LOW_FORWARD_SHARE of the time in the forward pass."""
    low = [r for r in rows if r.forward_share is not None and r.forward_share < LOW_FORWARD_SHARE]
    if not low:
        return None
    named = ", ".join(f"{r.shard} {format_share(r.forward_share or 0.0)}" for r in low)
    return (
        f"Low forward share: {named} of the wall time in the forward pass; the device waited on the host the rest "
        "of the time (tokenised input, copies, writes, or a busy CPU). See docs/operations.md."
    )


def readable_rows(rows: Sequence[ShardRow], with_instance: bool = True) -> list[dict[str, str]]:
    """The rows as short strings, one column per quantity, with a totals row; narrow enough for the UI."""
    out = []
    for r in rows:
        entry = {
            "shard": r.shard,
            "state": r.state,
            "samples": f"{format_count(r.samples)} of {format_count(r.samples_total)}",
            "size": format_bytes(r.bytes) if r.bytes else "",
            "speed": format_rate(r.tokens_per_s, "tok") if r.tokens_per_s is not None else "",
            "forward": format_share(r.forward_share) if r.forward_share is not None else "",
            "device": r.device,
        }
        if with_instance:
            entry["failed checks"] = ", ".join(name.removeprefix("shard_") for name in r.failed_checks)
            entry["retries"] = r.retries
        out.append(entry)
    return out


def totals_row(rows: Sequence[ShardRow], with_instance: bool = True) -> dict[str, str]:
    elapsed = [r.elapsed_s for r in rows if r.elapsed_s]
    tokens = sum(r.tokens for r in rows if r.elapsed_s)
    entry = {
        "shard": "total",
        "state": f"{sum(r.state == 'complete' for r in rows)} of {len(rows)} complete",
        "samples": f"{format_count(sum(r.samples for r in rows))} of "
        f"{format_count(sum(r.samples_total for r in rows))}",
        "size": format_bytes(sum(r.bytes for r in rows)),
        # shards run side by side on their own devices: the speeds add up
        "speed": format_rate(sum(r.tokens_per_s or 0.0 for r in rows), "tok") if elapsed else "",
        "forward": "",
        "device": f"{format_duration(max(elapsed))} longest" if elapsed and tokens else "",
    }
    if with_instance:
        entry["failed checks"] = str(sum(bool(r.failed_checks) for r in rows)) + " shards"
        entry["retries"] = ""
    return entry


def markdown_table(rows: Sequence[ShardRow], with_instance: bool = True) -> str:
    """The per-shard table with its totals row, as Markdown (the Dagster UI renders it in the metadata column)."""
    body = [*readable_rows(rows, with_instance), totals_row(rows, with_instance)]
    columns = list(body[0])
    right = {"samples", "size", "speed", "forward"}
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if c in right else "---" for c in columns) + "|"]
    for entry in body:
        cells = [entry[c].replace(" ", "\u00a0") for c in columns]  # keep "1,380 of 1,380" on one line
        if entry is body[-1]:
            cells = [f"**{cell}**" if cell else "" for cell in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
