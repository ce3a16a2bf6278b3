"""Data-quality check of the tokenized dataset, read back from disk (the asset check wires it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.inputs.tokenized import TokenizedSummary
from hsx_dagster.core.storage.format import tokenized_shard_file


def check_tokenized(tokenized_dir: Path) -> CheckOutcome:
    """Counts match the summary, sample ids are unique across shards, every row carries its own shard's
    key, ids, mask and num_tokens agree in length, and no sample has fewer loss tokens than allowed."""
    summary = TokenizedSummary.read(tokenized_dir)
    problems: list[str] = []
    seen: set[int] = set()
    total = 0
    for entry in summary.shards:
        file = tokenized_shard_file(tokenized_dir, entry.shard)
        table = pq.read_table(file)
        total += table.num_rows
        if table.num_rows != entry.samples:
            problems.append(f"{file.name}: {table.num_rows} rows, summary says {entry.samples}")
        if set(table.column("shard").unique().to_pylist()) - {entry.shard}:
            problems.append(f"{file.name}: rows carry another shard's key")
        duplicates = []
        for sample_id in table.column("sample_id").to_pylist():
            if sample_id in seen:
                duplicates.append(sample_id)
            seen.add(sample_id)
        if duplicates:
            problems.append(f"{file.name}: sample ids seen twice: {duplicates[:5]}")
        lengths = table.column("input_ids").combine_chunks().value_lengths().to_numpy()
        mask_lengths = table.column("loss_mask").combine_chunks().value_lengths().to_numpy()
        if not np.array_equal(lengths, mask_lengths) or not np.array_equal(
            lengths, table.column("num_tokens").to_numpy()
        ):
            problems.append(f"{file.name}: input_ids, loss_mask and num_tokens disagree in length")
        if np.any(table.column("num_loss_tokens").to_numpy() < summary.options["min_loss_tokens"]):
            problems.append(f"{file.name}: samples with fewer than min_loss_tokens supervised tokens")
    if total != summary.samples:
        problems.append(f"{total} rows across shards, summary says {summary.samples}")
    return CheckOutcome(
        not problems, "; ".join(problems) or "all shards consistent", {"rows": total, "problems": problems[:20]}
    )
