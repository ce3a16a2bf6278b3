"""Turn conversation files into the tokenized dataset: Parquet per shard, a rejects table, a summary.

Layout under ``<output_dir>/tokenized/``::

    samples/shard-00.parquet ...  sample_id, source, source_index, input_ids (list<int32>),
                                   loss_mask (list<uint8>), num_tokens, num_loss_tokens, shard
    rejects.parquet                source, source_index, location, reason, detail
    summary.json                   counts, per-shard tokens, histogram, provenance

Two streaming passes keep memory flat in the size of the inputs: the first tokenises into a staging
file and keeps only (sample_id, num_tokens) per sample; shards are then balanced by tokens; the
second pass copies rows into their shard's file. The new directory replaces the old one by rename,
so a crash never leaves a half-written tokenized dataset in place; a folder that is not a tokenized
dataset is never replaced.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hsx_dagster.core.inputs.chat_template import (
    SampleRejected,
    TemplateError,
    TemplateMarkers,
    render,
    sample_id_of,
    template_fingerprint,
    tokenize_rendered,
)
from hsx_dagster.core.inputs.conversations import Conversation, Reject, RejectReason, check_input_file, iter_records
from hsx_dagster.core.inputs.sharding import assign_shards, imbalance, shard_loads
from hsx_dagster.core.settings import check_shard_key, shard_keys
from hsx_dagster.core.storage.format import (
    REJECT_SCHEMA,
    SAMPLE_SCHEMA,
    TOKENIZED_REJECTS_FILE,
    TOKENIZED_SAMPLES_DIR,
    TOKENIZED_SUMMARY_FILE,
    TOKENIZED_VERSION,
    tokenized_shard_file,
)

BATCH_CONVERSATIONS = 512
WRITE_ROWS = 4096
HISTOGRAM_EDGES = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

_STAGING_SCHEMA = pa.schema([f for f in SAMPLE_SCHEMA if f.name != "shard"])
log = logging.getLogger(__name__)


class TokenizedDataError(RuntimeError):
    """The tokenized dataset on disk is missing or is not what is asked for; the message says what to do."""


@dataclass(frozen=True)
class TokenizeOptions:
    max_length: int = 4096
    min_loss_tokens: int = 1
    thinking: str = "keep"
    shards: int = 1
    trust_remote_code: bool = False


@dataclass
class TokenizedSummary:
    format_version: int
    samples: int
    tokens: int
    loss_tokens: int
    truncated: int
    rejects: dict[str, int]
    shards: list[dict]
    imbalance: float
    histogram: list[dict]
    inputs: list[dict]
    tokenizer: dict
    options: dict
    elapsed_s: float
    conversations_per_s: float
    bytes_written: int
    created_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def read(cls, tokenized_dir: Path) -> TokenizedSummary:
        return cls(**json.loads((tokenized_dir / TOKENIZED_SUMMARY_FILE).read_text(encoding="utf-8")))

    @property
    def rejected(self) -> int:
        return sum(self.rejects.values())


def load_tokenizer(model_path: Path, trust_remote_code: bool = False):
    """The target's tokenizer; it must be a fast one, since masks are built from its offsets."""
    from transformers import AutoTokenizer  # heavy import, kept off module import

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "trust_remote_code" in str(exc):
            advice = f"set model.trust_remote_code: true if you trust the code in {model_path}"
        else:
            advice = "the model directory needs the model's tokenizer files (tokenizer.json, tokenizer_config.json)"
        raise TemplateError(f"{model_path}: cannot load the tokenizer ({first_line}); {advice}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError(
            f"{model_path}: the tokenizer is not a fast tokenizer (no tokenizer.json); offsets are needed"
        )
    return tokenizer


