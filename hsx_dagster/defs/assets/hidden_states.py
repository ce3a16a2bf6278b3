"""`hidden_states`: one static partition per shard, materialized by the op `extract_hidden_states`.

Thin over `hsx_dagster.core.extraction.shard_run`: settings and the `gpu` resource in, a shard job out to the
core engine, the run's figures back as materialization metadata, readable at a glance: the table of every shard with
totals first, then this shard's run. While the shard runs, its progress is logged and recorded as an
asset observation of its partition: soon after it starts, then every `operations.progress_every_s`.
"""

import time
from dataclasses import dataclass, replace

from dagster import (
    AssetExecutionContext,
    AssetObservation,
    AssetSpec,
    MaterializeResult,
    MetadataValue,
    StaticPartitionsDefinition,
    multi_asset,
)

from hsx_dagster.core.dataset import (
    SPEED_COLUMNS,
    STATE_COLUMNS,
    ShardRow,
    low_forward_share_note,
    markdown_table,
    total_line,
)
from hsx_dagster.core.extraction import Progress, ShardJob, ShardResult, probe_table_markdown, run_shard, shape_label
from hsx_dagster.core.storage import PART_MEANING
from hsx_dagster.core.units import format_bytes, format_count, format_duration, format_rate, format_share
from hsx_dagster.defs.resources import GpuResource, HsxSettings
from hsx_dagster.defs_support.asset_keys import HIDDEN_STATES, INPUTS, TOKENIZED_DATASET
from hsx_dagster.defs_support.metadata import table_value
from hsx_dagster.defs_support.pools import GPU_POOL
from hsx_dagster.defs_support.shard_table import shard_table


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
                "in safetensors chunks of flat, unpadded tokens plus a per-shard index. Resumable. "
                "The latest materialization shows every shard in a table; a running shard's progress "
                "is on its partition's Events.",
            )
        ],
        partitions_def=partitions_def,
        op_tags={"hsx/role": "extraction"},
        pool=GPU_POOL,  # cap concurrent extraction steps with `dagster instance concurrency set gpu <number of GPUs>`
    )
    def extract_hidden_states(
        context: AssetExecutionContext, gpu: GpuResource, settings: HsxSettings
    ) -> MaterializeResult:
        before_step_s = time.process_time()  # the process's start-up, imports and Dagster until this step
        loaded = settings.load()
        shard = context.partition_key
        job = ShardJob.from_settings(
            loaded, shard, gpu.validated(), owner=f"run {context.run_id[:8]} ({shard})", run_id=context.run_id
        )
        # asked once before the extraction too, timed: the time left includes the same question at the end
        asked = time.perf_counter()
        shard_table(context.instance, loaded, exclude_run_id=context.run_id)
        live = ProgressReporter(context, shard, loaded.operations.progress_every_s, time.perf_counter() - asked)
        run_started_s = time.process_time()
        result = run_shard(job, log_line=context.log.info, on_batch_progress=live, warn=context.log.warning)
        run_s = time.process_time() - run_started_s
        rows = shard_table(context.instance, loaded, exclude_run_id=context.run_id)
        step_cpu = StepCpu(before_step_s, run_s, time.process_time() - before_step_s)
        return MaterializeResult(
            metadata={
                **shards_metadata(rows),
                **hidden_states_metadata(result, job),
                **host_cpu_metadata(result, step_cpu),
            }
        )

    return extract_hidden_states


FIRST_UPDATE_AFTER_S = 10.0  # a person who just launched a shard wants its time left soon, not after a full interval


class ProgressReporter:
    """Turns the engine's progress (after every batch) into a run-log sentence and an observation of the shard's
    partition: the first once the engine has measured enough batches to price the rest and FIRST_UPDATE_AFTER_S
    of extraction have passed (``every_s`` if shorter), then every ``every_s``.

    The ETA runs to the materialization: after the engine's last batch, this step asks the instance for the
    table of every shard (``table_s``, timed before the extraction) and records the materialization event
    (timed as the latest observation's)."""

    def __init__(self, context: AssetExecutionContext, shard: str, every_s: float, table_s: float = 0.0) -> None:
        self.context, self.shard, self.every_s, self.table_s = context, shard, every_s, table_s
        self.last = 0.0
        self.event_s = 0.0

    def __call__(self, progress: Progress) -> None:
        wait_s = self.every_s if self.last else min(self.every_s, FIRST_UPDATE_AFTER_S)
        if not progress.estimated or progress.elapsed_s - self.last < wait_s:
            return
        self.last = progress.elapsed_s
        progress = replace(progress, after_loop_s=progress.after_loop_s + self.table_s + self.event_s)
        self.context.log.info(progress.line())
        started = time.perf_counter()
        self.context.log_event(
            AssetObservation(
                asset_key=HIDDEN_STATES,
                partition=self.shard,
                description=f"{self.shard} running: {format_share(progress.fraction)} done, "
                f"about {format_duration(progress.eta_s)} left",
                metadata={"state": "running", **progress.metadata()},
            )
        )
        self.event_s = time.perf_counter() - started


def shards_metadata(rows: list[ShardRow]) -> dict:
    """Every shard of the asset, first on the page: the totals, the table, and a low forward share in words."""
    note = low_forward_share_note(rows)
    return {
        "all shards": total_line(rows),
        "shards": MetadataValue.md(markdown_table(rows, STATE_COLUMNS)),
        "shards' speed and checks": MetadataValue.md(markdown_table(rows, SPEED_COLUMNS)),
        **({"low forward share": note} if note else {}),
    }


