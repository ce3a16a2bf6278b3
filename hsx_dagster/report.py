"""A one-screen summary of what the pipeline has produced: `python -m hsx_dagster.report`.

Reads only the output files (no Dagster instance, no model), so it also works on a copy of the
outputs on another machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hsx_dagster.core.settings import SettingsError, load_settings
from hsx_dagster.core.tokenization import TokenizedSummary


def summary_lines(settings_file: str | None = None) -> list[str]:
    settings = load_settings(settings_file)
    out = settings.output_dir
    lines = [
        f"settings      {settings.source}",
        f"model         {settings.model.path}  (layers {settings.layer_ids} of {settings.num_model_layers})",
        f"outputs       {out}",
    ]
    tokenized = settings.tokenized_dir
    if not (tokenized / "summary.json").is_file():
        lines.append(f"tokenized     not materialized yet ({tokenized})")
        return lines
    summary = TokenizedSummary.read(tokenized)
    mean = summary.tokens / summary.samples if summary.samples else 0
    lines += [
        f"tokenized     {tokenized}",
        f"  samples     {summary.samples:,} from {sum(i['records'] for i in summary.inputs):,} records "
        f"in {len(summary.inputs)} files; {summary.rejected} rejected, {summary.truncated} truncated",
        f"  tokens      {summary.tokens:,} (mean {mean:.0f}/sample), {summary.loss_tokens:,} supervised "
        f"({summary.loss_tokens / max(summary.tokens, 1):.0%})",
        f"  speed       {summary.conversations_per_s:,.0f} conversations/s ({summary.elapsed_s:.1f} s)",
        f"  shards      {len(summary.shards)}, token imbalance max/mean {summary.imbalance:.4f}",
    ]
    for shard in summary.shards:
        lines.append(f"    {shard['shard']}  {shard['samples']:>7,} samples  {shard['tokens']:>11,} tokens")
    if summary.rejects:
        lines.append("  rejects     " + ", ".join(f"{reason} {count}" for reason, count in summary.rejects.items()))
        lines.append(f"              details: {tokenized / 'rejects.parquet'}")
    widest = max((b["samples"] for b in summary.histogram), default=1) or 1
    lines.append("  lengths")
    for bucket in summary.histogram:
        bar = "#" * round(40 * bucket["samples"] / widest)
        lines.append(f"    {bucket['min']:>6}-{bucket['max']:<6} {bucket['samples']:>6}  {bar}")
    for name, folder in (("hidden_states", settings.hidden_states_dir), ("drafter", settings.drafter_dir)):
        present = folder.is_dir() and any(folder.iterdir())
        lines.append(f"{name:<13} {folder if present else f'not materialized yet ({folder})'}")
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
