"""`hidden_states`: one static partition per shard, materialized by the op `extract_hidden_states`.

The batched, resumable extraction engine is the next piece of work (issue #3). Until it lands the
op refuses to run with a clear failure rather than writing anything that could be mistaken for
real hidden states; the asset is here so the graph, partitions and the `gpu` resource are complete.
"""


from dagster import AssetExecutionContext, AssetSpec, Failure, MaterializeResult, StaticPartitionsDefinition, multi_asset

from hsx_dagster.resources import GpuResource, HsxSettings


def build_hidden_states(partitions_def: StaticPartitionsDefinition):
    @multi_asset(
        name="extract_hidden_states",
        specs=[
            AssetSpec(
                "hidden_states",
                deps=["tokenized_dataset"],
                partitions_def=partitions_def,
                group_name="hsx",
                kinds={"pytorch", "safetensors"},
                description="Hidden states of the chosen target layers for every token of a shard, "
                "in safetensors chunks of flat, unpadded tokens plus a per-shard index.",
            )
        ],
        partitions_def=partitions_def,
        op_tags={"hsx/role": "extraction"},
    )
    def extract_hidden_states(context: AssetExecutionContext, gpu: GpuResource, settings: HsxSettings) -> MaterializeResult:
        settings.load()  # bad settings fail here, before anything else, with the key named
        raise Failure(
            description=(
                f"hidden-state extraction for {context.partition_key} is not available yet: the batched "
                "extraction engine lands with issue #3; nothing was written"
            )
        )

    return extract_hidden_states
