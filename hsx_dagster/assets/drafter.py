"""`drafter_dataset`: the trainer-facing dataset assembled over every `hidden_states` shard.

Thin over `hsx_dagster.core.drafter`: it refuses to assemble while a shard is missing, unfinished or
stale (and names them), then writes the global index and the manifest.
"""

from dagster import AllPartitionMapping, AssetDep, AssetExecutionContext, MaterializeResult, MetadataValue, asset

from hsx_dagster.core.drafter import assemble
from hsx_dagster.resources import HsxSettings


@asset(
    group_name="hsx",
    deps=[AssetDep("hidden_states", partition_mapping=AllPartitionMapping())],
    kinds={"parquet", "json"},
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
    rows = ["| shard | samples | tokens | GB |", "|---|---:|---:|---:|"] + [
        f"| {s['shard']} | {s['samples']:,} | {s['tokens']:,} | {s['bytes'] / 1e9:.3f} |" for s in summary.shards
    ]
    return MaterializeResult(
        metadata={
            "dagster/row_count": summary.samples,
            "samples": summary.samples,
            "tokens": summary.tokens,
            "bytes": summary.bytes,
            "train_samples": summary.train_samples,
            "val_samples": summary.val_samples,
            "layers": MetadataValue.json(summary.manifest["layers"]),
            "storage_dtype": summary.manifest["storage_dtype"],
            "per_shard": MetadataValue.md("\n".join(rows)),
            "path": MetadataValue.path(str(loaded.drafter_dir)),
        }
    )
