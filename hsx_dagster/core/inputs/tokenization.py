"""Turn conversation files into the tokenized dataset: Parquet per shard, a rejects table, a summary.

Two streaming passes keep memory flat in the size of the inputs: the first tokenises into a staging
file and keeps only (sample_id, num_tokens) per sample; shards are then balanced by tokens; the
second pass copies rows into their shard's file. The new directory replaces the old one by rename,
so a crash never leaves a half-written tokenized dataset in place; a folder that is not a tokenized
dataset is never replaced.

The layout and its read API: `hsx_dagster.core.inputs.tokenized`. Parsing, rendering and tokenising run
in worker processes (setting ``dataset.tokenize_workers``): `hsx_dagster.core.inputs.workers`. The tables:
`hsx_dagster.core.inputs.sample_tables`; the tokenizer and its provenance: `hsx_dagster.core.inputs.tokenizer`.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from hsx_dagster.core.inputs.chat_template import TemplateMarkers, template_fingerprint
from hsx_dagster.core.inputs.readers import check_input_file, iter_raw_records
from hsx_dagster.core.inputs.records import RawRecord, Reject, RejectReason
from hsx_dagster.core.inputs.sample_tables import (
    STAGING_SCHEMA,
    WRITE_ROWS,
    SampleRow,
    reject_table,
    sample_table,
    write_shards,
)
from hsx_dagster.core.inputs.sharding import assign_shards, imbalance, previous_shards, shard_loads
from hsx_dagster.core.inputs.tokenized import (
    InputFile,
    ShardLoad,
    TokenizedDataError,
    TokenizedSummary,
    length_histogram,
    read_membership,
    stamped_digest,
)
from hsx_dagster.core.inputs.tokenizer import load_tokenizer, previous_tokenizer, tokenizer_change, tokenizer_provenance
from hsx_dagster.core.inputs.workers import Outcome, RecordProcessor, Refused, resolve_workers, tokenizer_threads_off
from hsx_dagster.core.settings import DatasetSettings, ModelSettings
from hsx_dagster.core.settings.choices import parse_auto_or_positive
from hsx_dagster.core.shard_keys import shard_keys
from hsx_dagster.core.storage.files import remove_leftovers, staging_dir_for, swap_in_dir
from hsx_dagster.core.storage.format import (
    REJECT_SCHEMA,
    TOKENIZED_REJECTS_FILE,
    TOKENIZED_SAMPLES_DIR,
    TOKENIZED_SUMMARY_FILE,
    TOKENIZED_VERSION,
)

BATCH_CONVERSATIONS = 512  # records read per batch handed to the processor
PROGRESS_EVERY_S = 5.0
log = logging.getLogger(__name__)


def tokenize_dataset(
    dataset: DatasetSettings,
    model: ModelSettings,
    out_dir: Path,
    *,
    shards: int,
    progress: Callable[[str], None] | None = None,
) -> TokenizedSummary:
    """Tokenise every file of ``dataset.paths`` with the tokenizer of ``model`` into ``shards`` shards under
    ``out_dir`` (replacing what was there once complete)."""
    started = time.perf_counter()
    report = progress or log.info
    paths, out_dir = list(dataset.paths), Path(out_dir)
    formats = {str(path): check_input_file(Path(path)) for path in paths}  # fail before loading anything
    _check_replaceable(out_dir)
    tokenizer = load_tokenizer(model.path, model.trust_remote_code)
    markers = TemplateMarkers.probe(tokenizer, name=f"tokenizer at {model.path}")
    provenance = tokenizer_provenance(tokenizer, model.path)
    previous = previous_tokenizer(out_dir)
    membership = read_membership(out_dir)  # samples keep their shard (stable membership, sharding.py)
    changed = tokenizer_change(previous, provenance)
    if changed:
        report(
            f"the tokenizer differs from the one the earlier tokenized dataset in {out_dir} was made with "
            f"({changed}); it is replaced, and hidden-state shards made from it are refused where their ids change"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out_dir)
    staging_dir = staging_dir_for(out_dir)
    (staging_dir / TOKENIZED_SAMPLES_DIR).mkdir(parents=True)
    try:
        first_pass = _FirstPass(paths, dataset.min_loss_tokens)
        first_pass.run(staging_dir, tokenizer, markers, dataset, model, _Progress(report, started))
        keys = shard_keys(shards)
        assignment = assign_shards(first_pass.num_tokens, first_pass.sample_ids, shards, membership)
        added, removed = _membership_changes(first_pass.sample_ids, assignment, membership, shards)
        write_shards(staging_dir / "staging.parquet", staging_dir / TOKENIZED_SAMPLES_DIR, assignment, keys)
        (staging_dir / "staging.parquet").unlink()
        loads = shard_loads(first_pass.num_tokens, assignment, shards)
        counts = np.bincount(assignment, minlength=shards)
        elapsed = time.perf_counter() - started
        summary = TokenizedSummary(
            format_version=TOKENIZED_VERSION,
            samples=len(first_pass.sample_ids),
            tokens=int(np.sum(first_pass.num_tokens)),
            loss_tokens=first_pass.loss_tokens,
            truncated=first_pass.truncated,
            rejects=dict(sorted(first_pass.rejects.items())),
            shards=[
                ShardLoad(k, int(c), int(t), int(a), int(r), *stamped_digest(staging_dir, k))
                for k, c, t, a, r in zip(keys, counts, loads, added, removed)
            ],
            imbalance=round(imbalance(loads), 6),
            histogram=length_histogram(first_pass.num_tokens),
            inputs=[InputFile(path=p, format=formats[p], **first_pass.per_input[p]) for p in map(str, paths)],
            tokenizer={
                "model_path": str(model.path),
                "vocab_size": len(tokenizer),
                "chat_template_sha256_16": template_fingerprint(tokenizer),
                "assistant_header": markers.assistant_header,
                "end_of_turn": markers.end_of_turn,
                "control_strings": list(markers.control_strings),
                "renders_content_parts": markers.content_parts,
                **provenance,
                **({"previous": previous, "changed": changed} if changed else {}),
            },
            options=_options(dataset, model, shards),
            elapsed_s=round(elapsed, 3),
            conversations_per_s=round(first_pass.records / elapsed, 1) if elapsed > 0 else 0.0,
            bytes_written=_tree_bytes(staging_dir),
            ignored_fields=dict(sorted(first_pass.ignored.items())),
            workers=first_pass.workers,
        )
        (staging_dir / TOKENIZED_SUMMARY_FILE).write_text(summary.to_json(), encoding="utf-8")
        swap_in_dir(staging_dir, out_dir)
    except BaseException:
        shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    _report_done(summary, shards, report)
    return summary


def _membership_changes(
    sample_ids: Sequence[int], assignment: np.ndarray, membership: tuple[np.ndarray, np.ndarray] | None, shards: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per shard: samples new to it, and samples it held in the previous tokenized dataset that are gone."""
    ids = np.asarray(sample_ids, dtype=np.int64)
    if membership is None:
        return np.bincount(assignment, minlength=shards), np.zeros(shards, dtype=np.int64)
    known_ids, known_shards = membership
    before = previous_shards(ids, known_ids, known_shards)
    added = np.bincount(assignment[before != assignment], minlength=shards)[:shards]
    after = previous_shards(known_ids, ids, assignment)
    left = known_shards[(after != known_shards)]
    removed = np.bincount(left, minlength=shards)[:shards]
    return added, removed