def hidden_states_metadata(result: ShardResult, job: ShardJob) -> dict:
    """This shard and its latest run, one entry per quantity, with its unit."""
    report, info, totals = result.report, result.backbone, result.totals
    shape = report.batch_shape
    metadata = {
        "shard": f"{job.shard}: {format_count(totals.samples)} samples, {format_count(totals.tokens)} tokens, "
        f"{format_bytes(totals.bytes)} ({totals.bytes / max(totals.tokens, 1):,.0f} bytes per token)",
        **this_run_metadata(result),
        "layers": ", ".join(str(i) for i in job.layer_ids) + (" and the final norm" if job.model.include_final else ""),
        "decoder layers loaded": f"{info.kept_layers} of {info.num_layers}" if info else "none (nothing to extract)",
        "dtypes": f"{result.compute_dtype} compute, {job.extraction.storage_dtype} storage",
        "device claim": result.device_claim,  # a lock on the GPU's UUID, or the scheduler's (CUDA_VISIBLE_DEVICES)
        "attention": info.attn_implementation if info else job.extraction.attn_implementation,
        **{use.role: use.summary() for use in (info.kernels if info else ())},  # linear attention, causal conv1d
        "batch settings": f"batch_size {job.extraction.batch_size}, max_batch_tokens {job.extraction.max_batch_tokens}",
        "chunks": str(len(totals.chunks)),
        # plain counts that tests and scripts read (stable membership: core/storage/shard_membership.py)
        "samples_this_run": report.samples,
        "samples_resumed": report.samples_skipped,
        "samples_departed": result.departed,  # committed, input gone, kept in chunks that still hold current ones
        "chunks_reclaimed": result.reclaimed_chunks,  # deleted: none of their samples is in the inputs any more
        "chunks_redone": result.redone_chunks,  # taken out because their samples' tokens changed
        "path": MetadataValue.path(str(job.output_dir)),
    }
    if shape is not None and shape.mode != "fixed" and report.samples:
        metadata["probes"] = (
            f"{format_duration(shape.probe_s)} probing, {format_duration(shape.probe_overhead_s)} lost to the "
            f"slower shapes: {format_share(report.probe_share)} of the run (budget {format_share(job.probe_budget)})"
        )
        metadata["probe table"] = MetadataValue.md(probe_table_markdown(shape))
    if result.quarantined:
        metadata["quarantined"] = f"{format_count(result.quarantined)} samples set aside (quarantine.jsonl)"
    if report.quarantined:
        metadata["quarantined this run"] = table_value(report.quarantined[:20])
    return metadata


def this_run_metadata(result: ShardResult) -> dict:
    """What this run did; a run that found every sample committed says so and nothing about speed."""
    report = result.report
    if not report.samples:
        return {"this run": f"nothing to extract: all {format_count(report.samples_skipped)} samples committed earlier"}
    shape = report.batch_shape
    return {
        "this run": f"{format_count(report.samples)} samples in {format_duration(report.elapsed_s)}"
        + (f", {format_count(report.samples_skipped)} resumed from earlier runs" if report.samples_skipped else ""),
        "throughput": f"{format_rate(report.tokens_per_s, 'tokens')}, {format_rate(report.samples_per_s, 'samples')}",
        "forward share": format_share(report.forward_share),
        "padding efficiency": format_share(report.padding_efficiency),
        "device": report.device,
        "peak memory": format_bytes(report.peak_memory_bytes),
        "batches": f"{format_count(report.batches)}, shape {shape_label(shape)}"
        + (f", {report.oom_splits} split after running out of memory" if report.oom_splits else ""),
    }


@dataclass(frozen=True)
class StepCpu:
    """The process's CPU-seconds around the shard run: before the step began, in `run_shard`, in the whole step."""

    before_step_s: float
    run_s: float
    step_s: float


STEP_PARTS = {
    "run_setup": "the run around the extraction: inputs read, output folder checked, model loaded, shard marked "
    "complete",
    "dagster_step": "Dagster in this step: the shard table asked for before and after, progress events",
    "startup_and_dagster": "the process before this step: Python's start-up, imports, Dagster's run and step set-up",
}


def host_cpu_metadata(result: ShardResult, step: StepCpu) -> dict:
    """Where the host's CPU-seconds went, per GB this run stored: the extraction's parts (cpu_account.py) and the
    rest of the process (set-up, Dagster, start-up), which add up to the process's CPU time at the end of the step.
    The shard checks run after this and report their own (`checks_cpu_s_per_gb` in their metadata)."""
    report = result.report
    if not report.bytes_written:
        return {}
    seconds = {
        **report.host_cpu_s,
        "run_setup": max(step.run_s - report.process_cpu_s, 0.0),
        "dagster_step": max(step.step_s - step.run_s, 0.0),
        "startup_and_dagster": step.before_step_s,
    }
    gb = report.bytes_written / 1e9
    meaning = {**PART_MEANING, **STEP_PARTS}
    rows = "\n".join(f"| {part} | {value / gb:.3f} | {meaning.get(part, '')} |" for part, value in seconds.items())
    total = sum(seconds.values()) / gb
    return {
        "host CPU per GB": MetadataValue.md(
            f"| part | CPU-s/GB | what |\n|---|---:|---|\n{rows}\n| **total** | "
            f"**{total:.3f}** | the process's CPU time at the end of the step |"
        ),
        "host_cpu_s_per_gb": round(total, 3),
        "extraction_cpu_s_per_gb": round(report.process_cpu_s / gb, 3),  # the parts of the extraction alone
        "chunk writes": f"{report.direct_io}: {report.chunks_direct} of {len(report.chunks)} chunks written direct",
    }
