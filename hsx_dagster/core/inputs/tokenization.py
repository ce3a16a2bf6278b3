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

Parsing, rendering and tokenising run in worker processes (setting ``dataset.tokenize_workers``: auto =
every core, but no more than one per 256 KB of input, 1 = in this process). The main process only reads:
it hands the records over in chunks as read (a JSON line still as bytes) and takes the results back
in input order, so duplicates, rejects, sample order and the Parquet bytes are the same whatever the
worker count.
A worker is one core: the fast tokenizer's own thread pool is off in every worker and in the
in-process pass alike, so ``tokenize_workers`` bounds the cores tokenisation takes (it may run beside
extraction on the same machine).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hsx_dagster.core.choices import parse_auto_or_positive
from hsx_dagster.core.inputs.chat_template import (
    SampleRejected,
    TemplateError,
    TemplateMarkers,
    TokenizedConversation,
    render,
    sample_id_of,
    template_fingerprint,
    tokenize_rendered,
)
from hsx_dagster.core.inputs.conversations import (
    RawRecord,
    Reject,
    RejectReason,
    check_input_file,
    iter_raw_records,
    normalise_record,
)
from hsx_dagster.core.inputs.sharding import assign_shards, imbalance, shard_loads
from hsx_dagster.core.settings import DatasetSettings, ModelSettings, check_shard_key, shard_keys
from hsx_dagster.core.storage.files import remove_leftovers, staging_dir_for, swap_in_dir
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
WORKER_CHUNK = 64  # records per task handed to a worker process
WORKER_AHEAD = 3  # batches in flight per worker: the workers never wait for the reader
WRITE_ROWS = 4096
# `auto` starts one worker per this many bytes of input, up to every core: starting a worker (fork, pool,
# first task) costs about as much as tokenising 100-200 KB on one core, so a small input runs in-process.
AUTO_WORKER_BYTES = 256 * 1024
TOKENIZER_THREADS_VARIABLE = "TOKENIZERS_PARALLELISM"  # the Rust tokenizer's thread pool, on unless "false"
# Files of a Hugging Face tokenizer that decide how text becomes ids (hashed into the provenance).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
HISTOGRAM_EDGES = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

_STAGING_SCHEMA = pa.schema([f for f in SAMPLE_SCHEMA if f.name != "shard"])
log = logging.getLogger(__name__)


class TokenizedDataError(RuntimeError):
    """The tokenized dataset on disk is missing or is not what is asked for; the message says what to do."""