def _options(dataset: DatasetSettings, model: ModelSettings, shards: int) -> dict:
    """What the samples depend on besides the inputs and the tokenizer (summary.json's ``options``)."""
    return {
        "max_length": dataset.max_length,
        "min_loss_tokens": dataset.min_loss_tokens,
        "thinking": dataset.thinking,
        "loss_mask": dataset.loss_mask,
        "shards": shards,
        "trust_remote_code": model.trust_remote_code,
        "workers": parse_auto_or_positive(dataset.tokenize_workers),
    }


def _report_done(summary: TokenizedSummary, shards: int, report: Callable[[str], None]) -> None:
    report(
        f"tokenized {summary.samples} samples ({summary.tokens} tokens) into {shards} shards, "
        f"{summary.rejected} rejected, imbalance {summary.imbalance:.4f}, {summary.elapsed_s:.1f} s "
        f"({summary.conversations_per_s:.0f} conversations/s, {summary.workers} workers)"
    )
    if summary.ignored_fields:
        report(
            "input fields not understood (not rendered), conversations per field: "
            + ", ".join(f"{reason} {count}" for reason, count in summary.ignored_fields.items())
        )


class _Progress:
    """A progress line every few seconds of the first pass."""

    def __init__(self, report: Callable[[str], None], started: float) -> None:
        self.report, self.started, self.last = report, started, time.perf_counter()

    def tick(self, records: int, samples: int, workers: int) -> None:
        now = time.perf_counter()
        if now - self.last > PROGRESS_EVERY_S:
            self.last = now
            rate = records / (now - self.started)
            self.report(
                f"tokenizing: {records} conversations read, {samples} samples, {rate:.0f} conversations/s "
                f"({workers} workers)"
            )