def tokenize_dataset(
    paths: Sequence[Path],
    model_path: Path,
    out_dir: Path,
    options: TokenizeOptions,
    progress: Callable[[str], None] | None = None,
) -> TokenizedSummary:
    """Tokenise every input file into ``out_dir`` (replacing what was there once complete)."""
    started = time.perf_counter()
    report = progress or log.info
    formats = {str(path): check_input_file(Path(path)) for path in paths}  # fail before loading anything
    _check_replaceable(Path(out_dir))
    tokenizer = load_tokenizer(model_path, options.trust_remote_code)
    markers = TemplateMarkers.probe(tokenizer, name=f"tokenizer at {model_path}")

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out_dir)
    staging_dir = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    (staging_dir / TOKENIZED_SAMPLES_DIR).mkdir(parents=True)
    try:
        first_pass = _tokenize_into(
            staging_dir / "staging.parquet",
            staging_dir / TOKENIZED_REJECTS_FILE,
            paths,
            tokenizer,
            markers,
            options,
            report,
            started,
        )
        keys = shard_keys(options.shards)
        assignment = assign_shards(first_pass.num_tokens, first_pass.sample_ids, options.shards)
        _write_shards(staging_dir / "staging.parquet", staging_dir / TOKENIZED_SAMPLES_DIR, assignment, keys)
        (staging_dir / "staging.parquet").unlink()

        loads = shard_loads(first_pass.num_tokens, assignment, options.shards)
        counts = np.bincount(assignment, minlength=options.shards)
        elapsed = time.perf_counter() - started
        summary = TokenizedSummary(
            format_version=TOKENIZED_VERSION,
            samples=len(first_pass.sample_ids),
            tokens=int(np.sum(first_pass.num_tokens)),
            loss_tokens=first_pass.loss_tokens,
            truncated=first_pass.truncated,
            rejects=dict(sorted(first_pass.rejects.items())),
            shards=[{"shard": k, "samples": int(c), "tokens": int(t)} for k, c, t in zip(keys, counts, loads)],
            imbalance=round(imbalance(loads), 6),
            histogram=length_histogram(first_pass.num_tokens),
            inputs=[{"path": p, "format": formats[p], **first_pass.per_input[p]} for p in map(str, paths)],
            tokenizer={
                "model_path": str(model_path),
                "vocab_size": len(tokenizer),
                "chat_template_sha256_16": template_fingerprint(tokenizer),
                "assistant_header": markers.assistant_header,
                "end_of_turn": markers.end_of_turn,
            },
            options=asdict(options),
            elapsed_s=round(elapsed, 3),
            conversations_per_s=round(first_pass.records / elapsed, 1) if elapsed > 0 else 0.0,
            bytes_written=_tree_bytes(staging_dir),
        )
        (staging_dir / TOKENIZED_SUMMARY_FILE).write_text(summary.to_json(), encoding="utf-8")
        _replace_dir(staging_dir, out_dir)
    except BaseException:
        shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    report(
        f"tokenized {summary.samples} samples ({summary.tokens} tokens) into {options.shards} shards, "
        f"{summary.rejected} rejected, imbalance {summary.imbalance:.4f}, {summary.elapsed_s:.1f} s"
    )
    return summary


@dataclass
class _FirstPass:
    sample_ids: np.ndarray
    num_tokens: np.ndarray
    loss_tokens: int
    truncated: int
    records: int
    rejects: Counter
    per_input: dict[str, dict]