def resolve_workers(setting: int | str | None, input_bytes: int | None = None) -> int:
    """The worker count to use: the number ``dataset.tokenize_workers`` gives; for ``auto`` every core this
    process may run on, but no more than one per ``AUTO_WORKER_BYTES`` of input when its size is known."""
    workers = parse_auto_or_positive(setting)
    if workers is not None:
        return workers
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = max(1, os.cpu_count() or 1)
    if input_bytes is None:
        return cores
    return max(1, min(cores, input_bytes // AUTO_WORKER_BYTES))


@dataclass(frozen=True)
class ShardLoad:
    """One tokenized shard: its key and what it holds."""

    shard: str
    samples: int
    tokens: int


@dataclass(frozen=True)
class LengthBucket:
    """Samples of ``min`` to ``max`` tokens (both included)."""

    min: int
    max: int
    samples: int


@dataclass(frozen=True)
class InputFile:
    """One input file and what became of its records."""

    path: str
    format: str  # jsonl | json_array | parquet
    records: int
    samples: int
    rejects: int
    bytes: int


@dataclass
class TokenizedSummary:
    format_version: int
    samples: int
    tokens: int
    loss_tokens: int
    truncated: int
    rejects: dict[str, int]
    shards: list[ShardLoad]
    imbalance: float
    histogram: list[LengthBucket]
    inputs: list[InputFile]
    tokenizer: dict
    options: dict
    elapsed_s: float
    conversations_per_s: float
    bytes_written: int
    created_at: float = field(default_factory=time.time)
    # Fields of the inputs the pipeline does not understand (not rendered): conversations per reason.
    ignored_fields: dict[str, int] = field(default_factory=dict)
    workers: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def read(cls, tokenized_dir: Path) -> TokenizedSummary:
        data = json.loads((Path(tokenized_dir) / TOKENIZED_SUMMARY_FILE).read_text(encoding="utf-8"))
        data["shards"] = [ShardLoad(**entry) for entry in data["shards"]]
        data["histogram"] = [LengthBucket(**bucket) for bucket in data["histogram"]]
        data["inputs"] = [InputFile(**entry) for entry in data["inputs"]]
        return cls(**data)

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


def tokenizer_provenance(tokenizer, model_path: Path) -> dict:
    """What decides the ids besides the inputs: the tokenizer's files, the class transformers loaded
    them as (it picks the class from ``model_type``, and two classes may tokenise the same files
    differently) and the library versions."""
    import tokenizers
    import transformers

    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = Path(model_path) / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return {
        "class": type(tokenizer).__name__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "files_sha256": digest.hexdigest(),
    }


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
    paths, model_path = list(dataset.paths), model.path
    formats = {str(path): check_input_file(Path(path)) for path in paths}  # fail before loading anything
    _check_replaceable(Path(out_dir))
    tokenizer = load_tokenizer(model_path, model.trust_remote_code)
    markers = TemplateMarkers.probe(tokenizer, name=f"tokenizer at {model_path}")
    provenance = tokenizer_provenance(tokenizer, model_path)
    previous = _previous_tokenizer(Path(out_dir))
    changed = _tokenizer_change(previous, provenance)
    if changed:
        report(
            f"the tokenizer differs from the one the earlier tokenized dataset in {out_dir} was made with "
            f"({changed}); it is replaced, and hidden-state shards made from it are refused where their ids change"
        )

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out_dir)
    staging_dir = staging_dir_for(out_dir)
    (staging_dir / TOKENIZED_SAMPLES_DIR).mkdir(parents=True)
    try:
        first_pass = _tokenize_into(
            staging_dir / "staging.parquet",
            staging_dir / TOKENIZED_REJECTS_FILE,
            paths,
            tokenizer,
            markers,
            dataset,
            model,
            report,
            started,
        )
        keys = shard_keys(shards)
        assignment = assign_shards(first_pass.num_tokens, first_pass.sample_ids, shards)
        _write_shards(staging_dir / "staging.parquet", staging_dir / TOKENIZED_SAMPLES_DIR, assignment, keys)
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
            shards=[ShardLoad(k, int(c), int(t)) for k, c, t in zip(keys, counts, loads)],
            imbalance=round(imbalance(loads), 6),
            histogram=length_histogram(first_pass.num_tokens),
            inputs=[InputFile(path=p, format=formats[p], **first_pass.per_input[p]) for p in map(str, paths)],
            tokenizer={
                "model_path": str(model_path),
                "vocab_size": len(tokenizer),
                "chat_template_sha256_16": template_fingerprint(tokenizer),
                "assistant_header": markers.assistant_header,
                "end_of_turn": markers.end_of_turn,
                "control_strings": list(markers.control_strings),
                "renders_content_parts": markers.content_parts,
                **provenance,
                **({"previous": previous, "changed": changed} if changed else {}),
            },
            options={  # what the samples depend on besides the inputs and the tokenizer
                "max_length": dataset.max_length,
                "min_loss_tokens": dataset.min_loss_tokens,
                "thinking": dataset.thinking,
                "shards": shards,
                "trust_remote_code": model.trust_remote_code,
                "workers": parse_auto_or_positive(dataset.tokenize_workers),
            },
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
    return summary


def _previous_tokenizer(out_dir: Path) -> dict | None:
    try:
        return TokenizedSummary.read(out_dir).tokenizer
    except (FileNotFoundError, TypeError, ValueError):
        return None


def _tokenizer_change(previous: dict | None, current: dict) -> str:
    """What changed in the tokenizer since the earlier tokenized dataset ('' when nothing or no record)."""
    if not previous:
        return ""
    changes = [
        f"{key} {previous.get(key)!r} -> {current[key]!r}"
        for key in ("class", "files_sha256", "transformers_version", "tokenizers_version")
        if previous.get(key) != current[key]
    ]
    return "; ".join(changes)


@dataclass
class _FirstPass:
    sample_ids: np.ndarray
    num_tokens: np.ndarray
    loss_tokens: int
    truncated: int
    records: int
    rejects: Counter
    per_input: dict[str, dict]
    ignored: Counter
    workers: int


# What reading one record gives: a Reject (not a usable conversation), or its sample id, the fields
# not understood, and its tokens or why the template could not take it.
Outcome = Reject | tuple[int, tuple[str, ...], TokenizedConversation | SampleRejected]


def process_records(
    records: Sequence[RawRecord], tokenizer, markers: TemplateMarkers, thinking: str, max_length: int
) -> list[Outcome]:
    """Parse, render and tokenise records (the work a worker process does), in order."""
    outcomes: list[Outcome | None] = [None] * len(records)
    rendered, places = [], []
    for position, raw in enumerate(records):
        item = normalise_record(raw)
        if isinstance(item, Reject):
            outcomes[position] = item
            continue
        sample_id = sample_id_of(item.messages, item.tools)
        try:
            rendered.append(render(item, tokenizer, markers, thinking))
            places.append((position, sample_id, item.ignored))
        except SampleRejected as exc:
            outcomes[position] = (sample_id, item.ignored, exc)
    for (position, sample_id, ignored), tokens in zip(places, tokenize_rendered(rendered, tokenizer, max_length)):
        outcomes[position] = (sample_id, ignored, tokens)
    return outcomes  # type: ignore[return-value]  # every position is filled above


_WORKER_STATE: dict = {}


def _worker_start(model_path: str, trust_remote_code: bool, thinking: str, max_length: int) -> None:
    # One process per core already: the tokenizer's own thread pool would only oversubscribe the cores.
    os.environ[TOKENIZER_THREADS_VARIABLE] = "false"
    # The objects inherited from the parent are never this worker's garbage: kept out of its collections,
    # they are not walked (nor their pages copied) every time the worker's own allocations trigger one.
    gc.freeze()
    if "tokenizer" not in _WORKER_STATE:  # forked workers inherit the parent's tokenizer and markers
        tokenizer = load_tokenizer(Path(model_path), trust_remote_code)
        _WORKER_STATE.update(tokenizer=tokenizer, markers=TemplateMarkers.probe(tokenizer))
    _WORKER_STATE.update(thinking=thinking, max_length=max_length)


def _worker_run(records: list[RawRecord]) -> list:
    state = _WORKER_STATE
    outcomes = process_records(records, state["tokenizer"], state["markers"], state["thinking"], state["max_length"])
    # Raw bytes travel back faster than pickled arrays and dataclasses.
    return [
        outcome
        if isinstance(outcome, Reject) or isinstance(outcome[2], SampleRejected)
        else (
            outcome[0],
            outcome[1],
            outcome[2].input_ids.tobytes(),
            outcome[2].loss_mask.tobytes(),
            outcome[2].truncated,
        )
        for outcome in outcomes
    ]


def _from_worker(result) -> Outcome:
    if isinstance(result, Reject) or len(result) == 3:
        return result
    sample_id, ignored, ids, mask, truncated = result
    tokens = TokenizedConversation(np.frombuffer(ids, np.int32), np.frombuffer(mask, np.uint8), truncated)
    return sample_id, ignored, tokens


@contextlib.contextmanager
def _tokenizer_threads_off() -> Iterator[None]:
    """One worker in this process is one core too: the fast tokenizer reads this variable at every
    batch call, so it is off for the pass and restored after it."""
    before = os.environ.get(TOKENIZER_THREADS_VARIABLE)
    os.environ[TOKENIZER_THREADS_VARIABLE] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TOKENIZER_THREADS_VARIABLE, None)
        else:
            os.environ[TOKENIZER_THREADS_VARIABLE] = before


