"""Synthetic chat conversations for the demo, plus writers for the two raw input formats.

The demo must run offline and reproduce byte for byte, so instead of shipping a
real corpus we generate English-like prose, lists and code from fixed word lists
(`words.py`, data files under ``words/``) and templates (`text.py`) driven by one
seeded :class:`random.Random`; the agentic records (tools, tool calls) are in `agentic.py`.  The shape of the data
is what matters for the pipeline: multi-turn chats, optional system prompts,
``<think>`` reasoning that a Qwen3 template strips from earlier turns, the odd tool
response, and a long-tailed length distribution (lognormal message lengths) so
that batching, bucketing and truncation all get exercised.

The writers also append a handful of deliberately malformed records so the demo
shows the pipeline's reject handling (see ``data/README.md``).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from hsx_dagster.demo.text import TextGenerator

T = TypeVar("T")
Message = dict[str, str]
Conversation = list[Message]

# OpenAI role -> ShareGPT "from" value.
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}

# Fraction of conversations with each feature.
SYSTEM_RATE = 0.30
REASONING_RATE = 0.30
TOOL_RATE = 0.02


def generate_conversations(n: int, seed: int, *, tool_rate: float = TOOL_RATE) -> list[Conversation]:
    """Generate ``n`` synthetic chats as OpenAI-style message lists.

    Each chat has 1..6 user/assistant exchanges (short chats dominate), a system
    prompt with probability ``SYSTEM_RATE``, ``<think>`` reasoning in every
    assistant turn with probability ``REASONING_RATE``, and (with probability
    ``tool_rate``) one assistant -> tool -> assistant hop.  Pass ``tool_rate=0`` for
    formats without a tool role (ShareGPT).
    """
    rng = random.Random(seed)
    gen = TextGenerator(rng)
    exchange_weights = (40, 24, 15, 10, 6, 5)
    conversations: list[Conversation] = []
    for _ in range(n):
        messages: Conversation = []
        if rng.random() < SYSTEM_RATE:
            messages.append({"role": "system", "content": gen.system_prompt()})
        reasoning = rng.random() < REASONING_RATE
        exchanges = rng.choices(range(1, 7), weights=exchange_weights)[0]
        tool_turn = rng.randrange(exchanges) if rng.random() < tool_rate else -1
        for turn in range(exchanges):
            messages.append({"role": "user", "content": gen.user_message()})
            if turn == tool_turn:
                messages.append({"role": "assistant", "content": gen.tool_call_message(reasoning)})
                messages.append({"role": "tool", "content": gen.tool_output()})
            messages.append({"role": "assistant", "content": gen.assistant_message(reasoning)})
        conversations.append(messages)
    return conversations


def to_sharegpt(conversation_id: str, messages: Sequence[Message]) -> dict[str, Any]:
    """Convert one OpenAI-style chat into a ShareGPT record (no tool role there)."""
    return {
        "id": conversation_id,
        "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages],
    }


# Malformed records mixed in on purpose so the demo exercises reject handling.
SHAREGPT_FLAWED: tuple[dict[str, Any], ...] = (
    {"id": "flawed-empty", "conversations": []},
    {"id": "flawed-no-reply", "conversations": [{"from": "human", "value": "Is anyone there?"}]},
    {
        "id": "flawed-unknown-role",
        "conversations": [
            {"from": "human", "value": "Tell me a story."},
            {"from": "narrator", "value": "Once upon a time, a cache missed."},
            {"from": "gpt", "value": "The end."},
        ],
    },
)
OPENAI_FLAWED_LINES: tuple[str, ...] = (
    '{"id": "flawed-invalid-json", "messages": [',
    json.dumps(
        {
            "id": "flawed-non-string-content",
            "messages": [
                {"role": "user", "content": {"text": "x"}},
                {"role": "assistant", "content": "ok"},
            ],
        }
    ),
)


def _with_flawed(valid: Sequence[T], flawed: Sequence[T], seed: int) -> list[T]:
    """Spread the flawed items through the valid ones so rejects are not all at the end."""
    positions = set(random.Random(seed).sample(range(len(valid) + len(flawed)), len(flawed)))
    valid_iter, flawed_iter = iter(valid), iter(flawed)
    return [next(flawed_iter) if i in positions else next(valid_iter) for i in range(len(valid) + len(flawed))]


def write_sharegpt(path: Path, conversations: Sequence[Conversation], *, seed: int) -> int:
    """Write a ShareGPT JSON array (valid records + ``SHAREGPT_FLAWED``); return the record count."""
    valid = [to_sharegpt(f"sharegpt-{i:05d}", c) for i, c in enumerate(conversations)]
    records = _with_flawed(valid, SHAREGPT_FLAWED, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        json.dump(records, f, ensure_ascii=False, indent=1)
        f.write("\n")
    return len(records)


def write_openai_jsonl(path: Path, conversations: Sequence[Conversation], *, seed: int) -> int:
    """Write OpenAI-style JSON Lines (valid records + ``OPENAI_FLAWED_LINES``); return the line count."""
    valid = [
        json.dumps({"id": f"openai-{i:05d}", "messages": c}, ensure_ascii=False) for i, c in enumerate(conversations)
    ]
    lines = _with_flawed(valid, OPENAI_FLAWED_LINES, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    return len(lines)


def training_texts(conversations: Sequence[Conversation]) -> list[str]:
    """The corpus the demo tokenizer is trained on, in a fixed order.

    Each text is one message as it appears between ChatML control tokens once
    templated (role name, newline, content; tool output wrapped in
    ``<tool_response>``), so role headers get single tokens as in real chat tokenizers.
    """
    texts = []
    for conversation in conversations:
        for m in conversation:
            if m["role"] == "tool":
                texts.append(f"<tool_response>\n{m['content']}\n</tool_response>")
            else:
                texts.append(f"{m['role']}\n{m['content']}")
    return texts


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """Summary statistics for a list of per-conversation token counts."""
    ordered = sorted(lengths)
    n = len(ordered)
    return {
        "count": n,
        "mean": round(sum(ordered) / n, 1),
        "median": ordered[n // 2],
        "p99": ordered[min(n - 1, math.ceil(0.99 * n) - 1)],
        "max": ordered[-1],
        "over_2000": sum(1 for x in ordered if x > 2000),
    }
