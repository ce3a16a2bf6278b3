"""One regeneration run end to end: check the backend, skip what is committed, regenerate the rest
in committed parts, and write the result and its summary.

The backends (`openai_backend.OpenAIBackend`, `local_backend.LocalBackend`) only turn prompts into
responses; this module owns the order of work, the commits, the counters and the progress lines.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hsx_dagster.core.inputs.chat_template import THINK_OPEN
from hsx_dagster.core.inputs.readers import check_input_file
from hsx_dagster.core.model.info import ModelInfo
from hsx_dagster.core.regenerate.store import RegenStore
from hsx_dagster.core.regenerate.turns import ConversationJob, FailureReason, SourceConversation, iter_inputs
from hsx_dagster.core.settings import RegenerateSettings

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 10.0


class RegenerationError(RuntimeError):
    """Regeneration cannot go on (no endpoint reachable, wrong model served, ...); the message names the URL."""


# The settings a run records in its summary: what the responses depend on and how the run is cut into commits.
RUN_OPTIONS = (
    "turns",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "chat_template_kwargs",
    "on_truncated",
    "chunk_conversations",
    "retry_failed",
)


def fingerprint(settings: RegenerateSettings, model: ModelInfo) -> dict[str, Any]:
    """What the responses depend on: the model, and the settings of the sampling and of which turns."""
    return {
        **model.fingerprint(),
        "turns": settings.turns,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "seed": settings.seed,
        "chat_template_kwargs": dict(sorted(settings.chat_template_kwargs.items())),
        "on_truncated": settings.on_truncated,
    }


@dataclass
class Stats:
    """Counters of one run, shared by the run loop and the backend."""

    pending: int = 0
    already_done: int = 0
    started: float = field(default_factory=time.perf_counter)
    regenerated: int = 0
    failed: int = 0
    failures: Counter = field(default_factory=Counter)
    generated_tokens: int = 0
    response_chars: int = 0
    responses: int = 0
    truncated_turns: int = 0
    kept_tool_calls: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    parts: int = 0

    def endpoint(self, name: str) -> dict[str, Any]:
        return self.endpoints.setdefault(
            name, {"conversations": 0, "requests": 0, "errors": 0, "generated_tokens": 0, "alive": True}
        )

    @property
    def elapsed(self) -> float:
        return max(time.perf_counter() - self.started, 1e-9)

    def line(self) -> str:
        finished = self.regenerated + self.failed
        rate = finished / self.elapsed
        left = self.pending - finished
        eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
        share = ", ".join(
            f"{url} {e['conversations']} conv/{e['errors']} err{'' if e['alive'] else ' (down)'}"
            for url, e in self.endpoints.items()
        )
        return (
            f"regenerating: {finished}/{self.pending} conversations ({self.failed} failed), "
            f"{rate:.2f} conversations/s, {self.generated_tokens / self.elapsed:.1f} generated tokens/s, "
            f"ETA {eta}; {share}"
        )

    def as_dict(self) -> dict[str, Any]:
        total = sum(e["conversations"] for e in self.endpoints.values()) or 1
        return {
            "pending_at_start": self.pending,
            "already_committed": self.already_done,
            "regenerated": self.regenerated,
            "failed": self.failed,
            "failures_by_reason": dict(sorted(self.failures.items())),
            "elapsed_s": round(self.elapsed, 3),
            "conversations_per_s": round((self.regenerated + self.failed) / self.elapsed, 3),
            "generated_tokens": self.generated_tokens,
            "generated_tokens_per_s": round(self.generated_tokens / self.elapsed, 1),
            "responses": self.responses,
            "mean_response_tokens": round(self.generated_tokens / self.responses, 1) if self.responses else 0.0,
            "mean_response_chars": round(self.response_chars / self.responses, 1) if self.responses else 0.0,
            "truncated_turns": self.truncated_turns,
            "kept_tool_calls": self.kept_tool_calls,
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            "endpoints": {
                url: {**e, "share": round(e["conversations"] / total, 4)} for url, e in self.endpoints.items()
            },
            "parts_committed": self.parts,
        }


class Backend(Protocol):
    name: str

    def preflight(self) -> dict[str, Any]:
        """Check before any work that generation can run; raise `RegenerationError` naming what is wrong."""
        ...

    def run(self, jobs: Iterator[ConversationJob], finished: Callable[[ConversationJob], None], stats: Stats) -> None:
        """Regenerate every job, calling ``finished`` once for each (done or failed)."""
        ...


class _Committer:
    """Collects finished conversations and commits them in parts of ``chunk`` conversations."""

    def __init__(self, store: RegenStore, chunk: int, stats: Stats, report: Callable[[str], None]) -> None:
        self.store, self.chunk, self.stats, self.report = store, chunk, stats, report
        self.ok: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.last_report = time.perf_counter()

    def __call__(self, job: ConversationJob) -> None:
        stats = self.stats
        stats.responses += job.requests
        stats.generated_tokens += job.completion_tokens
        stats.response_chars += job.response_chars
        stats.truncated_turns += job.truncated_turns
        stats.kept_tool_calls += job.kept_tool_calls
        stats.finish_reasons.update(job.finish_reasons)
        if job.failure is not None:
            stats.failed += 1
            stats.failures[job.failure.reason] += 1
            self.failed.append(job.failure_record())
        else:
            stats.regenerated += 1
            self.ok.append(job.record())
        if len(self.ok) + len(self.failed) >= self.chunk:
            self.flush()
        now = time.perf_counter()
        if now - self.last_report >= PROGRESS_EVERY_S:
            self.last_report = now
            self.report(stats.line())

    def flush(self) -> None:
        if self.ok or self.failed:
            self.store.commit(self.ok, self.failed)
            self.stats.parts += 1
            self.ok, self.failed = [], []


def regenerate(
    paths: Sequence[Path],
    model_path: Path,
    out_dir: Path,
    options: RegenerateSettings,
    backend: Backend,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Regenerate every input conversation not yet committed under ``out_dir`` as the ``regenerate`` settings
    say (the backend built from the same settings); returns the summary."""
    report = progress or log.info
    for path in paths:
        check_input_file(Path(path))  # a bad input file fails before any request
    checked = backend.preflight()
    report(f"{backend.name}: {checked}")
    stats = Stats()
    with RegenStore(Path(out_dir), fingerprint(options, ModelInfo.read(model_path))) as store:
        seen: set[str] = set()
        for item in iter_inputs(paths):
            if isinstance(item, SourceConversation) and item.id not in seen:
                seen.add(item.id)
                if store.is_settled(item.id, options.retry_failed):
                    stats.already_done += 1
                else:
                    stats.pending += 1
        report(
            f"{len(seen)} conversations in {len(paths)} input files: {stats.already_done} already committed, "
            f"{stats.pending} to regenerate ({backend.name}, turns={options.turns})"
        )

        def jobs() -> Iterator[ConversationJob]:
            taken: set[str] = set()
            for item in iter_inputs(paths):
                if isinstance(item, SourceConversation) and item.id not in taken:
                    taken.add(item.id)
                    if not store.is_settled(item.id, options.retry_failed):
                        yield ConversationJob(item, options.turns, options.on_truncated)

        committer = _Committer(store, options.chunk_conversations, stats, report)
        stats.started = time.perf_counter()
        try:
            backend.run(jobs(), committer, stats)
        finally:
            committer.flush()  # whatever finished is kept, also when the run fails
            report(stats.line())
        result = store.consolidate(iter_inputs(paths))
        summary = {
            "backend": backend.name,
            "preflight": checked,
            "inputs": [str(p) for p in paths],
            "input_records": result.inputs,
            "conversations": result.conversations,
            "failed": result.failed,
            "failures_by_reason": result.failures,
            "options": options.model_dump(include=set(RUN_OPTIONS)),
            "run": stats.as_dict(),
            "created_at": time.time(),
        }
        store.write_summary(summary)
    report(
        f"regenerated conversations: {result.conversations} of {result.inputs} input records, "
        f"{result.failed} failed or left out ({result.failures})"
    )
    return summary


def template_failure(job: ConversationJob, exc: Exception) -> None:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    job.fail(FailureReason.TEMPLATE_ERROR, f"messages[{job.pending[0]}]: the chat template failed: {first}")


class PromptRenderer:
    """The target's chat template, applied the way the servers apply it (generation prompt added)."""

    def __init__(self, model_path: Path, chat_template_kwargs: dict[str, Any], trust_remote_code: bool = False):
        from transformers import AutoTokenizer  # heavy import, kept off module import

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
        self.kwargs = dict(chat_template_kwargs)

    def render(self, job: ConversationJob) -> str:
        rendered = self.tokenizer.apply_chat_template(
            job.prompt(),
            tools=job.tools,  # type: ignore[arg-type]  # JSON schemas, which the template accepts
            add_generation_prompt=True,
            tokenize=False,
            **self.kwargs,
        )
        return str(rendered)


def opens_think(prompt: str) -> bool:
    return prompt.rstrip().endswith(THINK_OPEN)