def _pool_context() -> multiprocessing.context.BaseContext:
    """fork where the platform has it: workers start at once with the tokenizer already loaded, and no
    script needs a ``__main__`` guard; spawn elsewhere (each worker then loads the tokenizer itself)."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


class _Processor:
    """Renders and tokenises batches, in this process or in a pool of workers, results in input order."""

    def __init__(self, workers: int, tokenizer, markers, dataset: DatasetSettings, model: ModelSettings) -> None:
        self.workers = workers
        self.tokenizer, self.markers, self.dataset = tokenizer, markers, dataset
        self.pool: ProcessPoolExecutor | None = None
        if workers > 1:
            context = _pool_context()
            _WORKER_STATE.clear()
            if context.get_start_method() == "fork":
                _WORKER_STATE.update(tokenizer=tokenizer, markers=markers)
            self.pool = ProcessPoolExecutor(
                max_workers=workers,
                mp_context=context,
                initializer=_worker_start,
                initargs=(str(model.path), model.trust_remote_code, dataset.thinking, dataset.max_length),
            )

    def run(self, batches: Iterator[list[RawRecord]]) -> Iterator[tuple[list[RawRecord], list[Outcome]]]:
        """(batch, the outcome of each of its records) for every batch, in order."""
        dataset = self.dataset
        if self.pool is None:
            for batch in batches:
                yield batch, process_records(batch, self.tokenizer, self.markers, dataset.thinking, dataset.max_length)
            return
        pending: deque[tuple[list, list[Future]]] = deque()
        for batch in batches:
            chunks = [batch[at : at + WORKER_CHUNK] for at in range(0, len(batch), WORKER_CHUNK)]
            pending.append((batch, [self.pool.submit(_worker_run, chunk) for chunk in chunks]))
            while len(pending) > WORKER_AHEAD * self.workers:
                yield self._collect(pending.popleft())
        while pending:
            yield self._collect(pending.popleft())

    @staticmethod
    def _collect(entry: tuple[list, list[Future]]) -> tuple[list, list[Outcome]]:
        batch, futures = entry
        return batch, [_from_worker(result) for future in futures for result in future.result()]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            _WORKER_STATE.clear()


def _tokenize_into(
    staging_file,
    rejects_file,
    paths,
    tokenizer,
    markers,
    dataset: DatasetSettings,
    model: ModelSettings,
    report,
    started,
) -> _FirstPass:
    sample_ids: list[int] = []
    num_tokens: list[int] = []
    seen: dict[int, str] = {}
    rejects: Counter = Counter()
    ignored: Counter = Counter()
    per_input = {str(p): {"records": 0, "samples": 0, "rejects": 0, "bytes": Path(p).stat().st_size} for p in paths}
    loss_tokens = truncated = records = 0
    last_report = time.perf_counter()
    workers = resolve_workers(dataset.tokenize_workers, sum(entry["bytes"] for entry in per_input.values()))
    processor = _Processor(workers, tokenizer, markers, dataset, model)

    with (
        _tokenizer_threads_off(),
        pq.ParquetWriter(staging_file, _STAGING_SCHEMA) as samples_out,
        pq.ParquetWriter(rejects_file, REJECT_SCHEMA) as rejects_out,
    ):
        reject_rows: list[Reject] = []
        # Staging rows go out in row groups of WRITE_ROWS: fewer, larger writes cost the reading process less.
        rows: list[tuple[RawRecord, int, np.ndarray, np.ndarray]] = []

        def record_reject(item: Reject) -> None:
            rejects[item.reason] += 1
            per_input[item.source]["rejects"] += 1
            reject_rows.append(item)

        try:
            for batch, outcomes in processor.run(_batched(_all_raw_records(paths), BATCH_CONVERSATIONS)):
                for raw, outcome in zip(batch, outcomes):
                    records += 1
                    per_input[raw.source]["records"] += 1
                    if isinstance(outcome, Reject):
                        record_reject(outcome)
                        continue
                    sample_id, ignored_fields, result = outcome
                    if sample_id in seen:
                        record_reject(_reject(raw, RejectReason.DUPLICATE, f"same conversation as {seen[sample_id]}"))
                        continue
                    if isinstance(result, SampleRejected):
                        record_reject(_reject(raw, result.reason, result.detail))
                        continue
                    seen[sample_id] = f"{raw.source} {raw.location}"
                    ignored.update(set(ignored_fields))
                    supervised = int(result.loss_mask.sum())
                    if supervised < dataset.min_loss_tokens:
                        cut = " after truncation to max_length" if result.truncated else ""
                        record_reject(
                            _reject(
                                raw,
                                RejectReason.TOO_FEW_LOSS_TOKENS,
                                f"{supervised} supervised tokens{cut}, fewer than "
                                f"min_loss_tokens={dataset.min_loss_tokens}",
                            )
                        )
                        continue
                    truncated += result.truncated
                    loss_tokens += supervised
                    rows.append((raw, sample_id, result.input_ids, result.loss_mask))
                    per_input[raw.source]["samples"] += 1
                    sample_ids.append(sample_id)
                    num_tokens.append(len(result.input_ids))
                if len(rows) >= WRITE_ROWS:
                    samples_out.write_table(_sample_table(rows))
                    rows.clear()
                if reject_rows:
                    rejects_out.write_table(_reject_table(reject_rows))
                    reject_rows.clear()

                now = time.perf_counter()
                if now - last_report > 5:
                    last_report = now
                    rate = records / (now - started)
                    report(
                        f"tokenizing: {records} conversations read, {len(sample_ids)} samples, "
                        f"{rate:.0f} conversations/s ({workers} workers)"
                    )
            if rows:
                samples_out.write_table(_sample_table(rows))
        finally:
            processor.close()

    return _FirstPass(
        np.asarray(sample_ids, dtype=np.int64),
        np.asarray(num_tokens, dtype=np.int64),
        loss_tokens,
        truncated,
        records,
        rejects,
        per_input,
        ignored,
        workers,
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


def length_histogram(num_tokens: np.ndarray) -> list[LengthBucket]:
    """Sample counts per power-of-two token-length bucket; the last bucket ends at the longest sample."""
    if len(num_tokens) == 0:
        return []
    top = int(np.max(num_tokens))
    # The last bucket ends at the longest sample, so the table also shows the maximum.
    edges = [edge for edge in HISTOGRAM_EDGES if edge <= top] + [top + 1]
    counts, _ = np.histogram(num_tokens, bins=edges)
    return [LengthBucket(int(lo), int(hi) - 1, int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], counts)]


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


def tokenized_digest(table: pa.Table) -> str:
    """A hash of a shard's samples as extraction stores them (ids, tokens and loss masks): hidden states made
    from other tokenized samples are never mixed with these (shard.json records it; assembly compares it)."""
    digest = hashlib.sha256()
    digest.update(table.column("sample_id").to_numpy().tobytes())
    for column, dtype in (("input_ids", np.int32), ("loss_mask", np.uint8)):
        for chunk in table.column(column).chunks:
            digest.update(chunk.values.to_numpy(zero_copy_only=False).astype(dtype).tobytes())
            digest.update(np.diff(chunk.offsets.to_numpy()).astype(np.int64).tobytes())
    return digest.hexdigest()


def tokenized_shard_keys(tokenized_dir: Path) -> list[str]:
    """The shards the tokenized dataset was made with (from summary.json); [] when there is none."""
    try:
        return [entry.shard for entry in TokenizedSummary.read(Path(tokenized_dir)).shards]
    except FileNotFoundError:
        return []


def read_rejects(tokenized_dir: Path) -> pa.Table:
    return pq.read_table(Path(tokenized_dir) / TOKENIZED_REJECTS_FILE)


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
