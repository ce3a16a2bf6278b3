"""The pipeline's jobs: `hidden_states_shard` (one shard per run, one run per GPU) and `observe_inputs`."""

import json
from pathlib import Path

import yaml
from dagster import AssetSelection, StaticPartitionsDefinition, define_asset_job

from hsx_dagster.defs_support.asset_keys import HIDDEN_STATES, INPUTS

RAY_CONFIG_TAG = "dagster-ray/config"  # read by dagster-ray's RayRunLauncher: the run's Ray resource request
MAX_RETRIES_TAG = "dagster/max_retries"  # Dagster's run retries for this run (the instance's run_retries otherwise)


def shard_run_tags(k8s_run_config: Path | None, ray_run_config: Path | None = None) -> dict[str, str]:
    """Tags every shard run carries, retries included: on Kubernetes, `dagster-k8s/config` gives each run one GPU;
    on a Ray cluster, `dagster-ray/config` asks Ray for one (`RayRunLauncher` places the run where one is free)."""
    tags = {}
    if k8s_run_config is not None:
        tags["dagster-k8s/config"] = json.dumps(yaml.safe_load(k8s_run_config.read_text(encoding="utf-8")))
    if ray_run_config is not None:
        tags.update(ray_gpu_run_tags(ray_run_config))
        # A shard run lost with its node is re-run by retry_failed_shards (within its budget, saying why), not by
        # Dagster's run retries as well, which would race it for the shard.
        tags[MAX_RETRIES_TAG] = "0"
    return tags


def ray_gpu_run_tags(ray_run_config: Path | None) -> dict[str, str]:
    """The `dagster-ray/config` tag of a run that needs a GPU (none without a Ray run config)."""
    if ray_run_config is None:
        return {}
    return {RAY_CONFIG_TAG: json.dumps(yaml.safe_load(ray_run_config.read_text(encoding="utf-8")) or {})}


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
