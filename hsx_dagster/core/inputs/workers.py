"""Parsing, rendering and tokenising records, in this process or in a pool of worker processes.

The main process only reads: it hands the records over in chunks as read (a JSON line still as bytes) and
takes the results back in input order, so duplicates, rejects, sample order and the Parquet bytes are the
same whatever the worker count. A worker is one core: the fast tokenizer's own thread pool is off in every
worker and in the in-process pass alike, so ``dataset.tokenize_workers`` bounds the cores tokenisation takes
(it may run beside extraction on the same machine).

What one record gives (`Outcome`) is one of three typed messages: the parser's `Reject`, `Refused` (the
chat template could not take it) or `Tokenized`; a worker sends `Tokenized` back as `_WireTokens` (the
arrays as raw bytes, which travel faster than pickled arrays).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hsx_dagster.core.inputs.chat_template import (
    SampleRejected,
    TemplateMarkers,
    TokenizedConversation,
    render,
    sample_id_of,
    tokenize_rendered,
)
from hsx_dagster.core.inputs.normalise import normalise_record
from hsx_dagster.core.inputs.records import RawRecord, Reject
from hsx_dagster.core.inputs.tokenizer import load_tokenizer
from hsx_dagster.core.settings import DatasetSettings, ModelSettings
from hsx_dagster.core.settings.choices import parse_auto_or_positive

WORKER_CHUNK = 64  # records per task handed to a worker process
WORKER_AHEAD = 3  # batches in flight per worker: the workers never wait for the reader
# `auto` starts one worker per this many bytes of input, up to every core: on a small input starting a worker
# (fork, pool, first task) costs more than it saves, so it runs in-process (docs/benchmarks.md).
AUTO_WORKER_BYTES = 256 * 1024
TOKENIZER_THREADS_VARIABLE = "TOKENIZERS_PARALLELISM"  # the Rust tokenizer's thread pool, on unless "false"


class Tokenized(NamedTuple):
    """A conversation that became a sample's tokens."""

    sample_id: int
    ignored: tuple[str, ...]  # its fields not understood (not rendered)
    tokens: TokenizedConversation


class Refused(NamedTuple):
    """A conversation the chat template could not take (or whose content forges a turn)."""

    sample_id: int
    ignored: tuple[str, ...]
    error: SampleRejected


class _WireTokens(NamedTuple):
    """`Tokenized` as a worker sends it back."""

    sample_id: int
    ignored: tuple[str, ...]
    input_ids: bytes  # int32
    loss_mask: bytes  # uint8
    truncated: bool


Outcome = Reject | Refused | Tokenized


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


def process_records(
    records: Sequence[RawRecord],
    tokenizer,
    markers: TemplateMarkers,
    thinking: str,
    max_length: int,
    loss_mask: str = "assistant",
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
            rendered.append(render(item, tokenizer, markers, thinking, loss_mask))
            places.append((position, sample_id, item.ignored))
        except SampleRejected as exc:
            outcomes[position] = Refused(sample_id, item.ignored, exc)
    for (position, sample_id, ignored), tokens in zip(places, tokenize_rendered(rendered, tokenizer, max_length)):
        outcomes[position] = Tokenized(sample_id, ignored, tokens)
    return outcomes  # type: ignore[return-value]  # every position is filled above


_WORKER_STATE: dict = {}


def _worker_start(model_path: str, trust_remote_code: bool, thinking: str, max_length: int, loss_mask: str) -> None:
    # One process per core already: the tokenizer's own thread pool would only oversubscribe the cores.
    os.environ[TOKENIZER_THREADS_VARIABLE] = "false"
    # The objects inherited from the parent are never this worker's garbage: kept out of its collections,
    # they are not walked (nor their pages copied) every time the worker's own allocations trigger one.
    gc.freeze()
    if "tokenizer" not in _WORKER_STATE:  # forked workers inherit the parent's tokenizer and markers
        tokenizer = load_tokenizer(Path(model_path), trust_remote_code)
        _WORKER_STATE.update(tokenizer=tokenizer, markers=TemplateMarkers.probe(tokenizer))
    _WORKER_STATE.update(thinking=thinking, max_length=max_length, loss_mask=loss_mask)


def _worker_run(records: list[RawRecord]) -> list[Reject | Refused | _WireTokens]:
    state = _WORKER_STATE
    outcomes = process_records(
        records, state["tokenizer"], state["markers"], state["thinking"], state["max_length"], state["loss_mask"]
    )
    return [_to_wire(outcome) for outcome in outcomes]


def _to_wire(outcome: Outcome) -> Reject | Refused | _WireTokens:
    if not isinstance(outcome, Tokenized):
        return outcome
    tokens = outcome.tokens
    return _WireTokens(
        outcome.sample_id, outcome.ignored, tokens.input_ids.tobytes(), tokens.loss_mask.tobytes(), tokens.truncated
    )


def _from_wire(message: Reject | Refused | _WireTokens) -> Outcome:
    if not isinstance(message, _WireTokens):
        return message
    ids, mask = np.frombuffer(message.input_ids, np.int32), np.frombuffer(message.loss_mask, np.uint8)
    return Tokenized(message.sample_id, message.ignored, TokenizedConversation(ids, mask, message.truncated))


@contextlib.contextmanager
def tokenizer_threads_off() -> Iterator[None]:
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


class RecordProcessor:
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
                initargs=(
                    str(model.path),
                    model.trust_remote_code,
                    dataset.thinking,
                    dataset.max_length,
                    dataset.loss_mask,
                ),
            )

    def run(self, batches: Iterator[list[RawRecord]]) -> Iterator[tuple[list[RawRecord], list[Outcome]]]:
        """(batch, the outcome of each of its records) for every batch, in order."""
        dataset = self.dataset
        if self.pool is None:
            for batch in batches:
                yield (
                    batch,
                    process_records(
                        batch, self.tokenizer, self.markers, dataset.thinking, dataset.max_length, dataset.loss_mask
                    ),
                )
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
        return batch, [_from_wire(message) for future in futures for message in future.result()]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            _WORKER_STATE.clear()
