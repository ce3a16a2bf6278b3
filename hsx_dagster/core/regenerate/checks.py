"""The blocking check of regenerated_conversations: every input record is accounted for exactly once
(regenerated, or failed with a reason), and every message that is not an assistant turn is the input's,
byte for byte."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
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
    conversations: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    repeated: Counter = Counter()
    for record in read_jsonl(root / CONVERSATIONS_FILE):
        if record["id"] in conversations:
            repeated[record["id"]] += 1
        conversations[record["id"]] = record
    failures_at: Counter = Counter()
    failed_ids: Counter = Counter()
    reasons: Counter = Counter()
    for record in read_jsonl(root / FAILURES_FILE):
        failures_at[(record["source"], record["source_index"])] += 1
        reasons[record["reason"]] += 1
        if record["reason"] not in ("duplicate", "input_rejected"):
            failed_ids[record["id"]] += 1
        if not record.get("reason") or not record.get("detail"):
            problems.append(f"{record['source']} {record.get('location')}: failure without reason or detail")
    problems += [f"conversation {cid} written {n + 1} times" for cid, n in repeated.items()]

    inputs = 0
    unaccounted: list[str] = []
    twice: list[str] = []
    altered: list[str] = []
    seen_ids: set[str] = set()
    for item in iter_inputs(input_paths):
        inputs += 1
        where = (item.source, item.source_index)
        if isinstance(item, Reject) or item.id in seen_ids:
            if failures_at[where] != 1:
                (unaccounted if failures_at[where] == 0 else twice).append(f"{item.source} {item.location}")
            continue
        seen_ids.add(item.id)
        count = (item.id in conversations) + failed_ids[item.id]
        if count != 1:
            (unaccounted if count == 0 else twice).append(f"{item.source} {item.location} (id {item.id})")
            continue
        if item.id not in conversations:
            continue
        messages = conversations[item.id]["messages"]
        if len(messages) != len(item.messages) or [m["role"] for m in messages] != [m["role"] for m in item.messages]:
            altered.append(f"{item.source} {item.location}: turns added, removed or reordered")
            continue
        for position, (out, original) in enumerate(zip(messages, item.messages)):
            if original["role"] != "assistant" and _canonical(out) != _canonical(original):
                altered.append(f"{item.source} {item.location}: messages[{position}] ({original['role']}) differs")
                break
            answered = position + 1 < len(messages) and messages[position + 1]["role"] == "tool"
            if answered and out.get("tool_calls") != original.get("tool_calls"):
                altered.append(f"{item.source} {item.location}: messages[{position}] lost its original tool calls")
                break
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
