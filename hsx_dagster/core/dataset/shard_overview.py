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
from hsx_dagster.core.units import format_bytes, format_count, format_share

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
    retries: str = ""  # "1/3" (used of the budget), filled in by the Dagster layer

    def with_instance_facts(self, state: str | None, failed_checks: Sequence[str], retries: str) -> ShardRow:
        return replace(self, state=state or self.state, failed_checks=tuple(failed_checks), retries=retries)


def shard_rows(hidden_states_dir: Path, shard_keys: Sequence[str], tokenized_dir: Path) -> list[ShardRow]:
    """One row per shard key, from summaries only: tokenized/summary.json (samples per shard, and each shard file's
    digest: stale or not, shard_status) and each complete shard's complete.json (its totals and last run); only a
    shard not complete yet has its index read. No tokenized id is read (while the files are as summarised)."""
    expected = {}
    if (Path(tokenized_dir) / TOKENIZED_SUMMARY_FILE).is_file():
        expected = {load.shard: load.samples for load in TokenizedSummary.read(tokenized_dir).shards}
    states = shard_status(hidden_states_dir, shard_keys, tokenized_dir) if expected else {}
    rows = []
    for shard in shard_keys:
        folder = Path(hidden_states_dir) / shard
        state = states.get(shard, "missing")
        row = ShardRow(shard, STATE_WORDS[state], 0, expected.get(shard, 0), 0, 0)
        complete = _read_complete(folder)
        if complete is not None:
            row = _with_complete(row, complete, folder)
        elif state != "missing":
            totals = shard_totals(folder)
            row = replace(
                row,
                samples=totals.samples,
                tokens=totals.tokens,
                bytes=totals.bytes,
                quarantined=len(read_quarantine(folder)),
            )
        rows.append(row)
    return rows


def _read_complete(folder: Path) -> dict | None:
    """complete.json, None when the shard has none (or its folder is not a folder: the table never fails on it)."""
    try:
        return json.loads((folder / COMPLETE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _with_complete(row: ShardRow, complete: dict, folder: Path) -> ShardRow:
    """A complete shard's totals and last run, as complete.json records them (removed before its index changes);
    from the index where an older complete.json lacks a total."""
    if all(key in complete for key in ("samples", "tokens", "bytes")):
        samples, tokens, size = complete["samples"], complete["tokens"], complete["bytes"]
    else:
        totals = shard_totals(folder)
        samples, tokens, size = totals.samples, totals.tokens, totals.bytes
    # the current samples set aside; an older complete.json without the count: the quarantine log's lines
    quarantined = complete["quarantined"] if "quarantined" in complete else len(read_quarantine(folder))
    row = replace(row, samples=samples, tokens=tokens, bytes=size, quarantined=quarantined)
    if "last_run" not in complete:
        return row
    run = ExtractionReport.from_dict(complete["last_run"])
    if not run.samples:  # a run that found everything done says nothing about speed
        return replace(row, device=run.device)
    return replace(
        row, tokens_per_s=run.tokens_per_s, forward_share=run.forward_share, elapsed_s=run.elapsed_s, device=run.device
    )


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


STATE_COLUMNS = ("shard", "state", "samples", "size", "retries")  # the UI's two tables, each narrow enough for
SPEED_COLUMNS = ("shard", "tokens/s", "forward", "device", "failed checks")  # the metadata column at 1,600 px
RIGHT_ALIGNED = {"samples", "size", "tokens/s", "forward", "retries"}


def readable_rows(rows: Sequence[ShardRow]) -> list[dict[str, str]]:
    """The rows as short strings, one column per quantity (the Dagster layer's columns empty without it)."""
    return [
        {
            "shard": r.shard,
            "state": r.state,
            "samples": f"{format_count(r.samples)}/{format_count(r.samples_total)}",
            "size": format_bytes(r.bytes) if r.bytes else "",
            "tokens/s": format_count(r.tokens_per_s) if r.tokens_per_s is not None else "",
            "forward": format_share(r.forward_share) if r.forward_share is not None else "",
            "device": r.device,
            "failed checks": ", ".join(name.removeprefix("shard_") for name in r.failed_checks),
            "retries": r.retries,
        }
        for r in rows
    ]


def totals_row(rows: Sequence[ShardRow]) -> dict[str, str]:
    timed = [r for r in rows if r.elapsed_s]
    return {
        "shard": "total",
        "state": f"{sum(r.state == 'complete' for r in rows)} of {len(rows)} complete",
        "samples": f"{format_count(sum(r.samples for r in rows))}/{format_count(sum(r.samples_total for r in rows))}",
        "size": format_bytes(sum(r.bytes for r in rows)),
        # shards run side by side on their own devices: their speeds add up
        "tokens/s": format_count(sum(r.tokens_per_s or 0.0 for r in timed)) if timed else "",
        "forward": "",
        "device": "",
        "failed checks": f"{sum(bool(r.failed_checks) for r in rows)} shards" if any(r.retries for r in rows) else "",
        "retries": "",
    }


def markdown_table(rows: Sequence[ShardRow], columns: Sequence[str]) -> str:
    """``columns`` of the per-shard table with its totals row, as Markdown (rendered in the UI's metadata column)."""
    body = [*readable_rows(rows), totals_row(rows)]
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if c in RIGHT_ALIGNED else "---" for c in columns) + "|",
    ]
    for entry in body:
        # no breaks inside a value: "not started", "shard-00" (a non-breaking hyphen) stay on one line
        cells = [entry[c].replace(" ", "\u00a0").replace("-", "\u2011") for c in columns]
        if entry is body[-1]:
            cells = [f"**{cell}**" if cell else "" for cell in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text_table(rows: Sequence[ShardRow], columns: Sequence[str], indent: str = "    ") -> list[str]:
    """The same table as aligned text lines (the report), the totals last."""
    body = [*readable_rows(rows), totals_row(rows)]
    widths = {c: max(len(c), *(len(entry[c]) for entry in body)) for c in columns}
    align = {c: (str.rjust if c in RIGHT_ALIGNED else str.ljust) for c in columns}
    lines = [indent + "  ".join(align[c](c, widths[c]) for c in columns).rstrip()]
    lines += [indent + "  ".join(align[c](entry[c], widths[c]) for c in columns).rstrip() for entry in body]
    return lines
