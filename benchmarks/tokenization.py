"""Throughput of the tokenized_dataset step on the demo conversations: read, render with the chat
template, tokenise, build loss masks, balance into shards and write Parquet (tokenizer load included)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.measure import median
from benchmarks.models import demo_inputs, demo_model
from hsx_dagster.core.inputs.tokenization import TokenizeOptions, tokenize_dataset

COLUMNS = ["sample_id", "input_ids", "loss_mask", "num_tokens"]


def measure_tokenization(out_dir: Path, repetitions: int) -> dict:
    """Tokenise the demo ``repetitions`` times into ``out_dir`` (one shard), the last run stays there."""
    runs = [
        tokenize_dataset(demo_inputs(), demo_model(), out_dir, TokenizeOptions(shards=1)) for _ in range(repetitions)
    ]
    last = runs[-1]
    records = sum(item["records"] for item in last.inputs)
    seconds = [run.elapsed_s for run in runs]
    return {
        "conversations": records,
        "samples": last.samples,
        "tokens": last.tokens,
        "seconds": seconds,
        "conversations_per_s": round(records / median(seconds), 1),
        "tokens_per_s": round(last.tokens / median(seconds), 1),
    }
