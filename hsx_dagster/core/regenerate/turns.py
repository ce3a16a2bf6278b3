"""Which assistant turns are regenerated, with what history, and how a response becomes a message.

Input conversations arrive through the normal input path (`hsx_dagster.core.inputs.conversations`)
and are taken in the OpenAI chat form (`Conversation.as_chat`, with reasoning_content, tool_calls,
tool_call_id, name and the record's tools as given) (``{"id", "messages", "tools"}``), the form the regenerated
conversations are written in, so tokenisation reads them back through the same parser.

A `ConversationJob` walks one conversation: with ``turns="all"`` every assistant turn in order, each
prompted with the *regenerated* history before it; with ``turns="last"`` only the last assistant
turn, on the original history. An assistant turn whose next message is a tool response keeps its
original ``tool_calls`` (the tool results that follow belong to them). Every other message (system,
user, tool) is copied unchanged.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx_dagster.core.inputs.chat_template import THINK_CLOSE, THINK_OPEN
from hsx_dagster.core.inputs.conversations import Conversation, Reject, iter_records
from hsx_dagster.core.settings.choices import OnTruncated, RegenerateTurns


class FailureReason:
    """Stable reason codes of conversations that are not regenerated (failures.jsonl)."""

    SERVER_ERROR = "server_error"  # 5xx (or 429) after the retries
    TIMEOUT = "timeout"  # no response within request_timeout_s, after the retries
    BAD_REQUEST = "bad_request"  # 4xx: the server refused the request (e.g. longer than its context)
    TEMPLATE_ERROR = "template_error"  # the target's chat template cannot render the history
    EMPTY_RESPONSE = "empty_response"  # no text, no reasoning, no tool call
    TRUNCATED = "truncated"  # cut by max_tokens with on_truncated: reject
    DUPLICATE = "duplicate"  # the same conversation appears earlier in the inputs
    INPUT_REJECTED = "input_rejected"  # the input parser rejected the record (its reason in the detail)


@dataclass(frozen=True)
class SourceConversation:
    """One input conversation in OpenAI chat form, with where it came from."""

    id: str
    source: str
    source_index: int
    location: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None


@dataclass
class Generated:
    """One response of the target: what a backend returns for one prompt."""

    content: str
    reasoning_content: str | None
    finish_reason: str  # stop | length | tool_calls | ...
    completion_tokens: int
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class Failure:
    reason: str
    detail: str


def conversation_id(messages: Iterable[dict[str, Any]], tools: Iterable[dict[str, Any]] | None) -> str:
    """A stable id from the conversation's content (16 hex digits): the same conversation gets the same
    id whatever file or position it comes from, so a re-run recognises what it committed."""
    canonical = json.dumps(
        {"messages": list(messages), "tools": list(tools or [])},
        ensure_ascii=False,
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=8).hexdigest()


def to_source(conversation: Conversation) -> SourceConversation:
    """The parsed conversation as the chat template takes it (every field the record gave, content as text)."""
    messages = tuple(conversation.as_chat())
    tools = conversation.chat_tools()
    return SourceConversation(
        id=conversation_id(messages, tools),
        source=conversation.source,
        source_index=conversation.source_index,
        location=conversation.location,
        messages=messages,
        tools=tuple(tools) if tools is not None else None,
    )


def iter_inputs(paths: Iterable[Path]) -> Iterator[SourceConversation | Reject]:
    """Every record of the input files, in order: a conversation in OpenAI form, or the parser's reject."""
    for path in paths:
        for item in iter_records(Path(path)):
            yield item if isinstance(item, Reject) else to_source(item)


def positions_to_regenerate(messages: tuple[dict[str, Any], ...] | list[dict[str, Any]], turns: str) -> list[int]:
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if turns == "last":
        return assistant[-1:]
    return assistant


_TOOL_CALL_BLOCK = re.compile(r"\s*<tool_call>.*?(</tool_call>|$)", re.DOTALL)


