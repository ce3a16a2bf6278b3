"""One record read from a file -> a `Conversation` in one normalised form, or a `Reject` saying why not.

Each record is either ShareGPT (``conversations: [{from, value}]``) or OpenAI chat (``messages: [{role,
content}]``); the form is detected per record, so mixed files work. Everything a chat template can render is
kept, as given, so that it reaches ``tokenizer.apply_chat_template(messages, tools=tools)`` unchanged:

- OpenAI messages: ``content`` as a string, ``null`` (an assistant turn that only calls tools) or a
  list of text parts; ``reasoning_content`` (or ``reasoning``); ``tool_calls`` (``function.arguments``
  as an object or a JSON string, kept exactly as given); ``tool_call_id``; ``name``; the record's
  ``tools`` (a list, or a JSON string of one).
- ShareGPT: roles ``system``/``human``/``gpt``, and the tool-use variant's ``function_call`` (an
  assistant turn whose value is a JSON call or list of calls) and ``observation`` (a tool response),
  with the record's ``tools`` (JSON string or list) and ``system`` (a system prompt).

A field the pipeline does not understand is not silently dropped: the conversation carries it in
``ignored`` ("message_field:weight", "record_field:source"), and tokenisation counts it per reason.
"""

from __future__ import annotations

import json
from typing import Any

from hsx_dagster.core.inputs.records import (
    CONVERSATION_FIELDS,
    RECORD_FIELDS,
    Conversation,
    Message,
    RawRecord,
    Reject,
    RejectReason,
)

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    # ShareGPT tool-use variant (LLaMA-Factory, glaive): a call made by the assistant, and its result.
    "function_call": "assistant",
    "observation": "tool",
}

# Record fields that identify a record and are not meant for the template: not reported as ignored.
IDENTITY_FIELDS = ("id", "conversation_id", "uuid")
OPENAI_MESSAGE_FIELDS = ("role", "content", "reasoning_content", "reasoning", "tool_calls", "tool_call_id", "name")
SHAREGPT_MESSAGE_FIELDS = ("from", "value")


def normalise_record(raw: RawRecord) -> Conversation | Reject:
    """The record as a `Conversation`, or a `Reject` saying why it cannot be one."""
    payload = _parse_json_line(raw.payload) if isinstance(raw.payload, bytes) else raw.payload
    return _normalise(raw.source, raw.source_index, raw.location, payload)


