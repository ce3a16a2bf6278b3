"""The resumable output of regeneration, under ``<output_dir>/regenerated/``::

    manifest.json                 format, version, the fingerprint of what the responses depend on
    commits.jsonl                 the commit log: one line per committed part (its ids, ok and failed)
    parts/conversations-NNNNNN.jsonl   regenerated conversations of one part (OpenAI chat form)
    parts/failed-NNNNNN.jsonl          conversations of one part that failed, with the reason
    conversations.jsonl           the result: every regenerated conversation of the current inputs, once
    failures.jsonl                every input record that is not in conversations.jsonl, with the reason
    summary.json                  counts, rates, per-endpoint share, finish reasons (the last run)
    .lock                         held by the run writing here

A part is written whole (temporary name, fsync, rename), then its line is appended to the commit
log (fsync): the part is committed when its line is, and only then. A crash at any point loses at
most the conversations of the part being written; a part file without its line is removed when the
next run opens the store, so nothing is counted twice. Re-runs skip every id of the log.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx_dagster.core.inputs.records import Reject
from hsx_dagster.core.regenerate.turns import FailureReason, SourceConversation
from hsx_dagster.core.storage.atomic import StoreError, append_lines, drop_torn_tail, read_lines, write_atomic
from hsx_dagster.core.storage.files import FileLock

FORMAT = "hsx-regenerated"
VERSION = 1
MANIFEST_FILE = "manifest.json"
COMMITS_FILE = "commits.jsonl"
PARTS_DIR = "parts"
CONVERSATIONS_FILE = "conversations.jsonl"
FAILURES_FILE = "failures.jsonl"
SUMMARY_FILE = "summary.json"
LOCK_FILE = ".lock"
_PART = re.compile(r"(conversations|failed)-(\d{6,})\.jsonl")


def part_file(root: Path, kind: str, number: int) -> Path:
    return root / PARTS_DIR / f"{kind}-{number:06d}.jsonl"


@dataclass
class Consolidated:
    conversations: int
    failures: dict[str, int]
    inputs: int  # input records (conversations, duplicates and parser rejects)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())


@dataclass
class CommitLog:
    ok: dict[str, int] = field(default_factory=dict)  # id -> part holding the conversation
    failed: dict[str, int] = field(default_factory=dict)  # id -> latest part recording it as failed
    parts: list[int] = field(default_factory=list)


class RegenStore:
    """One run's handle on ``<output_dir>/regenerated``; use as a context manager (it holds the lock)."""

    def __init__(self, root: Path, fingerprint: dict[str, Any]) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self._lock: FileLock | None = None
        self.log = CommitLog()

    def __enter__(self) -> RegenStore:
        (self.root / PARTS_DIR).mkdir(parents=True, exist_ok=True)
        lock = FileLock.try_acquire(self.root / LOCK_FILE)
        if lock is None:
            holder = FileLock.holder(self.root / LOCK_FILE) or "another run"
            raise StoreError(f"{self.root} is being written by {holder}; wait for that run to end")
        lock.record_holder(f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        self._lock = lock
        try:
            self._check_manifest()
            self._recover()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _check_manifest(self) -> None:
        path = self.root / MANIFEST_FILE
        if path.is_file():
            manifest = json.loads(path.read_text(encoding="utf-8"))
            if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
                raise StoreError(f"{path}: not a regenerated-conversations folder of version {VERSION}")
            old = manifest.get("fingerprint", {})
            changed = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
            if changed:
                shown = "; ".join(f"{k}: {old.get(k)!r} -> {self.fingerprint.get(k)!r}" for k in changed)
                raise StoreError(
                    f"{self.root} holds responses made with other settings ({shown}); they would mix with new "
                    f"ones. Restore those settings to finish that run, or move {self.root} away to start over"
                )
            return
        if (self.root / COMMITS_FILE).exists():
            raise StoreError(f"{self.root}: commits.jsonl without manifest.json; move the folder away to start over")
        payload = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint, "created_at": time.time()}
        write_atomic(path, json.dumps(payload, indent=2).encode())

    def _recover(self) -> None:
        """Read the commit log; drop its torn last line and every part file it does not list."""
        commits = self.root / COMMITS_FILE
        drop_torn_tail(commits)
        self.log = CommitLog()
        for entry in read_lines(commits):
            number = int(entry["part"])
            self.log.parts.append(number)
            for conversation_id in entry["ok"]:
                if conversation_id in self.log.ok:
                    raise StoreError(
                        f"{commits}: id {conversation_id} committed twice "
                        f"(parts {self.log.ok[conversation_id]} and {number})"
                    )
                self.log.ok[conversation_id] = number
                self.log.failed.pop(conversation_id, None)
            for conversation_id in entry["failed"]:
                self.log.failed[conversation_id] = number
        committed = set(self.log.parts)
        for path in (self.root / PARTS_DIR).iterdir():
            match = _PART.fullmatch(path.name)
            if match is None or int(match.group(2)) not in committed:
                path.unlink()  # a part whose commit line was never written, or a temporary of one

    def is_settled(self, conversation_id: str, retry_failed: bool) -> bool:
        """Whether a conversation needs no work: regenerated, or failed and failures are not retried."""
        return conversation_id in self.log.ok or (not retry_failed and conversation_id in self.log.failed)

    def commit(self, conversations: Sequence[dict[str, Any]], failures: Sequence[dict[str, Any]]) -> int:
        """Write one part and append its commit line; returns the part number."""
        if not conversations and not failures:
            return -1
        for record in conversations:
            if record["id"] in self.log.ok:
                raise StoreError(f"{self.root}: conversation {record['id']} is already committed")
        number = max(self.log.parts, default=-1) + 1
        if conversations:
            write_atomic(part_file(self.root, "conversations", number), _jsonl(conversations))
        if failures:
            write_atomic(part_file(self.root, "failed", number), _jsonl(failures))
        ok = [r["id"] for r in conversations]
        failed = [r["id"] for r in failures]
        append_lines(self.root / COMMITS_FILE, [{"part": number, "ok": ok, "failed": failed, "time": time.time()}])
        self.log.parts.append(number)
        for conversation_id in ok:
            self.log.ok[conversation_id] = number
            self.log.failed.pop(conversation_id, None)
        for conversation_id in failed:
            self.log.failed[conversation_id] = number
        return number

    def _part_records(self, kind: str) -> Iterator[tuple[int, dict[str, Any]]]:
        for number in self.log.parts:
            path = part_file(self.root, kind, number)
            if path.is_file():
                with open(path, encoding="utf-8") as handle:
                    for line in handle:
                        yield number, json.loads(line)

    def consolidate(self, inputs: Iterable[SourceConversation | Reject]) -> Consolidated:
        """Write conversations.jsonl and failures.jsonl for the current inputs: each input record once,
        either regenerated or failed with its reason (duplicates and parser rejects included)."""
        first_seen: dict[str, tuple[str, int, str]] = {}
        failures: list[dict[str, Any]] = []
        failed_ids: list[tuple[str, SourceConversation]] = []
        records = 0
        for item in inputs:
            records += 1
            if isinstance(item, Reject):
                failures.append(
                    {
                        "id": None,
                        "source": item.source,
                        "source_index": item.source_index,
                        "location": item.location,
                        "reason": FailureReason.INPUT_REJECTED,
                        "detail": f"{item.reason}: {item.detail}",
                    }
                )
            elif item.id in first_seen:
                source, _, location = first_seen[item.id]
                failures.append(
                    {
                        "id": item.id,
                        "source": item.source,
                        "source_index": item.source_index,
                        "location": item.location,
                        "reason": FailureReason.DUPLICATE,
                        "detail": f"same conversation as {source} {location}",
                    }
                )
            else:
                first_seen[item.id] = (item.source, item.source_index, item.location)
                if item.id not in self.log.ok:
                    if item.id not in self.log.failed:
                        raise StoreError(
                            f"{item.source} {item.location}: conversation {item.id} was neither regenerated nor "
                            "recorded as failed; run the regeneration again to finish it"
                        )
                    failed_ids.append((item.id, item))
        latest_failure = {
            record["id"]: record
            for number, record in self._part_records("failed")
            if self.log.failed.get(record["id"]) == number
        }
        for conversation_id, item in failed_ids:
            record = dict(latest_failure[conversation_id])
            record.update(source=item.source, source_index=item.source_index, location=item.location)
            failures.append(record)

        written = 0
        out = self.root / CONVERSATIONS_FILE
        temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                for number, record in self._part_records("conversations"):
                    position = first_seen.get(record["id"])
                    if position is None or self.log.ok.get(record["id"]) != number:
                        continue  # no longer among the inputs
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                    written += 1
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, out)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        failures.sort(key=lambda r: (r["source"], r["source_index"]))
        write_atomic(self.root / FAILURES_FILE, _jsonl(failures))
        by_reason: dict[str, int] = {}
        for record in failures:
            by_reason[record["reason"]] = by_reason.get(record["reason"], 0) + 1
        return Consolidated(conversations=written, failures=dict(sorted(by_reason.items())), inputs=records)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_atomic(self.root / SUMMARY_FILE, json.dumps(summary, indent=2).encode())


def _jsonl(records: Sequence[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def regenerated_input(root: Path) -> Path:
    """The file tokenisation reads when regeneration is on; a clear error when it is not there."""
    path = Path(root) / CONVERSATIONS_FILE
    if not path.is_file() or not (Path(root) / SUMMARY_FILE).is_file():
        raise StoreError(
            f"{path} not found: regenerate.enabled is true, so tokenized_dataset reads the regenerated "
            "conversations; materialize regenerated_conversations first"
        )
    if path.stat().st_size == 0:
        raise StoreError(f"{path} is empty: no conversation was regenerated (see {Path(root) / FAILURES_FILE})")
    return path
