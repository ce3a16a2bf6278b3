"""Every asset check of the pipeline, each thin over a core check that returns a `CheckOutcome`.

All are blocking: a failed check stops what depends on the asset.
- `tokenized_dataset_consistent`: the tokenized shards read back (core/inputs/tokenized_checks.py);
- `regenerated_conversations_complete`: every input record accounted for once (core/regenerate/regenerated_checks.py);
- `shard_coverage`, `shard_integrity`, `shard_numerics` on each `hidden_states` partition, from one read of the shard
  (core/dataset/shard_checks.py). They are partitioned like the asset, so a shard run (the `hidden_states_shard` job,
  or `dagster asset materialize --select hidden_states --partition shard-NN`) checks its own shard and the UI shows
  each partition's result; a failed one counts as a failed shard for `retry_failed_shards`;
- `drafter_coverage`, `drafter_integrity`, `drafter_numerics`, `drafter_parity` on the assembled dataset
  (core/dataset/drafter_checks.py; parity against an independent per-sample reference forward pass).
"""

import json
from pathlib import Path

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSpec,
    StaticPartitionsDefinition,
    asset_check,
    multi_asset_check,
)

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.dataset import (
    check_coverage,
    check_integrity,
    check_numerics,
    check_parity_on_claimed_device,
    check_shard,
)
from hsx_dagster.core.inputs import check_tokenized
from hsx_dagster.core.regenerate import check_regenerated
from hsx_dagster.core.settings import Settings
from hsx_dagster.core.storage import COMPLETE_FILE
from hsx_dagster.core.units import format_bytes, format_duration, format_share
from hsx_dagster.defs.resources import GpuResource, HsxSettings
from hsx_dagster.defs_support.asset_keys import (
    DRAFTER_DATASET,
    HIDDEN_STATES,
    REGENERATED_CONVERSATIONS,
    TOKENIZED_DATASET,
)
from hsx_dagster.defs_support.metadata import check_result

