"""The blocking check of regenerated_conversations: every input record is accounted for exactly once
(regenerated, or failed with a reason), and every message that is not an assistant turn is the input's,
byte for byte."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.inputs.records import Reject
from hsx_dagster.core.regenerate.store import CONVERSATIONS_FILE, FAILURES_FILE, read_jsonl
from hsx_dagster.core.regenerate.turns import iter_inputs

SHOWN = 10


def _canonical(message: dict[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False, sort_keys=True)


def check_regenerated(regenerated_dir: Path, input_paths: Sequence[Path]) -> CheckOutcome:
    root = Path(regenerated_dir)
    for name in (CONVERSATIONS_FILE, FAILURES_FILE):
        if not (root / name).is_file():
            return CheckOutcome(False, f"{root / name} is missing; materialize regenerated_conversations")
    conversations, repeated = _read_conversations(root / CONVERSATIONS_FILE)
    failures = _Failures.read(root / FAILURES_FILE)
    problems = failures.problems + [f"conversation {cid} written {n + 1} times" for cid, n in repeated.items()]

    inputs = 0
    unaccounted: list[str] = []
    twice: list[str] = []
    altered: list[str] = []
    seen_ids: set[str] = set()
    for item in iter_inputs(input_paths):
        inputs += 1
        where = (item.source, item.source_index)
        if isinstance(item, Reject) or item.id in seen_ids:
            if failures.at[where] != 1:
                (unaccounted if failures.at[where] == 0 else twice).append(f"{item.source} {item.location}")
            continue
        seen_ids.add(item.id)
        count = (item.id in conversations) + failures.ids[item.id]
        if count != 1:
            (unaccounted if count == 0 else twice).append(f"{item.source} {item.location} (id {item.id})")
        elif item.id in conversations and (change := _alteration(conversations[item.id]["messages"], item.messages)):
            altered.append(f"{item.source} {item.location}: {change}")
    reasons = failures.reasons
    extra = sorted(set(conversations) - seen_ids)
    problems += [f"not an input conversation: {cid}" for cid in extra[:SHOWN]]
    problems += [f"not accounted for: {x}" for x in unaccounted[:SHOWN]]
    problems += [f"accounted for twice: {x}" for x in twice[:SHOWN]]
    problems += [f"changed: {x}" for x in altered[:SHOWN]]
    metadata = {
        "input_records": inputs,
        "regenerated": len(conversations),
        "failed": sum(reasons.values()),
        "failures_by_reason": dict(sorted(reasons.items())),
        "unaccounted": len(unaccounted),
        "accounted_twice": len(twice) + sum(repeated.values()),
        "non_assistant_turns_changed": len(altered),
        "not_in_inputs": len(extra),
    }
    if problems:
        return CheckOutcome(False, "; ".join(problems[: 3 * SHOWN]), metadata)
    return CheckOutcome(
        True,
        f"{inputs} input records: {len(conversations)} regenerated, {metadata['failed']} failed with a reason; "
        "each exactly once, system/user/tool turns identical to the input",
        metadata,
    )


def _read_conversations(path: Path) -> tuple[dict[str, dict[str, Any]], Counter]:
    """The regenerated conversations by id (the last one written of an id), and how often each id came again."""
    conversations: dict[str, dict[str, Any]] = {}
    repeated: Counter = Counter()
    for record in read_jsonl(path):
        if record["id"] in conversations:
            repeated[record["id"]] += 1
        conversations[record["id"]] = record
    return conversations, repeated


@dataclass
class _Failures:
    """The failure records: how many name each input place and each conversation id, by reason, and the
    records that lack a reason or a detail."""

    at: Counter  # (source, source_index) -> records
    ids: Counter  # conversation id -> records of a failed regeneration (not duplicates or rejected inputs)
    reasons: Counter
    problems: list[str]

    @classmethod
    def read(cls, path: Path) -> _Failures:
        failures = cls(Counter(), Counter(), Counter(), [])
        for record in read_jsonl(path):
            failures.at[(record["source"], record["source_index"])] += 1
            failures.reasons[record["reason"]] += 1
            if record["reason"] not in ("duplicate", "input_rejected"):
                failures.ids[record["id"]] += 1
            if not record.get("reason") or not record.get("detail"):
                failures.problems.append(
                    f"{record['source']} {record.get('location')}: failure without reason or detail"
                )
        return failures


def _alteration(messages: list[dict[str, Any]], originals: Sequence[dict[str, Any]]) -> str | None:
    """What regeneration changed beyond the assistant turns' text, or None: turns added, removed or reordered,
    another turn's content, or the tool calls of a turn the next tool turn answers."""
    if len(messages) != len(originals) or [m["role"] for m in messages] != [m["role"] for m in originals]:
        return "turns added, removed or reordered"
    for position, (out, original) in enumerate(zip(messages, originals)):
        if original["role"] != "assistant" and _canonical(out) != _canonical(original):
            return f"messages[{position}] ({original['role']}) differs"
        answered = position + 1 < len(messages) and messages[position + 1]["role"] == "tool"
        if answered and out.get("tool_calls") != original.get("tool_calls"):
            return f"messages[{position}] lost its original tool calls"
    return None