def _tokenize_into(staging_file, rejects_file, paths, tokenizer, markers, options, report, started) -> _FirstPass:
    sample_ids: list[int] = []
    num_tokens: list[int] = []
    seen: dict[int, str] = {}
    rejects: Counter = Counter()
    per_input = {str(p): {"records": 0, "samples": 0, "rejects": 0, "bytes": Path(p).stat().st_size} for p in paths}
    loss_tokens = truncated = records = 0
    last_report = time.perf_counter()

    with (
        pq.ParquetWriter(staging_file, _STAGING_SCHEMA) as samples_out,
        pq.ParquetWriter(rejects_file, REJECT_SCHEMA) as rejects_out,
    ):
        reject_rows: list[Reject] = []

        def record_reject(item: Reject) -> None:
            rejects[item.reason] += 1
            per_input[item.source]["rejects"] += 1
            reject_rows.append(item)

        for batch in _batched(_all_records(paths), BATCH_CONVERSATIONS):
            accepted: list[tuple[Conversation, int]] = []
            rendered = []
            for item in batch:
                records += 1
                per_input[item.source]["records"] += 1
                if isinstance(item, Reject):
                    record_reject(item)
                    continue
                sample_id = sample_id_of(item.messages)
                if sample_id in seen:
                    record_reject(_reject(item, RejectReason.DUPLICATE, f"same conversation as {seen[sample_id]}"))
                    continue
                try:
                    rendered.append(render(item, tokenizer, markers, options.thinking))
                except SampleRejected as exc:
                    record_reject(_reject(item, exc.reason, exc.detail))
                    continue
                seen[sample_id] = f"{item.source} {item.location}"
                accepted.append((item, sample_id))

            rows: list[tuple[Conversation, int, np.ndarray, np.ndarray]] = []
            for (item, sample_id), tokens in zip(accepted, tokenize_rendered(rendered, tokenizer, options.max_length)):
                supervised = int(tokens.loss_mask.sum())
                if supervised < options.min_loss_tokens:
                    cut = " after truncation to max_length" if tokens.truncated else ""
                    record_reject(
                        _reject(
                            item,
                            RejectReason.TOO_FEW_LOSS_TOKENS,
                            f"{supervised} supervised tokens{cut}, fewer than "
                            f"min_loss_tokens={options.min_loss_tokens}",
                        )
                    )
                    continue
                truncated += tokens.truncated
                loss_tokens += supervised
                rows.append((item, sample_id, tokens.input_ids, tokens.loss_mask))
                per_input[item.source]["samples"] += 1
                sample_ids.append(sample_id)
                num_tokens.append(len(tokens.input_ids))
            if rows:
                samples_out.write_table(_sample_table(rows))
            if reject_rows:
                rejects_out.write_table(_reject_table(reject_rows))
                reject_rows.clear()

            now = time.perf_counter()
            if now - last_report > 5:
                last_report = now
                rate = records / (now - started)
                report(
                    f"tokenizing: {records} conversations read, {len(sample_ids)} samples, {rate:.0f} conversations/s"
                )

    return _FirstPass(
        np.asarray(sample_ids, dtype=np.int64),
        np.asarray(num_tokens, dtype=np.int64),
        loss_tokens,
        truncated,
        records,
        rejects,
        per_input,
    )


def _write_shards(staging_file: Path, samples_dir: Path, assignment: np.ndarray, keys: list[str]) -> None:
    writers = {key: pq.ParquetWriter(samples_dir / f"{key}.parquet", SAMPLE_SCHEMA) for key in keys}
    try:
        offset = 0
        for batch in pq.ParquetFile(staging_file).iter_batches(batch_size=WRITE_ROWS):
            shard_of_row = assignment[offset : offset + batch.num_rows]
            offset += batch.num_rows
            table = pa.Table.from_batches([batch])
            for index, key in enumerate(keys):
                rows = np.flatnonzero(shard_of_row == index)
                if len(rows):
                    part = table.take(pa.array(rows))
                    writers[key].write_table(part.append_column("shard", pa.array([key] * len(rows), pa.string())))
    finally:
        for writer in writers.values():
            writer.close()


def _sample_table(rows) -> pa.Table:
    lengths = np.asarray([len(ids) for _, _, ids, _ in rows], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = np.concatenate([ids for _, _, ids, _ in rows]) if rows else np.zeros(0, np.int32)
    masks = np.concatenate([mask for _, _, _, mask in rows]) if rows else np.zeros(0, np.uint8)
    return pa.table(
        {
            "sample_id": pa.array([sample_id for _, sample_id, _, _ in rows], pa.int64()),
            "source": pa.array([item.source for item, _, _, _ in rows], pa.string()),
            "source_index": pa.array([item.source_index for item, _, _, _ in rows], pa.int64()),
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, pa.int32())),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(masks, pa.uint8())),
            "num_tokens": pa.array(lengths, pa.int32()),
            "num_loss_tokens": pa.array([int(mask.sum()) for _, _, _, mask in rows], pa.int32()),
        },
        schema=_STAGING_SCHEMA,
    )


