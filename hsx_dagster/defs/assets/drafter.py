"""`drafter_dataset`: the trainer-facing dataset assembled over every `hidden_states` shard.

Thin over `hsx_dagster.core.dataset` (assembly and checks): it refuses to assemble while a shard is
missing, unfinished or stale (and names them), then writes the global index and the manifest.
"""

from typing import Any

from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    MaterializeResult,
    MetadataValue,
    asset,
)

from hsx_dagster.core.dataset import (
    assemble,
)
from hsx_dagster.core.storage import DRAFTER_INDEX_SCHEMA, DRAFTER_QUARANTINE_SCHEMA
from hsx_dagster.core.units import format_bytes, format_count
from hsx_dagster.defs.resources import HsxSettings
from hsx_dagster.defs.sensors.automation import drafter_condition
from hsx_dagster.defs_support.asset_keys import DRAFTER_DATASET, HIDDEN_STATES, INPUTS
from hsx_dagster.defs_support.metadata import arrow_column_schema

INDEX_COLUMNS = {
    "chunk": "safetensors file holding the sample, relative to the manifest's chunks_root",
    "position": "the sample's place in its chunk (rows offsets[position]:offsets[position + 1])",
    "split": "train or val, decided by sample id",
}

# Short lines: the UI's metadata column is narrow and a code block does not wrap.
HOW_TO_LOAD = """```python
from hsx_dagster import (
    DrafterDataset, collate_drafter_batch)
ds = DrafterDataset(
    "{path}",
    split="train")
# ds[i]: sample_id, input_ids, loss_mask,
#        hidden_states [T, L, H]
loader = torch.utils.data.DataLoader(
    ds, batch_size=8, num_workers=4,
    collate_fn=collate_drafter_batch)
```"""


@asset(
    key=DRAFTER_DATASET,
    group_name="hsx",
    # the inputs too: Dagster's staleness is one hop, so an edited input marks the dataset stale at once
    deps=[AssetDep(HIDDEN_STATES, partition_mapping=AllPartitionMapping()), *INPUTS],
    kinds={"parquet", "json"},
    automation_condition=drafter_condition(),  # follows once every shard is newer than it (defs/sensors/automation.py)
    description="Global index, manifest and train/validation split over all hidden-state shards, "
    "read by hsx_dagster.DrafterDataset. No tensor is copied.",
)
def drafter_dataset(context: AssetExecutionContext, settings: HsxSettings) -> MaterializeResult:
    loaded = settings.load()
    summary = assemble(
        loaded.tokenized_dir,
        loaded.hidden_states_dir,
        loaded.shard_keys,
        loaded.drafter_dir,
        val_fraction=loaded.drafter.val_fraction,
        settings=loaded.public_dict(),
    )
    context.log.info(f"assembled {summary.samples} samples from {len(summary.shards)} shards into {loaded.drafter_dir}")
    if summary.ignored_folders:
        context.log.warning(
            f"{loaded.hidden_states_dir} also holds {', '.join(summary.ignored_folders)}, not shards of the current "
            f"settings ({loaded.shards} shards); they are not part of the dataset: delete them to free their space"
        )
    rows = ["| shard | samples | quarantined | tokens | size |", "|---|---:|---:|---:|---:|"] + [
        f"| {s.shard} | {s.samples:,} | {s.quarantined:,} | {s.tokens:,} | {format_bytes(s.bytes)} |"
        for s in summary.shards
    ]
    manifest = summary.manifest
    layers = manifest.layers
    metadata: dict[str, Any] = {
        "dagster/row_count": summary.samples,
        "samples": f"{format_count(summary.samples)}: {format_count(summary.train_samples)} train, "
        f"{format_count(summary.val_samples)} validation",
        "tokens": format_count(summary.tokens),
        "size": format_bytes(summary.bytes),
        "layers": ", ".join(str(i) for i in layers.ids) + (" and the final norm" if layers.include_final else ""),
        "layer convention": layers.convention,
        "storage dtype": manifest.storage_dtype
        + (f", {', '.join(f'{k} {v}' for k, v in manifest.quantization.items())}" if manifest.quantization else ""),
        "per shard": MetadataValue.md("\n".join(rows)),
        "how to load": MetadataValue.md(HOW_TO_LOAD.format(path=loaded.drafter_dir)),
        "dagster/column_schema": arrow_column_schema(DRAFTER_INDEX_SCHEMA, INDEX_COLUMNS),
        "quarantine column schema": arrow_column_schema(DRAFTER_QUARANTINE_SCHEMA),
        "path": MetadataValue.path(str(loaded.drafter_dir)),
    }
    if manifest.quarantined_samples:
        metadata["quarantined samples"] = format_count(manifest.quarantined_samples)
    if summary.ignored_folders:
        metadata["ignored folders"] = ", ".join(summary.ignored_folders)
    return MaterializeResult(metadata=metadata)
