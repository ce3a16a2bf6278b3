"""What reading conversation files produces: a `Conversation` of `Message`s, or a `Reject` with a reason code.

A `RawRecord` is a record as read from its file, before it is normalised (`hsx_dagster.core.inputs.normalise`);
`InputFileError` is a whole file that cannot be read (`hsx_dagster.core.inputs.readers`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

CONVERSATION_FIELDS = ("conversations", "messages")
# Record fields read besides the conversation; in Parquet, the columns read.
RECORD_FIELDS = (*CONVERSATION_FIELDS, "tools", "system")


class InputFileError(ValueError):
    """A whole input file cannot be read; the message names the file and what is wrong."""


class RejectReason:
    """Stable reason codes in the rejects table (tests and dashboards key on them)."""

    INVALID_JSON = "invalid_json"
    INVALID_UTF8 = "invalid_utf8"
    NOT_AN_OBJECT = "not_an_object"
    MISSING_CONVERSATION = "missing_conversation_field"
    MALFORMED_MESSAGE = "malformed_message"
    UNKNOWN_ROLE = "unknown_role"
    NON_TEXT_CONTENT = "non_text_content"
    EMPTY_CONVERSATION = "empty_conversation"
    NO_ASSISTANT_TURN = "no_assistant_turn"
    MALFORMED_TOOLS = "malformed_tools"
    # Decided later, by tokenisation:
    DUPLICATE = "duplicate"
    CONTROL_TOKEN_IN_CONTENT = "control_token_in_content"
    TEMPLATE_ERROR = "template_error"
    TOO_FEW_LOSS_TOKENS = "too_few_loss_tokens"


@dataclass(frozen=True, slots=True)
class Message:
    """One message, with everything a chat template can render, as the record gave it."""

    role: str  # system | user | assistant | tool
    content: str  # the text ('' when the record's content is null; text parts joined)
    reasoning_content: str | None = None  # from `reasoning_content` or `reasoning`
    tool_calls: tuple[dict[str, Any], ...] | None = None  # OpenAI tool calls, exactly as given
    tool_call_id: str | None = None
    name: str | None = None
    null_content: bool = False  # the record's content was null (how OpenAI sends a turn that only calls tools)
    parts: tuple[str, ...] | None = None  # content came as a list of text parts: their texts

    @property
    def is_plain(self) -> bool:
        """Only a role and a string: the form every template renders and sample ids were first made of."""
        return (
            self.reasoning_content is None
            and self.tool_calls is None
            and self.tool_call_id is None
            and self.name is None
            and not self.null_content
            and self.parts is None
        )

    def as_chat(self, content_parts: bool = False) -> dict[str, Any]:
        """The message as ``apply_chat_template`` takes it: the fields the record had, as given.
        ``content_parts``: hand text parts over as a list (for templates that render lists of parts);
        otherwise they are joined into one string."""
        content: Any = self.content
        if self.null_content:
            content = None
        elif self.parts is not None and content_parts:
            content = [{"type": "text", "text": text} for text in self.parts]
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls is not None:
            out["tool_calls"] = copy.deepcopy(list(self.tool_calls))
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def texts(self) -> Iterator[tuple[str, str]]:
        """(field, text) for every string of the message that the template may write into the prompt."""
        yield "content", self.content
        if self.reasoning_content is not None:
            yield "reasoning_content", self.reasoning_content
        if self.name is not None:
            yield "name", self.name
        if self.tool_call_id is not None:
            yield "tool_call_id", self.tool_call_id
        for index, call in enumerate(self.tool_calls or ()):
            yield f"tool_calls[{index}]", json.dumps(call, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Conversation:
    source: str  # the input file
    source_index: int  # 0-based position of the record in its file (line, row or array item)
    location: str  # the same position for humans: "line 12", "row 4", "item 7"
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] | None = None  # the record's tool schemas, as given
    ignored: tuple[str, ...] = ()  # fields not understood: "message_field:<key>", "record_field:<key>"

    def as_chat(self, content_parts: bool = False) -> list[dict[str, Any]]:
        return [m.as_chat(content_parts) for m in self.messages]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools argument of ``apply_chat_template``: the record's tool schemas, or None."""
        return copy.deepcopy(list(self.tools)) if self.tools is not None else None

    def as_record(self) -> dict[str, Any]:
        """The conversation as an OpenAI-form record (``messages`` and, when given, ``tools``)."""
        record: dict[str, Any] = {"messages": self.as_chat(content_parts=True)}
        if self.tools is not None:
            record["tools"] = self.chat_tools()
        return record


@dataclass(frozen=True, slots=True)
class Reject:
    source: str
    source_index: int
    location: str
    reason: str
    detail: str


class RawRecord(NamedTuple):
    """One record as read from its file, before it is normalised: ``payload`` is a JSON Lines line's
    bytes (decoded and parsed where the record is normalised, which may be a worker process: reading
    lines is all the reading process does) or the value a JSON array item or Parquet row gave."""

    source: str  # the input file
    source_index: int  # 0-based position of the record in its file (line, row or array item)
    location: str  # the same position for humans: "line 12", "row 4", "item 7"
    payload: Any