SHARD_CHECK_DESCRIPTIONS = {
    "shard_coverage": "Every tokenized sample of the shard committed or quarantined exactly once (samples whose "
    "input is gone counted as departed), with the tokenized ids and loss mask beside its states; the shard marked "
    "complete.",
    "shard_integrity": "Every chunk of the shard's index exists, still has the sha256 recorded at write time (taken "
    "from the writer for the chunks this run wrote, while their files are unchanged since), holds "
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
        # one read of the shard for all three (the chunks this run wrote and hashed are not read again); a damaged
        # chunk is set aside so the retry re-extracts its samples
        outcomes = check_shard(
            loaded.shard_dir(shard), loaded.tokenized_dir, shard, heal=True, run_id=context.run.run_id
        )
        selected = {key.name for key in context.selected_asset_check_keys}
        extraction_s, run_bytes = _last_run(loaded.shard_dir(shard))
        for name in (name for name in SHARD_CHECKS if name in selected):
            outcome = outcomes[name]
            if extraction_s:  # the checks' time beside the extraction's
                outcome = with_extraction_time(outcome, extraction_s)
            if run_bytes:  # the checks' CPU time per GB the run stored: its last part (hidden_states' host CPU per GB)
                cpu_per_gb = round(float(outcome.metadata.get("checks_cpu_s", 0.0)) / (run_bytes / 1e9), 4)
                outcome = CheckOutcome(outcome.passed, outcome.description,
                                       {**outcome.metadata, "checks_cpu_s_per_gb": cpu_per_gb})  # fmt: skip
            context.log.info(f"{shard} {name}: {'passed' if outcome.passed else 'FAILED'}: {outcome.description}")
            yield check_result(outcome, check_name=name, asset_key=HIDDEN_STATES)

    return [check_hidden_states_shard]


@asset_check(
    asset=TOKENIZED_DATASET,
    blocking=True,
    description="Re-reads the written shards: counts, unique sample ids, masks aligned with ids, loss tokens present, "
    "shard column consistent.",
)
def tokenized_dataset_consistent(context: AssetCheckExecutionContext, settings: HsxSettings) -> AssetCheckResult:
    return check_result(check_tokenized(settings.load().tokenized_dir))


@asset_check(
    asset=REGENERATED_CONVERSATIONS,
    blocking=True,
    description="Every input record regenerated or recorded as failed with a reason, exactly once; system, user "
    "and tool turns identical to the input; original tool calls kept where tool results answer them.",
)
def regenerated_conversations_complete(context: AssetCheckExecutionContext, settings: HsxSettings) -> AssetCheckResult:
    loaded = settings.load()
    return check_result(check_regenerated(loaded.regenerated_dir, loaded.dataset.paths))


@asset_check(
    asset=DRAFTER_DATASET,
    blocking=True,
    description="Every tokenized sample appears exactly once "
    "across shards, with the same input_ids and loss_mask, at the place the index says.",
)
def drafter_coverage(context: AssetCheckExecutionContext, settings: HsxSettings) -> AssetCheckResult:
    loaded = settings.load()
    return check_result(check_coverage(loaded.drafter_dir, loaded.tokenized_dir))


@asset_check(
    asset=DRAFTER_DATASET,
    blocking=True,
    description="Every chunk's sha256 still matches the one "
    "recorded at write time; shapes, dtypes and layer count match the manifest.",
)
def drafter_integrity(context: AssetCheckExecutionContext, settings: HsxSettings) -> AssetCheckResult:
    return check_result(check_integrity(settings.load().drafter_dir))


@asset_check(
    asset=DRAFTER_DATASET,
    blocking=True,
    description="No NaN or Inf anywhere; per-layer mean and "
    "std; a layer of zeros fails, an outlying scale is reported.",
)
def drafter_numerics(context: AssetCheckExecutionContext, settings: HsxSettings) -> AssetCheckResult:
    return check_result(check_numerics(settings.load().drafter_dir))


@asset_check(
    asset=DRAFTER_DATASET,
    blocking=True,
    description="Random samples re-extracted one at a time by "
    "an independent reference forward pass match the stored tensors within the storage dtype's tolerance.",
)
def drafter_parity(context: AssetCheckExecutionContext, settings: HsxSettings, gpu: GpuResource) -> AssetCheckResult:
    loaded = settings.load()
    extraction = gpu.validated()
    outcome = check_parity_on_claimed_device(
        loaded.drafter_dir,
        loaded.tokenized_dir,
        samples=loaded.drafter.parity_samples,
        seed=loaded.drafter.parity_seed,
        devices=extraction.devices,
        owner=f"run {context.run.run_id[:8]} (drafter_parity)",
        lock_dir=extraction.device_lock_dir,
        wait_s=extraction.device_wait_s,
        trust_remote_code=loaded.model.trust_remote_code,
        claim=extraction.device_claim,
    )
    return check_result(outcome)


drafter_checks = [drafter_coverage, drafter_integrity, drafter_numerics, drafter_parity]


def regeneration_checks(settings: Settings) -> list[AssetChecksDefinition]:
    """The check of `regenerated_conversations`, when that asset is in the graph (``regenerate.enabled``)."""
    return [regenerated_conversations_complete] if settings.regenerate.enabled else []


def with_extraction_time(outcome: CheckOutcome, extraction_s: float) -> CheckOutcome:
    """The read's time in words beside the extraction's: what checking costs the shard, at a glance."""
    scan_s = float(outcome.metadata.get("scan_s", 0.0))
    read = int(outcome.metadata.get("scan_bytes", 0))
    speed = f" at {format_bytes(read / scan_s)}/s" if scan_s > 0 and read else ""
    skipped = int(outcome.metadata.get("chunks_skipped", 0))
    not_read = (
        f"; {skipped} chunks ({format_bytes(int(outcome.metadata.get('bytes_skipped', 0)))}) verified before and "
        "unchanged since, not read again"
        if skipped
        else ""
    )
    from_writer = int(outcome.metadata.get("chunks_from_writer", 0))
    if from_writer:
        not_read += (
            f"; {from_writer} chunks ({format_bytes(int(outcome.metadata.get('bytes_from_writer', 0)))}) written by "
            "this run, checksums as its writer computed them, not read again"
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


def _last_run(folder: Path) -> tuple[float, int]:
    """How long the shard's last run took and the bytes it stored (complete.json), zeros when unknown."""
    try:
        last = json.loads((folder / COMPLETE_FILE).read_text(encoding="utf-8")).get("last_run", {})
        return round(float(last.get("elapsed_s", 0.0)), 3), int(last.get("bytes_written", 0))
    except (FileNotFoundError, ValueError, AttributeError, TypeError):
        return 0.0, 0
