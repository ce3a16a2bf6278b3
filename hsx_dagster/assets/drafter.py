"""`drafter_dataset`: the trainer-facing dataset assembled over every `hidden_states` shard.

Assembly (global index, manifest, split, checks) lands with issue #4, after extraction. Until then
it fails with a clear message instead of producing an empty or partial dataset.
"""


from dagster import AllPartitionMapping, AssetDep, AssetExecutionContext, Failure, MaterializeResult, asset

from hsx_dagster.resources import HsxSettings


@asset(
    group_name="hsx",
    deps=[AssetDep("hidden_states", partition_mapping=AllPartitionMapping())],
    kinds={"parquet", "json"},
    description="Global index, manifest and train/validation split over all hidden-state shards, "
    "read by hsx_dagster.DrafterDataset.",
)
def drafter_dataset(context: AssetExecutionContext, settings: HsxSettings) -> MaterializeResult:
    settings.load()
    raise Failure(description="drafter dataset assembly is not available yet (issue #4); nothing was written")