class _FirstPass:
    """Every record read once, in input order: samples into the staging file (their ids and lengths kept for
    the shard assignment), rejects with their reason into the rejects file, counts per input file."""

    def __init__(self, paths: Sequence[Path], min_loss_tokens: int) -> None:
        self.paths, self.min_loss_tokens = list(paths), min_loss_tokens
        self.sample_ids: list[int] = []
        self.lengths: list[int] = []
        self.seen: dict[int, str] = {}  # sample id -> where it was first seen
        self.rejects: Counter = Counter()
        self.ignored: Counter = Counter()
        self.per_input = {
            str(p): {"records": 0, "samples": 0, "rejects": 0, "bytes": Path(p).stat().st_size} for p in paths
        }
        self.loss_tokens = self.truncated = self.records = 0
        self.workers = 1
        self._rows: list[SampleRow] = []
        self._reject_rows: list[Reject] = []

    @property
    def num_tokens(self) -> np.ndarray:
        return np.asarray(self.lengths, dtype=np.int64)

    def run(self, staging_dir: Path, tokenizer, markers, dataset, model, progress: _Progress) -> None:
        input_bytes = sum(entry["bytes"] for entry in self.per_input.values())
        self.workers = resolve_workers(dataset.tokenize_workers, input_bytes)
        processor = RecordProcessor(self.workers, tokenizer, markers, dataset, model)
        with (
            tokenizer_threads_off(),
            pq.ParquetWriter(staging_dir / "staging.parquet", STAGING_SCHEMA) as samples_out,
            pq.ParquetWriter(staging_dir / TOKENIZED_REJECTS_FILE, REJECT_SCHEMA) as rejects_out,
        ):
            try:
                for batch, outcomes in processor.run(_batched(_all_raw_records(self.paths), BATCH_CONVERSATIONS)):
                    for raw, outcome in zip(batch, outcomes):
                        self.add(raw, outcome)
                    self.write(samples_out, rejects_out, final=False)
                    progress.tick(self.records, len(self.sample_ids), self.workers)
                self.write(samples_out, rejects_out, final=True)
            finally:
                processor.close()

    def add(self, raw: RawRecord, outcome: Outcome) -> None:
        self.records += 1
        self.per_input[raw.source]["records"] += 1
        if isinstance(outcome, Reject):
            return self._reject(outcome)
        if outcome.sample_id in self.seen:
            detail = f"same conversation as {self.seen[outcome.sample_id]}"
            return self._reject(_reject(raw, RejectReason.DUPLICATE, detail))
        if isinstance(outcome, Refused):
            return self._reject(_reject(raw, outcome.error.reason, outcome.error.detail))
        self.seen[outcome.sample_id] = f"{raw.source} {raw.location}"
        self.ignored.update(set(outcome.ignored))
        tokens = outcome.tokens
        supervised = int(tokens.loss_mask.sum())
        if supervised < self.min_loss_tokens:
            cut = " after truncation to max_length" if tokens.truncated else ""
            detail = f"{supervised} supervised tokens{cut}, fewer than min_loss_tokens={self.min_loss_tokens}"
            return self._reject(_reject(raw, RejectReason.TOO_FEW_LOSS_TOKENS, detail))
        self.truncated += tokens.truncated
        self.loss_tokens += supervised
        self._rows.append((raw, outcome.sample_id, tokens.input_ids, tokens.loss_mask))
        self.per_input[raw.source]["samples"] += 1
        self.sample_ids.append(outcome.sample_id)
        self.lengths.append(len(tokens.input_ids))
        return None

    def write(self, samples_out: pq.ParquetWriter, rejects_out: pq.ParquetWriter, final: bool) -> None:
        """Staging rows in row groups of WRITE_ROWS (what is left, at the end); rejects as they come."""
        if self._rows and (final or len(self._rows) >= WRITE_ROWS):
            samples_out.write_table(sample_table(self._rows))
            self._rows.clear()
        if self._reject_rows:
            rejects_out.write_table(reject_table(self._reject_rows))
            self._reject_rows.clear()

    def _reject(self, item: Reject) -> None:
        self.rejects[item.reason] += 1
        self.per_input[item.source]["rejects"] += 1
        self._reject_rows.append(item)


def _all_raw_records(paths: Iterable[Path]) -> Iterator[RawRecord]:
    for path in paths:
        yield from iter_raw_records(Path(path))


def _batched(items, size):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _reject(item: RawRecord, reason: str, detail: str) -> Reject:
    return Reject(item.source, item.source_index, item.location, reason, detail)


def _check_replaceable(target: Path) -> None:
    """Only a tokenized dataset (or nothing) may be replaced: never delete a folder this code did not write."""
    if target.is_dir() and any(target.iterdir()) and not (target / TOKENIZED_SUMMARY_FILE).is_file():
        raise TokenizedDataError(
            f"{target} exists and is not a tokenized dataset (no summary.json); refusing to replace it. "
            "Point output_dir at another folder, or move this one away"
        )


def _tree_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())