def split_reasoning(text: str, prompt_opens_think: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a response whose reasoning is inline: ``<think>...</think>`` at its start,
    or, when the prompt itself opened the block (templates with thinking on), everything before
    ``</think>``. A response cut inside the block is all reasoning."""
    stripped = text.lstrip()
    opened = stripped.startswith(THINK_OPEN)
    if THINK_CLOSE in text and (opened or prompt_opens_think or THINK_OPEN not in text):
        before, after = text.split(THINK_CLOSE, 1)
        return before.strip().removeprefix(THINK_OPEN).strip(), after.strip()
    if opened:
        return stripped[len(THINK_OPEN) :].strip(), ""
    if prompt_opens_think:
        return text.strip(), ""
    return None, text.strip()


@dataclass
class ConversationJob:
    """One conversation being regenerated turn by turn; backends ask it for the next prompt and hand
    it each response."""

    source: SourceConversation
    turns: RegenerateTurns  # `regenerate.turns`
    on_truncated: OnTruncated  # `regenerate.on_truncated`
    messages: list[dict[str, Any]] = field(init=False)
    pending: list[int] = field(init=False)
    failure: Failure | None = None
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    response_chars: int = 0
    truncated_turns: int = 0
    kept_tool_calls: int = 0
    requests: int = 0

    def __post_init__(self) -> None:
        self.messages = [copy.deepcopy(m) for m in self.source.messages]
        self.pending = positions_to_regenerate(self.source.messages, self.turns)

    @property
    def done(self) -> bool:
        return self.failure is not None or not self.pending

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return list(self.source.tools) if self.source.tools else None

    def prompt(self) -> list[dict[str, Any]]:
        """The history before the next turn to regenerate (earlier turns already regenerated)."""
        return [copy.deepcopy(m) for m in self.messages[: self.pending[0]]]

    def fail(self, reason: str, detail: str) -> None:
        self.failure = Failure(reason, detail)

    def accept(self, generated: Generated) -> None:
        """Put a response in place of the next turn; a response that cannot stand fails the conversation."""
        position = self.pending[0]
        self.requests += 1
        self.finish_reasons.append(generated.finish_reason)
        self.completion_tokens += generated.completion_tokens
        original = self.messages[position]
        keeps_tool_calls = position + 1 < len(self.messages) and self.messages[position + 1]["role"] == "tool"
        content = generated.content or ""
        tool_calls = generated.tool_calls or None
        if keeps_tool_calls:
            # The tool results that follow answer the original calls: those stay, the model's own go.
            content = _TOOL_CALL_BLOCK.sub("", content).strip()
            tool_calls = original.get("tool_calls")
            self.kept_tool_calls += 1
        reasoning = generated.reasoning_content or None
        if generated.finish_reason == "length":
            self.truncated_turns += 1
            if self.on_truncated == "reject":
                self.fail(
                    FailureReason.TRUNCATED,
                    f"messages[{position}]: the response reached max_tokens ({generated.completion_tokens} tokens)",
                )
                return
        if not content.strip() and not (reasoning or "").strip() and not generated.tool_calls:
            self.fail(
                FailureReason.EMPTY_RESPONSE,
                f"messages[{position}]: the response is empty (finish_reason {generated.finish_reason})",
            )
            return
        message: dict[str, Any] = {
            k: v for k, v in original.items() if k not in ("content", "reasoning_content", "tool_calls")
        }
        message["content"] = content
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        self.messages[position] = message
        self.response_chars += len(content) + len(reasoning or "")
        self.pending.pop(0)

    def record(self) -> dict[str, Any]:
        """The regenerated conversation, in the OpenAI chat form the input parser reads (``id`` is one of
        its identity fields; nothing else is added, so tokenisation reports no ignored field)."""
        out: dict[str, Any] = {"id": self.source.id, "messages": self.messages}
        if self.source.tools is not None:
            out["tools"] = list(self.source.tools)
        return out

    def failure_record(self) -> dict[str, Any]:
        assert self.failure is not None
        return {
            "id": self.source.id,
            "source": self.source.source,
            "source_index": self.source.source_index,
            "location": self.source.location,
            "reason": self.failure.reason,
            "detail": self.failure.detail,
        }
