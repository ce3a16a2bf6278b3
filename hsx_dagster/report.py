"""A one-screen summary of what the pipeline has produced: `python -m hsx_dagster.report`.

Reads only the output files (no Dagster instance, no model), so it also works on a copy of the
outputs on another machine.
"""

from __future__ import annotations

import argparse
import json
import sys

from hsx_dagster.core.dataset import Manifest, low_forward_share_note, shard_rows, text_table, total_line
from hsx_dagster.core.extraction import ExtractionReport, KernelUse, describe_kernels, shape_label
from hsx_dagster.core.inputs import TokenizedSummary
from hsx_dagster.core.settings import SettingsError, load_settings
from hsx_dagster.core.storage import COMPLETE_FILE, MANIFEST_FILE, TOKENIZED_REJECTS_FILE, TOKENIZED_SUMMARY_FILE
from hsx_dagster.core.units import format_bytes, format_count, format_duration, format_share

REPORT_COLUMNS = ("shard", "state", "samples", "size", "tokens/s", "forward", "device")  # no instance here


def summary_lines(settings_file: str | None = None) -> list[str]:
    settings = load_settings(settings_file)
    out = settings.output_dir
    lines = [
        f"settings      {settings.source}",
        f"model         {settings.model.path}  (layers {settings.layer_ids} of {settings.num_model_layers})",
        f"outputs       {out}",
    ]
    tokenized = settings.tokenized_dir
    if not (tokenized / TOKENIZED_SUMMARY_FILE).is_file():
        lines.append(f"tokenized     not materialized yet ({tokenized})")
        return lines
    summary = TokenizedSummary.read(tokenized)
    mean = summary.tokens / summary.samples if summary.samples else 0
    lines += [
        f"tokenized     {tokenized}",
        f"  samples     {summary.samples:,} from {sum(i.records for i in summary.inputs):,} records "
        f"in {len(summary.inputs)} files; {summary.rejected} rejected, {summary.truncated} truncated",
        f"  tokens      {summary.tokens:,} (mean {mean:.0f}/sample), {summary.loss_tokens:,} supervised "
        f"({summary.loss_tokens / max(summary.tokens, 1):.0%})",
        f"  speed       {summary.conversations_per_s:,.0f} conversations/s ({format_duration(summary.elapsed_s)}), "
        f"{format_bytes(summary.bytes_written)} written",
        f"  shards      {len(summary.shards)}, token imbalance max/mean {summary.imbalance:.4f}",
    ]
    for entry in summary.shards:
        lines.append(f"    {entry.shard}  {entry.samples:>7,} samples  {entry.tokens:>11,} tokens")
    if summary.rejects:
        lines.append("  rejects     " + ", ".join(f"{reason} {count}" for reason, count in summary.rejects.items()))
        lines.append(f"              details: {tokenized / TOKENIZED_REJECTS_FILE}")
    widest = max((b.samples for b in summary.histogram), default=1) or 1
    lines.append("  lengths")
    for bucket in summary.histogram:
        bar = "#" * round(40 * bucket.samples / widest)
        lines.append(f"    {bucket.min:>6}-{bucket.max:<6} {bucket.samples:>6}  {bar}")
    lines.append(f"hidden_states {settings.hidden_states_dir}")
    lines += shard_table_lines(settings.hidden_states_dir, settings.shard_keys, tokenized)
    if (settings.drafter_dir / MANIFEST_FILE).is_file():
        manifest = Manifest.read(settings.drafter_dir)
        lines += [
            f"drafter       {settings.drafter_dir}",
            f"  samples     {manifest.samples:,} ({manifest.train_samples:,} train, {manifest.val_samples:,} val), "
            f"{manifest.tokens:,} tokens, {format_bytes(manifest.bytes)}",
            f"  layers      {list(manifest.layers.ids)} (+ final norm: {manifest.layers.include_final}), "
            f"hidden {manifest.hidden_size}, stored as {manifest.storage_dtype}",
            "  load it:",
            "    from hsx_dagster import DrafterDataset, collate_drafter_batch",
            f"    ds = DrafterDataset({str(settings.drafter_dir)!r}, split='train')",
            "    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=4, "
            "collate_fn=collate_drafter_batch)",
        ]
    else:
        lines.append(f"drafter       not materialized yet ({settings.drafter_dir})")
    return lines


def shard_table_lines(hidden_states_dir, shard_keys, tokenized) -> list[str]:
    """The per-shard table the `hidden_states` asset shows (without what only the instance knows), each shard's
    batch shape below it, then the totals and a low forward share in words."""
    rows = shard_rows(hidden_states_dir, shard_keys, tokenized)
    lines = text_table(rows, REPORT_COLUMNS)
    for row in rows:
        complete = hidden_states_dir / row.shard / COMPLETE_FILE
        if complete.is_file():
            recorded = json.loads(complete.read_text("utf-8"))["last_run"]
            shape = batch_shape_lines(ExtractionReport.from_dict(recorded)) + kernel_lines(recorded)
            lines += [f"    {row.shard}:", *shape] if shape else []
    lines.append(f"  total       {total_line(rows)}")
    note = low_forward_share_note(rows)
    if note:
        lines.append(f"  attention   {note}")
    return lines


def kernel_lines(last_run: dict) -> list[str]:
    """The attention and linear-attention implementations a shard's last run used (none: no model loaded)."""
    kernels = last_run.get("kernels")
    if not kernels:
        return []
    uses = [KernelUse(**{**use, "functions": tuple(use["functions"])}) for use in kernels["linear_attention"]]
    return [f"      kernels {describe_kernels(kernels['attention'], uses)}"]


def batch_shape_lines(run: ExtractionReport) -> list[str]:
    """The batch shape of a shard's last run, and its probe table (shape -> tokens/s), indented."""
    shape = run.batch_shape
    if shape is None:
        return []
    head = f"      batch shape {shape_label(shape)}"
    if shape.mode == "fixed":
        return [head]
    lines = [
        f"{head}: {len(shape.probes)} probe(s), {shape.probe_batches} probed batches (stored like any "
        f"other), {format_duration(shape.probe_overhead_s)} lost to slower shapes ({format_share(run.probe_share)} "
        "of the run)"
    ]
    for probe in shape.probes:
        measured = [row for row in shape.probe_table if row.probe == probe.probe]
        table = ", ".join(
            f"{format_count(row.max_batch_tokens)} x {row.batch_size} {format_count(row.tokens_per_s)}"
            + ("*" if row.chosen else "")
            for row in measured
        )
        lines.append(f"        probe {probe.probe} ({probe.reason}): {table or 'nothing compared'} tokens/s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="settings file (default: $HSX_CONFIG or ./hsx.yaml)")
    args = parser.parse_args(argv)
    try:
        print("\n".join(summary_lines(args.config)))
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
