"""Blocking checks on each `hidden_states` partition, evaluated for the shard a run materialized.

Thin over `hsx_dagster.core.dataset.shard_checks`. The checks are partitioned like the asset, so a
shard run (the `hidden_states_shard` job, or `dagster asset materialize --select hidden_states
--partition shard-NN`) checks its own shard, and the UI shows each partition's result. A failed
check blocks `drafter_dataset` and counts as a failed shard for `retry_failed_shards`.
"""

import json
from pathlib import Path

from dagster import (
    AssetCheckExecutionContext,
    AssetChecksDefinition,
    AssetCheckSpec,
    StaticPartitionsDefinition,
    multi_asset_check,
)

from hsx_dagster.asset_keys import HIDDEN_STATES
from hsx_dagster.checks import check_result
from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.dataset import check_shard
from hsx_dagster.core.storage import COMPLETE_FILE
from hsx_dagster.core.units import format_bytes, format_duration, format_share
from hsx_dagster.resources import HsxSettings

SHARD_CHECK_DESCRIPTIONS = {
    "shard_coverage": "Every tokenized sample of the shard committed or quarantined exactly once (samples whose "
    "input is gone counted as departed), with the tokenized ids and loss mask beside its states; the shard marked "
    "complete.",
    "shard_integrity": "Every chunk of the shard's index exists, still has the sha256 recorded at write time, holds "
    "the samples the index says; headers, tensor names, dtypes and shapes match the shard's provenance. A damaged "
    "or missing chunk is set aside (set_aside/, reason in removed_chunks.jsonl): the next run of the shard "
    "re-extracts its samples.",
    "shard_numerics": "No NaN or Inf in the shard's states (fp8 de-quantised); per-layer mean and std, a layer of "
    "zeros fails; from the statistics recorded when each chunk was written.",
}
SHARD_CHECKS = tuple(SHARD_CHECK_DESCRIPTIONS)  # all blocking


def build_shard_checks(partitions_def: StaticPartitionsDefinition) -> list[AssetChecksDefinition]:
    """The three checks, run by one step from one read of the shard's files."""
    specs = [
        AssetCheckSpec(name, asset=HIDDEN_STATES, blocking=True, partitions_def=partitions_def, description=text)
        for name, text in SHARD_CHECK_DESCRIPTIONS.items()
    ]

    @multi_asset_check(specs=specs, name="check_hidden_states_shard", can_subset=True)
    def check_hidden_states_shard(context: AssetCheckExecutionContext, settings: HsxSettings):
        loaded = settings.load()
        shard = context.partition_key
        # one read of the shard for all three; a damaged chunk is set aside so the retry re-extracts its samples
        outcomes = check_shard(loaded.shard_dir(shard), loaded.tokenized_dir, shard, heal=True)
        selected = {key.name for key in context.selected_asset_check_keys}
        extraction_s = _extraction_seconds(loaded.shard_dir(shard))
        for name in (name for name in SHARD_CHECKS if name in selected):
            outcome = outcomes[name]
            if extraction_s:  # the checks' time beside the extraction's
                outcome = with_extraction_time(outcome, extraction_s)
            context.log.info(f"{shard} {name}: {'passed' if outcome.passed else 'FAILED'}: {outcome.description}")
            yield check_result(outcome, check_name=name, asset_key=HIDDEN_STATES)

    return [check_hidden_states_shard]


def with_extraction_time(outcome: CheckOutcome, extraction_s: float) -> CheckOutcome:
    """The read's time in words beside the extraction's: what checking costs the shard, at a glance."""
    scan_s = float(outcome.metadata.get("scan_s", 0.0))
    read = int(outcome.metadata.get("scan_bytes", 0))
    speed = f" at {format_bytes(read / scan_s)}/s" if scan_s > 0 else ""
    skipped = int(outcome.metadata.get("chunks_skipped", 0))
    not_read = (
        f"; {skipped} chunks ({format_bytes(int(outcome.metadata.get('bytes_skipped', 0)))}) verified before and "
        "unchanged since, not read again"
        if skipped
        else ""
    )
    words = (
        f"{format_duration(scan_s)} to read {format_bytes(read)}{speed}; the extraction took "
        f"{format_duration(extraction_s)} "
        f"({format_share(scan_s / extraction_s)} of it){not_read}"
    )
    metadata = {
        **outcome.metadata,
        "checks time": words,
        "extraction_s": extraction_s,
        "checks_over_extraction": round(scan_s / extraction_s, 4),
    }
    return CheckOutcome(outcome.passed, outcome.description, metadata)


def _extraction_seconds(folder: Path) -> float:
    """How long the shard's last run took (complete.json), 0.0 when unknown."""
    try:
        last = json.loads((folder / COMPLETE_FILE).read_text(encoding="utf-8")).get("last_run", {})
        return round(float(last.get("elapsed_s", 0.0)), 3)
    except (FileNotFoundError, ValueError, AttributeError, TypeError):
        return 0.0
