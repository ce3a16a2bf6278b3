"""Blocking checks on each `hidden_states` partition, evaluated for the shard a run materialized.

Thin over `hsx_dagster.core.storage.shard_checks`. The checks are partitioned like the asset, so a
shard run (the `hidden_states_shard` job, or `dagster asset materialize --select hidden_states
--partition shard-NN`) checks its own shard, and the UI shows each partition's result. A failed
check blocks `drafter_dataset` and counts as a failed shard for `retry_failed_shards`.
"""

from dagster import (
    AssetCheckExecutionContext,
    AssetChecksDefinition,
    AssetCheckSpec,
    StaticPartitionsDefinition,
    multi_asset_check,
)

from hsx_dagster.asset_keys import HIDDEN_STATES
from hsx_dagster.checks import check_result
from hsx_dagster.core.storage.shard_checks import (
    check_shard_coverage,
    check_shard_integrity,
    check_shard_numerics,
)
from hsx_dagster.resources import HsxSettings

SHARD_CHECK_DESCRIPTIONS = {
    "shard_coverage": "Every tokenized sample of the shard committed or quarantined exactly once (samples whose "
    "input is gone counted as departed), with the tokenized ids and loss mask beside its states; the shard marked "
    "complete.",
    "shard_integrity": "Every chunk of the shard's index exists, still has the sha256 recorded at write time, holds "
    "the samples the index says; headers, tensor names, dtypes and shapes match the shard's provenance.",
    "shard_numerics": "No NaN or Inf in the shard's states (fp8 de-quantised); per-layer mean and std, a layer of "
    "zeros fails.",
}
SHARD_CHECKS = tuple(SHARD_CHECK_DESCRIPTIONS)  # all blocking


def build_shard_checks(partitions_def: StaticPartitionsDefinition) -> list[AssetChecksDefinition]:
    """The three checks, run by one step (one process, the shard's files read by each in turn)."""
    specs = [
        AssetCheckSpec(name, asset=HIDDEN_STATES, blocking=True, partitions_def=partitions_def, description=text)
        for name, text in SHARD_CHECK_DESCRIPTIONS.items()
    ]

    @multi_asset_check(specs=specs, name="check_hidden_states_shard", can_subset=True)
    def check_hidden_states_shard(context: AssetCheckExecutionContext, settings: HsxSettings):
        loaded = settings.load()
        shard = context.partition_key
        folder = loaded.shard_dir(shard)
        run = {
            "shard_coverage": lambda: check_shard_coverage(folder, loaded.tokenized_dir, shard),
            "shard_integrity": lambda: check_shard_integrity(folder),
            "shard_numerics": lambda: check_shard_numerics(folder),
        }
        selected = {key.name for key in context.selected_asset_check_keys}
        for name in (name for name in SHARD_CHECKS if name in selected):
            outcome = run[name]()
            context.log.info(f"{shard} {name}: {'passed' if outcome.passed else 'FAILED'}: {outcome.description}")
            yield check_result(outcome, check_name=name, asset_key=HIDDEN_STATES)

    return [check_hidden_states_shard]
