"""The pipeline's inputs as observable source assets: `conversations` (the files of `dataset.paths`)
and `target_model` (the directory of `model.path`).

Each observation records a data version made from the inputs' content (files: a streaming sha256,
re-read only when a file's size or modification time changed; model: its config and weight
index). Dagster compares it with the version each downstream materialization was made from, so
an edited conversation file or a replaced model marks `tokenized_dataset` and everything after it
stale in the UI. Observed when `make demo` starts (job `observe_inputs`), on demand with "Observe
sources" in the UI, and while the daemon runs (`make ui`) by the sensor `observe_inputs_on_change`
(defs/sensors/automation.py), which records an observation without a run, and only when a version changed.
"""

import datetime
from pathlib import Path
from typing import Any

from dagster import (
    AssetExecutionContext,
    DataVersion,
    MetadataValue,
    ObserveResult,
    observable_source_asset,
)

from hsx_dagster.core.fingerprints import CACHE_FILE, files_version, fingerprint_files, model_version
from hsx_dagster.core.model import weight_files
from hsx_dagster.core.settings import Settings
from hsx_dagster.core.units import format_bytes
from hsx_dagster.defs_support.asset_keys import CONVERSATIONS, TARGET_MODEL
from hsx_dagster.defs_support.metadata import table_value


def build_input_assets() -> list:
    """`conversations` and `target_model` (built when the definitions load; the decorator is marked beta)."""

    @observable_source_asset(
        key=CONVERSATIONS,
        group_name="hsx",
        required_resource_keys={"settings"},
        description="The conversation files of `dataset.paths` (JSONL, JSON array or Parquet), observed by content: "
        "size, modification time and sha256 of each file.",
        tags={"dagster/kind/json": "", "dagster/kind/parquet": ""},
    )
    def conversations(context: AssetExecutionContext) -> ObserveResult:
        version, metadata = conversations_observation(context.resources.settings.load())
        context.log.info(f"{metadata['file count']} conversation files, version {version}")
        return ObserveResult(data_version=DataVersion(version), metadata=metadata)

    @observable_source_asset(
        key=TARGET_MODEL,
        group_name="hsx",
        required_resource_keys={"settings"},
        description="The target model directory of `model.path` (config, tokenizer, weights), observed by its "
        "config.json and weight index.",
        tags={"dagster/kind/huggingface": "", "dagster/kind/safetensors": ""},
    )
    def target_model(context: AssetExecutionContext) -> ObserveResult:
        version, metadata = model_observation(context.resources.settings.load())
        return ObserveResult(data_version=DataVersion(version), metadata=metadata)

    return [conversations, target_model]


def conversations_observation(settings: Settings) -> tuple[str, dict[str, Any]]:
    """The version of the conversation files (content hashes, re-read only for changed files) and what to show."""
    prints = fingerprint_files(settings.dataset.paths, cache_file=settings.output_dir / CACHE_FILE)
    rows = [
        {
            "file": Path(p.path).name,  # the folders: `paths` below, so the table fits the page
            "size": format_bytes(p.bytes),
            "modified (UTC)": datetime.datetime.fromtimestamp(p.mtime_ns / 1e9, tz=datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M"
            ),
            "sha256": p.sha256[:12],
        }
        for p in prints
    ]
    return files_version(prints), {
        "files": table_value(rows),
        "file count": len(prints),
        "size": format_bytes(sum(p.bytes for p in prints)),
        "paths": MetadataValue.md("\n".join(f"- `{p.path}`" for p in prints)),
    }


def model_observation(settings: Settings) -> tuple[str, dict[str, Any]]:
    """The version of the model directory (config and weight index) and what to show."""
    path, info = settings.model.path, settings.model_info
    version, prints = model_version(info)
    weights = weight_files(path)
    return version, {
        "path": MetadataValue.path(str(path)),
        **model_entries(info.describe()),
        "weight files": len(weights),
        "weights size": format_bytes(sum(p.stat().st_size for p in weights)),
        # the first 16 hex digits: a full sha256 pushes the metadata table past the page's width
        **{key.replace("_sha256", " sha256"): value[:16] for key, value in prints.items()},
    }


def model_entries(described: dict) -> dict:
    """The model's description, `architectures` only where it says more than `architecture`."""
    architectures = described.pop("architectures")
    if list(architectures) != [described["architecture"]]:
        described["architectures"] = ", ".join(architectures)
    return described
