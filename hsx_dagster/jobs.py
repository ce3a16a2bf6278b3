"""The pipeline's jobs: `hidden_states_shard` (one shard per run, one run per GPU) and `observe_inputs`."""

import json
from pathlib import Path

import yaml
from dagster import AssetSelection, StaticPartitionsDefinition, define_asset_job

from hsx_dagster.asset_keys import HIDDEN_STATES, INPUTS


def shard_run_tags(k8s_run_config: Path | None) -> dict[str, str]:
    """Tags every shard run carries, retries included: on Kubernetes, `dagster-k8s/config` gives each run one GPU."""
    if k8s_run_config is None:
        return {}
    return {"dagster-k8s/config": json.dumps(yaml.safe_load(k8s_run_config.read_text(encoding="utf-8")))}


def build_shard_job(partitions_def: StaticPartitionsDefinition, run_tags: dict[str, str] | None = None):
    """The job that runs one shard; ``run_tags``: `shard_run_tags`."""
    return define_asset_job(
        "hidden_states_shard",
        selection=AssetSelection.assets(HIDDEN_STATES),
        partitions_def=partitions_def,
        tags=run_tags or {},
        description="One hidden_states shard per run (one run per GPU).",
    )


def build_observe_job():
    """Observes the inputs; run before tokenizing so every output records the input versions it was made from."""
    return define_asset_job(
        "observe_inputs",
        selection=AssetSelection.assets(*INPUTS),
        description="Observe the conversation files and the model directory (content hashes).",
    )
