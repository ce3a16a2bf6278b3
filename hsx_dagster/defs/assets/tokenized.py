"""`tokenized_dataset`: conversations -> token ids, assistant-only loss masks and shard assignment.

Thin over `hsx_dagster.core.inputs`: it loads the settings, calls the core, and reports what
it produced as materialization metadata. The asset check reads the files back.
"""

import typing
from pathlib import Path

from dagster import (
    AssetExecutionContext,
    Config,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import create_model

from hsx_dagster.core.extraction import StoredShape, estimate_by_dtype
from hsx_dagster.core.inputs import (
    LengthBucket,
    ShardLoad,
    TokenizedSummary,
    read_tokenized_shard,
    tokenize_dataset,
)
from hsx_dagster.core.regenerate import regenerated_input
from hsx_dagster.core.settings import DatasetSettings, Settings
from hsx_dagster.core.storage import REJECT_SCHEMA, SAMPLE_SCHEMA, shard_work
from hsx_dagster.core.units import format_bytes, format_count, format_duration, format_share
from hsx_dagster.defs.resources import HsxSettings, resource_fields, validated
from hsx_dagster.defs_support.asset_keys import INPUTS, TOKENIZED_DATASET
from hsx_dagster.defs_support.metadata import arrow_column_schema, table_value
from hsx_dagster.defs_support.pools import prepare_pool

SAMPLE_COLUMNS = {
    "sample_id": "unique over the dataset; the id every later file uses",
    "source": "input file",
    "source_index": "record number in the input file",
    "input_ids": "token ids of the rendered conversation",
    "loss_mask": "1 on tokens the drafter learns to predict (assistant turns; every token with dataset.loss_mask: all)",
    "shard": "hidden_states partition the sample belongs to",
}


RUN_CONFIG_KEYS = ("max_length", "min_loss_tokens", "thinking", "loss_mask")  # of the `dataset` section


class _TokenizeConfigBase(Config):
    def applied_to(self, dataset: DatasetSettings) -> DatasetSettings:
        """The ``dataset`` section with this run's overrides, checked by the settings file's own rules."""
        overrides = {name: value for name, value in self.model_dump().items() if value is not None}
        return validated(DatasetSettings, {**dataset.model_dump(), **overrides}, "run config of tokenized_dataset")


if typing.TYPE_CHECKING:  # the fields come from DatasetSettings at run time, as for GpuResource

    class TokenizeConfig(_TokenizeConfigBase):
        pass

else:
    TokenizeConfig = create_model(
        "TokenizeConfig",
        __base__=_TokenizeConfigBase,
        __module__=__name__,
        __doc__="Per-run overrides of the dataset settings; unset fields keep hsx.yaml's values.",
        **resource_fields(DatasetSettings, RUN_CONFIG_KEYS, overrides=True),
    )


@asset(
    key=TOKENIZED_DATASET,
    group_name="hsx",
    deps=INPUTS,  # observable sources (defs/assets/inputs.py): stale when they change
    kinds={"parquet"},
    description="Conversations rendered with the target's chat template, tokenised, with assistant-only "
    "loss masks, balanced into shards by tokens; every rejected input recorded with a reason.",
)
def tokenized_dataset(
    context: AssetExecutionContext, config: TokenizeConfig, settings: HsxSettings
) -> MaterializeResult:
    loaded = settings.load()
    dataset, read_from = config.applied_to(loaded.dataset), "input files (dataset.paths)"
    if loaded.regenerate.enabled:  # regenerated_conversations is upstream: its output replaces the input files
        dataset = dataset.model_copy(update={"paths": [regenerated_input(loaded.regenerated_dir)]})
        read_from = "regenerated_conversations"
    paths = dataset.paths
    context.log.info(f"settings {loaded.source}: reading {read_from}: {len(paths)} files, {loaded.shards} shards")
    summary = tokenize_dataset(
        dataset, loaded.model, loaded.tokenized_dir, shards=loaded.shards, progress=context.log.info
    )
    shape = StoredShape.of_model(loaded.model_info, loaded.layer_ids, loaded.model.include_final)
    estimate = estimate_by_dtype(summary.shards, shape, loaded.extraction.chunk_bytes)
    context.log.info(
        f"hidden states will take about {format_bytes(sum(estimate[loaded.extraction.storage_dtype].values()))} "
        f"({loaded.extraction.storage_dtype}; {shape.layers} vectors of {shape.hidden_size} per token)"
    )
    prepare_pool(context.instance, context.log)  # before shards start together (see hsx_dagster/defs_support/pools.py)
    return MaterializeResult(
        metadata={
            **tokenized_metadata(summary, loaded.tokenized_dir),
            **estimate_metadata(estimate),
            **shard_work_metadata(loaded),
            "read_from": read_from,
            "input_paths": MetadataValue.json([str(p) for p in paths]),
        }
    )


def tokenized_metadata(summary: TokenizedSummary, tokenized_dir: Path) -> dict:
    """One entry per quantity with its unit; empty ones left out."""
    mean = summary.tokens / summary.samples if summary.samples else 0.0
    metadata = {
        "dagster/row_count": summary.samples,
        "tokens": f"{format_count(summary.tokens)}, {format_count(summary.loss_tokens)} supervised "
        f"({format_share(summary.loss_tokens / summary.tokens if summary.tokens else 0.0)}), "
        f"mean {mean:,.1f} per sample",
        "truncated samples": format_count(summary.truncated),
        "rejected": format_count(summary.rejected),
        "shards": f"{len(summary.shards)}, token imbalance max/mean {summary.imbalance:.4f}",
        "per shard": MetadataValue.md(shard_table(summary.shards)),
        "token lengths": MetadataValue.md(histogram_table(summary.histogram)),
        "speed": f"{format_count(summary.conversations_per_s)} conversations/s with {summary.workers} workers, "
        f"{format_duration(summary.elapsed_s)} in all",
        "size": format_bytes(summary.bytes_written),
        "dagster/column_schema": arrow_column_schema(SAMPLE_SCHEMA, SAMPLE_COLUMNS),
        "rejects column schema": arrow_column_schema(REJECT_SCHEMA),
        "tokenizer": tokenizer_line(summary.tokenizer),
        "path": MetadataValue.path(str(tokenized_dir)),
    }
    if summary.rejects:
        metadata["rejects by reason"] = by_reason(summary.rejects)
    if summary.ignored_fields:
        metadata["ignored fields by reason"] = by_reason(summary.ignored_fields)
    return metadata


def tokenizer_line(tokenizer: dict) -> str:
    return (
        f"{tokenizer.get('class', 'unknown')}, chat template sha256 {tokenizer['chat_template_sha256_16']}, "
        f"transformers {tokenizer.get('transformers_version', 'unknown')}"
    )


def by_reason(counts: dict[str, int]) -> MetadataValue:
    return table_value([{"reason": reason, "count": format_count(count)} for reason, count in counts.items()])


def estimate_metadata(estimate: dict[str, dict[str, int]]) -> dict:
    """Disk the hidden states will take, per shard and storage dtype, with totals: one table."""
    shards = list(next(iter(estimate.values())))
    rows = ["| shard | " + " | ".join(estimate) + " |", "|---|" + "---:|" * len(estimate)]
    rows += [
        f"| {shard} | " + " | ".join(format_bytes(estimate[d][shard]) for d in estimate) + " |" for shard in shards
    ]
    rows += ["| **total** | " + " | ".join(f"**{format_bytes(sum(estimate[d].values()))}**" for d in estimate) + " |"]
    return {"estimated size of hidden states": MetadataValue.md("\n".join(rows))}


def shard_table(shards: list[ShardLoad]) -> str:
    """Per shard: what it holds, and what changed since the previous tokenized dataset (samples keep their shard)."""
    rows = ["| shard | samples | tokens | added | removed |", "|---|---:|---:|---:|---:|"]
    rows += [f"| {s.shard} | {s.samples:,} | {s.tokens:,} | {s.added:,} | {s.removed:,} |" for s in shards]
    return "\n".join(rows)


def shard_work_metadata(loaded: Settings) -> dict:
    """Which hidden_states shards have work against this tokenized dataset (stale), and how much: samples to
    extract (and their tokens), and committed samples whose input is gone. Reads each shard's index only."""
    rows = ["| shard | to extract | tokens | departed |", "|---|---:|---:|---:|"]
    stale, pending = [], 0
    for shard in loaded.shard_keys:
        table = read_tokenized_shard(loaded.tokenized_dir, shard, columns=["sample_id", "num_tokens"])
        work = shard_work(
            loaded.shard_dir(shard), table.column("sample_id").to_numpy(), table.column("num_tokens").to_numpy()
        )
        stale += [shard] if work.stale else []
        pending += work.pending
        rows.append(f"| {shard} | {work.pending:,} | {work.pending_tokens:,} | {work.departed:,} |")
    return {
        "stale_shards": MetadataValue.json(stale),
        "samples_to_extract": pending,
        "shard_work": MetadataValue.md("\n".join(rows)),
    }


def histogram_table(histogram: list[LengthBucket]) -> str:
    """Token lengths as a markdown table narrow enough not to wrap in the UI's metadata column: ranges joined
    by a non-breaking hyphen, a share and a bar of at most 12 blocks."""
    total = sum(bucket.samples for bucket in histogram) or 1
    widest = max((bucket.samples for bucket in histogram), default=0) or 1
    rows = ["| tokens | samples | share |", "|---:|---:|:---|"]
    for bucket in histogram:
        bar = "\u2588" * max(1 if bucket.samples else 0, round(12 * bucket.samples / widest))
        share = f"{100 * bucket.samples / total:.0f}%"
        rows.append(f"| {bucket.min:,}\u2011{bucket.max:,} | {bucket.samples:,} | {bar}\u00a0{share} |")
    return "\n".join(rows)