def _parse_json_line(raw: bytes) -> Any:
    """A JSON Lines line's record, or a `Reject` (its place filled in by `_normalise`) saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Reject("", 0, "", RejectReason.INVALID_UTF8, f"not UTF-8 at byte {exc.start}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        return Reject("", 0, "", RejectReason.INVALID_JSON, f"{exc.msg} at column {exc.colno}")
    except RecursionError:
        return Reject("", 0, "", RejectReason.INVALID_JSON, "nested too deeply to be a conversation")


def _normalise(source: str, index: int, location: str, record: Any) -> Conversation | Reject:
    try:
        return _conversation(source, index, location, record)
    except _Rejected as exc:
        return Reject(source, index, location, exc.reason, exc.detail)


def _conversation(source: str, index: int, location: str, record: Any) -> Conversation:
    """The record as a conversation; `_Rejected` says why it cannot be one."""
    if isinstance(record, Reject):  # a line that was not JSON (`_parse_json_line`)
        raise _Rejected(record.reason, record.detail)
    kind, turns = _turns(record)
    ignored = [
        f"record_field:{key}"
        for key, value in record.items()
        if key not in RECORD_FIELDS and key not in IDENTITY_FIELDS and value is not None
    ]
    try:
        tools = _tools(record.get("tools"))
    except _Malformed as exc:
        raise _Rejected(RejectReason.MALFORMED_TOOLS, f"'tools' {exc}") from None
    messages = [_message(kind, turn, f"{kind}[{position}]", ignored) for position, turn in enumerate(turns)]
    system = record.get("system")
    if isinstance(system, str) and system and messages[0].role != "system":
        messages.insert(0, Message("system", system))  # the ShareGPT variants' system prompt, as a system turn
    elif system is not None and system != "":
        ignored.append("record_field:system")  # not text, or a system message is already there
    if all(m.role == "system" for m in messages):
        raise _Rejected(RejectReason.NO_ASSISTANT_TURN, "only system turns")
    if not any(m.role == "assistant" for m in messages):
        raise _Rejected(RejectReason.NO_ASSISTANT_TURN, "no assistant turn to learn from")
    return Conversation(source, index, location, tuple(messages), tools, tuple(ignored))


def _turns(record: Any) -> tuple[str, list[Any]]:
    """Which form the record is in (its conversation field) and its turns."""
    if not isinstance(record, dict):
        raise _Rejected(RejectReason.NOT_AN_OBJECT, f"record is a {type(record).__name__}, not an object")
    kind = next((field for field in CONVERSATION_FIELDS if record.get(field) is not None), None)
    if kind is None:
        raise _Rejected(RejectReason.MISSING_CONVERSATION, "record has neither 'conversations' nor 'messages'")
    turns = record[kind]
    if not isinstance(turns, list):
        raise _Rejected(RejectReason.MISSING_CONVERSATION, f"'{kind}' is a {type(turns).__name__}, not a list")
    if not turns:
        raise _Rejected(RejectReason.EMPTY_CONVERSATION, f"'{kind}' is empty")
    return kind, turns


def _message(kind: str, turn: Any, where: str, ignored: list[str]) -> Message:
    message = (
        _sharegpt_message(turn, where, ignored) if kind == "conversations" else _openai_message(turn, where, ignored)
    )
    for name, text in message.texts():
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON escapes like "\ud800" decode to lone surrogates
                raise _Rejected(
                    RejectReason.INVALID_UTF8,
                    f"{where}.{name} holds {text[exc.start]!r} at character {exc.start}, "
                    "a lone surrogate that is not valid Unicode",
                ) from None
    return message


class _Rejected(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _Malformed(ValueError):
    """A value of the wrong shape; the message says what it is."""


def _role(turn: Any, role_key: str, where: str) -> tuple[str, str]:
    if not isinstance(turn, dict) or role_key not in turn:
        raise _Rejected(RejectReason.MALFORMED_MESSAGE, f"{where} has no '{role_key}'")
    raw_role = turn[role_key]
    role = ROLE_ALIASES.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise _Rejected(RejectReason.UNKNOWN_ROLE, f"{where}.{role_key} is {raw_role!r}")
    return role, raw_role.strip().lower()


def _sharegpt_message(turn: Any, where: str, ignored: list[str]) -> Message:
    role, raw_role = _role(turn, "from", where)
    ignored.extend(
        f"message_field:{key}"
        for key, value in turn.items()
        if key not in SHAREGPT_MESSAGE_FIELDS and value is not None
    )
    value = turn.get("value")
    if raw_role == "function_call":
        # The tool-use variant: the value is the call (or a list of calls) as JSON: {"name", "arguments"}.
        try:
            calls = json.loads(value) if isinstance(value, str) else value
            if isinstance(calls, dict):
                calls = [calls]
            if not isinstance(calls, list) or not calls:
                raise _Malformed("is not a call or a list of calls")
            tool_calls = []
            for call in calls:
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    raise _Malformed("holds a call without a 'name'")
                arguments = call.get("arguments", call.get("parameters", {}))
                if not isinstance(arguments, (dict, str)):
                    raise _Malformed("holds arguments that are neither an object nor a string")
                tool_calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
        except (json.JSONDecodeError, RecursionError, _Malformed) as exc:
            detail = exc if isinstance(exc, _Malformed) else "is not JSON"
            raise _Rejected(RejectReason.MALFORMED_MESSAGE, f"{where}.value of a function_call {detail}") from None
        return Message("assistant", "", tool_calls=tuple(tool_calls), null_content=True)
    text, parts = _text_content(value)
    if text is None:
        raise _Rejected(RejectReason.NON_TEXT_CONTENT, f"{where}.value is a {type(value).__name__}, not text")
    return Message(role, text, parts=parts)


def _openai_message(turn: Any, where: str, ignored: list[str]) -> Message:
    role, _ = _role(turn, "role", where)
    ignored.extend(
        f"message_field:{key}" for key, value in turn.items() if key not in OPENAI_MESSAGE_FIELDS and value is not None
    )
    content = turn.get("content")
    null_content = content is None and role == "assistant"  # a turn that only calls tools (or only reasons)
    text, parts = ("", None) if null_content else _text_content(content)
    if text is None:
        raise _Rejected(RejectReason.NON_TEXT_CONTENT, f"{where}.content is a {type(content).__name__}, not text")

    def optional_text(key: str) -> str | None:
        value = turn.get(key)
        if value is not None and not isinstance(value, str):
            raise _Rejected(RejectReason.MALFORMED_MESSAGE, f"{where}.{key} is a {type(value).__name__}, not text")
        return value

    reasoning = optional_text("reasoning_content")
    alternative = optional_text("reasoning")
    if reasoning is None:
        reasoning = alternative
    elif alternative is not None and alternative != reasoning:
        ignored.append("message_field:reasoning")  # both given and different: reasoning_content is rendered
    tool_calls = turn.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise _Rejected(RejectReason.MALFORMED_MESSAGE, f"{where} is a {role} message with tool_calls")
        try:
            tool_calls = _tool_calls(tool_calls)
        except _Malformed as exc:
            raise _Rejected(RejectReason.MALFORMED_MESSAGE, f"{where}.tool_calls {exc}") from None
    return Message(
        role,
        text,
        reasoning_content=reasoning,
        tool_calls=tool_calls,
        tool_call_id=optional_text("tool_call_id"),
        name=optional_text("name"),
        null_content=null_content,
        parts=parts,
    )


def _tool_calls(value: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI tool calls, as given: ``{"type": "function", "function": {"name", "arguments"}}`` (or the
    flat ``{"name", "arguments"}``); arguments an object or a JSON string, never re-encoded."""
    if not isinstance(value, list):
        raise _Malformed(f"is a {type(value).__name__}, not a list")
    for index, call in enumerate(value):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _Malformed(f"[{index}] has no function name")
        if not isinstance(function.get("arguments", {}), (dict, str)):
            raise _Malformed(f"[{index}] has arguments that are neither an object nor a JSON string")
    return tuple(value)


def _tools(value: Any) -> tuple[dict[str, Any], ...] | None:
    """The record's tool schemas: a list of objects, or a JSON string of one (ShareGPT variants)."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise _Malformed("is a string that is not JSON") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise _Malformed(f"is a {type(value).__name__}, not a list of tool schemas")
    return tuple(value)


def _text_content(content: Any) -> tuple[str | None, tuple[str, ...] | None]:
    """A message's text and, for an OpenAI list of text parts, the parts; (None, None) if not text."""
    if isinstance(content, str):
        return content, None
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                return None, None
        return "".join(parts), tuple(parts)
    return None, None
