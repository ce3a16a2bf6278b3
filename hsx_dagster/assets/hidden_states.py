"""`hidden_states`: one static partition per shard, materialized by the op `extract_hidden_states`.

Thin over `hsx_dagster.core.extraction.shard_run`: settings and the `gpu` resource in, a shard job out to the
core engine, the run's figures back as materialization metadata.
"""

from dagster import (
    AssetExecutionContext,
    AssetSpec,
    MaterializeResult,
    MetadataValue,
    StaticPartitionsDefinition,
    multi_asset,
)

from hsx_dagster.asset_keys import HIDDEN_STATES, INPUTS, TOKENIZED_DATASET
from hsx_dagster.checks import sized
from hsx_dagster.core.extraction.batch_shape_summary import probe_table_markdown, shape_label
from hsx_dagster.core.extraction.shard_run import ShardJob, ShardResult, run_shard
from hsx_dagster.pools import GPU_POOL
from hsx_dagster.resources import GpuResource, HsxSettings


def build_hidden_states(partitions_def: StaticPartitionsDefinition):
    @multi_asset(
        name="extract_hidden_states",
        specs=[
            AssetSpec(
                HIDDEN_STATES,
                # the inputs too: Dagster's staleness is one hop, so an edited input marks every shard stale
                deps=[TOKENIZED_DATASET, *INPUTS],
                partitions_def=partitions_def,
                group_name="hsx",
                kinds={"pytorch", "safetensors"},
                description="Hidden states of the chosen target layers for every token of a shard, "
                "in safetensors chunks of flat, unpadded tokens plus a per-shard index. Resumable.",
            )
        ],
        partitions_def=partitions_def,
        op_tags={"hsx/role": "extraction"},
        pool=GPU_POOL,  # cap concurrent extraction steps with `dagster instance concurrency set gpu <number of GPUs>`
    )
    def extract_hidden_states(
        context: AssetExecutionContext, gpu: GpuResource, settings: HsxSettings
    ) -> MaterializeResult:
        loaded = settings.load()
        shard = context.partition_key
        job = ShardJob.from_settings(loaded, shard, gpu.validated(), owner=f"run {context.run_id[:8]} ({shard})")
        result = run_shard(job, progress=context.log.info)
        return MaterializeResult(metadata=hidden_states_metadata(result, job))

    return extract_hidden_states


def hidden_states_metadata(result: ShardResult, job: ShardJob) -> dict:
    report, info = result.report, result.backbone
    return {
        "dagster/row_count": result.totals.samples,
        "samples": result.totals.samples,
        "tokens": result.totals.tokens,
        **sized("bytes", result.totals.bytes),
        "bytes_per_token": round(result.totals.bytes / max(result.totals.tokens, 1), 1),
        "samples_this_run": report.samples,
        "quarantined": result.quarantined,
        "quarantined_this_run": MetadataValue.json(report.quarantined[:20]),
        "samples_resumed": report.samples_skipped,
        # stable membership (core/storage/shard_membership.py): committed samples whose input is gone, chunks
        # deleted because they held only such samples, chunks re-extracted because their tokens changed
        "samples_departed": result.departed,
        "chunks_reclaimed": result.reclaimed_chunks,
        "chunks_redone": result.redone_chunks,
        "elapsed_s": round(report.elapsed_s, 2),
        "samples_per_s": round(report.samples_per_s, 2),
        "tokens_per_s": round(report.tokens_per_s, 1),
        "padding_efficiency": round(report.padding_efficiency, 4),
        "forward_share_of_wall_time": round(report.forward_share, 4),
        "batches": report.batches,
        "oom_splits": report.oom_splits,
        "max_batch_tokens_at_end": report.final_max_batch_tokens,
        **sized("peak_memory_bytes", report.peak_memory_bytes),
        "device": report.device,
        "layers": MetadataValue.json(list(job.layer_ids)),
        "include_final": job.model.include_final,
        "decoder_layers_loaded": f"{info.kept_layers} of {info.num_layers}"
        if info
        else "none (nothing left to extract)",
        "compute_dtype": result.compute_dtype,
        "storage_dtype": job.extraction.storage_dtype,
        "attn_implementation": info.attn_implementation if info else job.extraction.attn_implementation,
        "batch_size": job.extraction.batch_size,  # the settings: a number or "auto"
        "max_batch_tokens": job.extraction.max_batch_tokens,
        # the shape this run ended with and how it was found (core/extraction/batch_shape.py)
        "batch_shape": shape_label(report.batch_shape),
        "batch_size_used": report.final_batch_size,
        "max_batch_tokens_used": report.final_max_batch_tokens,
        "probe_table": MetadataValue.md(probe_table_markdown(report.batch_shape)),
        "probe_s": round(report.batch_shape.probe_s if report.batch_shape else 0.0, 3),
        "probe_overhead_s": round(report.batch_shape.probe_overhead_s if report.batch_shape else 0.0, 3),
        "probe_share_of_run": round(report.probe_share, 4),
        "chunks": MetadataValue.json(list(result.totals.chunks)),
        "path": MetadataValue.path(str(job.output_dir)),
    }