def _reject_table(rejects: Sequence[Reject]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "source": r.source,
                "source_index": r.source_index,
                "location": r.location,
                "reason": r.reason,
                "detail": r.detail,
            }
            for r in rejects
        ],
        schema=REJECT_SCHEMA,
    )


def length_histogram(num_tokens: np.ndarray) -> list[dict]:
    """Sample counts per power-of-two token-length bucket; the last bucket ends at the longest sample."""
    if len(num_tokens) == 0:
        return []
    top = int(np.max(num_tokens))
    # The last bucket ends at the longest sample, so the table also shows the maximum.
    edges = [edge for edge in HISTOGRAM_EDGES if edge <= top] + [top + 1]
    counts, _ = np.histogram(num_tokens, bins=edges)
    return [{"min": int(lo), "max": int(hi) - 1, "samples": int(c)} for lo, hi, c in zip(edges[:-1], edges[1:], counts)]


def read_tokenized_shard(tokenized_dir: Path, shard: str, columns: Sequence[str] | None = None) -> pa.Table:
    """One shard's samples, in input order; a shard the tokenized dataset lacks is named with what to do."""
    path = tokenized_shard_file(tokenized_dir, check_shard_key(shard))
    if not path.is_file():
        made = tokenized_shard_keys(tokenized_dir)
        if not made:
            raise TokenizedDataError(
                f"{path} not found: {tokenized_dir} holds no tokenized dataset; materialize tokenized_dataset first"
            )
        raise TokenizedDataError(
            f"{path} not found: the tokenized dataset was made with {len(made)} shards ({made[0]} .. {made[-1]}), "
            f"and {shard} is not one of them. The setting `shards` changed since: materialize tokenized_dataset "
            "again (hidden_states shards made from the old tokenization are then refused unless "
            "extraction.on_mismatch is start_over)"
        )
    return pq.read_table(path, columns=list(columns) if columns else None)


def tokenized_shard_keys(tokenized_dir: Path) -> list[str]:
    """The shards the tokenized dataset was made with (from summary.json); [] when there is none."""
    try:
        return [entry["shard"] for entry in TokenizedSummary.read(Path(tokenized_dir)).shards]
    except FileNotFoundError:
        return []


def read_rejects(tokenized_dir: Path) -> pa.Table:
    return pq.read_table(Path(tokenized_dir) / TOKENIZED_REJECTS_FILE)


def _all_records(paths: Iterable[Path]):
    for path in paths:
        yield from iter_records(Path(path))


def _batched(items, size):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _reject(item: Conversation, reason: str, detail: str) -> Reject:
    return Reject(item.source, item.source_index, item.location, reason, detail)


def _check_replaceable(target: Path) -> None:
    """Only a tokenized dataset (or nothing) may be replaced: never delete a folder this code did not write."""
    if target.is_dir() and any(target.iterdir()) and not (target / TOKENIZED_SUMMARY_FILE).is_file():
        raise TokenizedDataError(
            f"{target} exists and is not a tokenized dataset (no summary.json); refusing to replace it. "
            "Point output_dir at another folder, or move this one away"
        )


def _replace_dir(new: Path, target: Path) -> None:
    """Swap a finished directory into place; the old one is removed only after the swap."""
    old = None
    if target.exists():
        old = target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(target: Path) -> None:
    """Temporary and superseded directories that a crashed run left beside the target."""
    for leftover in target.parent.glob(f"{target.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in target.parent.glob(f"{target.name}.old-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _tree_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())
