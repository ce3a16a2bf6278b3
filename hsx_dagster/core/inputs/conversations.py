"""Read conversation files into one normalised form, streaming, with every bad record accounted for.

Inputs: JSON Lines (``.jsonl``, ``.ndjson``, optionally ``.gz``), a JSON array (the form raw ShareGPT
dumps come in) or Parquet. Each record is either ShareGPT (``conversations: [{from, value}]``) or
OpenAI chat (``messages: [{role, content}]``); the form is detected per record, so mixed files work.

Everything a chat template can render is kept, as given, so that it reaches
``tokenizer.apply_chat_template(messages, tools=tools)`` unchanged:

- OpenAI messages: ``content`` as a string, ``null`` (an assistant turn that only calls tools) or a
  list of text parts; ``reasoning_content`` (or ``reasoning``); ``tool_calls`` (``function.arguments``
  as an object or a JSON string, kept exactly as given); ``tool_call_id``; ``name``; the record's
  ``tools`` (a list, or a JSON string of one).
- ShareGPT: roles ``system``/``human``/``gpt``, and the tool-use variant's ``function_call`` (an
  assistant turn whose value is a JSON call or list of calls) and ``observation`` (a tool response),
  with the record's ``tools`` (JSON string or list) and ``system`` (a system prompt).

A field the pipeline does not understand is not silently dropped: the conversation carries it in
``ignored`` ("message_field:weight", "record_field:source"), and tokenisation counts it per reason.

`iter_records` yields a `Conversation` for every usable record and a `Reject` (with the file, the
record's position and a reason code) for every other one; nothing is skipped silently. It is
`iter_raw_records` (reading) followed by `normalise_record` (parsing and checking), two steps so that
tokenisation can read in one process and parse in its workers. Problems
with a whole file (unknown format, empty file, wrong Parquet schema, not gzip) raise `InputFileError`
naming the file, before any tokenisation starts (`check_input_file`); damage found only while
reading (a truncated gzip, a syntax error inside a JSON array, which loses the array's structure)
raises it naming the file and the last record read.

A JSON array is parsed one item at a time with the standard library's decoder: memory holds one
item, and a hostile file (nesting thousands of levels deep) fails with a message instead of
exhausting memory.
"""

from __future__ import annotations

import copy
import gzip
import io
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, cast

import pyarrow as pa
import pyarrow.parquet as pq

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
CONVERSATION_FIELDS = ("conversations", "messages")
# Record fields read besides the conversation; in Parquet, the columns read.
RECORD_FIELDS = (*CONVERSATION_FIELDS, "tools", "system")
# Record fields that identify a record and are not meant for the template: not reported as ignored.
IDENTITY_FIELDS = ("id", "conversation_id", "uuid")
OPENAI_MESSAGE_FIELDS = ("role", "content", "reasoning_content", "reasoning", "tool_calls", "tool_call_id", "name")
SHAREGPT_MESSAGE_FIELDS = ("from", "value")
PARQUET_BATCH_ROWS = 512
UTF8_BOM = b"\xef\xbb\xbf"
ARRAY_READ_CHARS = 1 << 20
MAX_ITEM_CHARS = 256 << 20  # one conversation larger than this is refused rather than buffered
# A decoded item is taken only when this many characters follow it (or the file ends), so a number
# or literal cut by a read boundary is never mistaken for a whole one.
_LOOKAHEAD = 16
_WHITESPACE = re.compile(r"[ \t\n\r]*")
# What a damaged compressed file raises while it is read.
_COMPRESSION_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


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


def detect_format(path: Path) -> str:
    """'jsonl', 'json_array' or 'parquet', from the name and, for .json, the first byte."""
    name = path.name.lower()
    stem = name[:-3] if name.endswith(".gz") else name
    if stem.endswith((".parquet", ".pq")):
        return "parquet"
    if stem.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if stem.endswith(".json"):
        first = _peek(path)
        if first is None:
            raise InputFileError(f"{path}: the file is empty")
        return "json_array" if first == b"[" else "jsonl"
    raise InputFileError(f"{path}: unknown file type; use .jsonl, .json (array or lines) or .parquet")


def check_input_file(path: Path) -> str:
    """Fail fast on a file that cannot be read at all; return its format."""
    if not path.is_file():
        raise InputFileError(f"{path}: file not found")
    fmt = detect_format(path)
    if fmt == "parquet":
        try:
            schema = pq.read_schema(path)
        except Exception as exc:  # pyarrow raises several types for a non-Parquet file
            raise InputFileError(f"{path}: not a readable Parquet file ({exc})") from None
        if not any(field in schema.names for field in CONVERSATION_FIELDS):
            raise InputFileError(
                f"{path}: Parquet schema has no 'conversations' or 'messages' column "
                f"(columns: {', '.join(schema.names) or 'none'})"
            )
    elif _peek(path) is None:
        raise InputFileError(f"{path}: the file is empty")
    return fmt


class RawRecord(NamedTuple):
    """One record as read from its file, before it is normalised: ``payload`` is a JSON Lines line's
    bytes (decoded and parsed where the record is normalised, which may be a worker process: reading
    lines is all the reading process does) or the value a JSON array item or Parquet row gave."""

    source: str  # the input file
    source_index: int  # 0-based position of the record in its file (line, row or array item)
    location: str  # the same position for humans: "line 12", "row 4", "item 7"
    payload: Any


def iter_records(path: Path) -> Iterator[Conversation | Reject]:
    """Stream a file's records, normalised, in file order; memory does not grow with the file."""
    for raw in iter_raw_records(path):
        yield normalise_record(raw)


def iter_raw_records(path: Path) -> Iterator[RawRecord]:
    """Stream a file's records as read, in file order (`normalise_record` turns each into a
    `Conversation` or a `Reject`); memory does not grow with the file. Damage to the file as a whole
    raises `InputFileError` here, naming the file and the last record read."""
    fmt = check_input_file(path)
    source = str(path)
    if fmt == "jsonl":
        # A .json file read as lines must start with a whole record: a single pretty-printed object
        # would otherwise become one invalid_json reject per line.
        records, unit = _iter_jsonl(path, strict_first=not _is_jsonl_name(path)), "line"
    elif fmt == "json_array":
        records, unit = _iter_json_array(path), "item"
    else:
        records, unit = _iter_parquet(path), "row"
    location = None
    try:
        for index, record in records:
            location = f"{unit} {index + 1}" if unit == "line" else f"{unit} {index}"
            yield RawRecord(source, index, location, record)
    except _COMPRESSION_ERRORS as exc:
        where = f"after {location}" if location else "before its first record"
        raise InputFileError(
            f"{path}: the compressed file is truncated or corrupt ({where}: {exc}); replace it with a complete copy"
        ) from None
    except pa.ArrowException as exc:
        where = f"after {location}" if location else "in its first row group"
        raise InputFileError(f"{path}: cannot read the Parquet file {where}: {exc}") from None


def normalise_record(raw: RawRecord) -> Conversation | Reject:
    """The record as a `Conversation`, or a `Reject` saying why it cannot be one."""
    payload = _parse_json_line(raw.payload) if isinstance(raw.payload, bytes) else raw.payload
    return _normalise(raw.source, raw.source_index, raw.location, payload)


def _iter_jsonl(path: Path, strict_first: bool = False) -> Iterator[tuple[int, bytes]]:
    """(line index, the line's bytes) for every line that is not blank."""
    with _open_binary(path) as handle:
        first = True
        for index, raw in enumerate(handle):
            if index == 0 and raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM) :]  # editors on Windows start files with a byte-order mark
            if not raw.strip():
                continue  # blank lines separate nothing and hold no record
            if first and strict_first:
                _check_whole_first_line(path, index, raw)
            first = False
            yield index, raw


def _check_whole_first_line(path: Path, index: int, raw: bytes) -> None:
    try:
        json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return  # a record rejected alone, as on any other line
    except json.JSONDecodeError as exc:
        raise InputFileError(
            f"{path}: line {index + 1} is not a whole JSON record ({exc.msg} at column {exc.colno}); "
            "a .json file must hold a JSON array of records or one record per line "
            "(a single pretty-printed object is neither)"
        ) from None
    except RecursionError:
        return


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


def _iter_json_array(path: Path) -> Iterator[tuple[int, Any]]:
    """Items of a top-level JSON array, one at a time; a syntax error ends the file (past it the
    array's structure is lost, so no later item can be trusted)."""
    decoder = json.JSONDecoder()
    with _open_text(path) as handle:
        text, at, eof = "", 0, False

        def fill(wanted: int) -> None:
            nonlocal text, at, eof
            while not eof and len(text) - at < wanted:
                chunk = handle.read(max(ARRAY_READ_CHARS, wanted))
                if not chunk:
                    eof = True
                text, at = text[at:] + chunk, 0

        def skip_whitespace() -> None:
            nonlocal at
            while True:
                fill(1)
                at = _WHITESPACE.match(text, at).end()  # type: ignore[union-attr]  # \s* always matches
                if at < len(text) or eof:
                    return

        def after(index: int) -> str:
            return f"after item {index - 1}" if index else "in its first item"

        index = 0
        try:
            skip_whitespace()
            at += 1  # the "[" that detect_format saw
            skip_whitespace()
            if text.startswith("]", at):
                raise InputFileError(f"{path}: the JSON array holds no records")
            while True:
                wanted = ARRAY_READ_CHARS
                while True:
                    fill(wanted)
                    try:
                        record, end = decoder.raw_decode(text, at)
                        if eof or end + _LOOKAHEAD <= len(text):
                            break
                    except json.JSONDecodeError as exc:
                        cut_by_read = exc.pos >= len(text) - _LOOKAHEAD or exc.msg.startswith("Unterminated string")
                        if eof or not cut_by_read:
                            raise InputFileError(
                                f"{path}: invalid JSON {after(index)}: {exc.msg}; the rest of the array "
                                "cannot be read (fix the file, or convert it to JSON Lines, where a bad "
                                "line is rejected alone)"
                            ) from None
                    except RecursionError:
                        raise InputFileError(
                            f"{path}: item {index} is nested too deeply to be a conversation; the rest "
                            "of the array cannot be read"
                        ) from None
                    if len(text) - at >= MAX_ITEM_CHARS:
                        raise InputFileError(
                            f"{path}: item {index} is larger than {MAX_ITEM_CHARS >> 20} M characters "
                            "(or its JSON never closes)"
                        )
                    wanted = 2 * (len(text) - at)
                yield index, record
                index += 1
                at = end
                skip_whitespace()
                if text.startswith(",", at):
                    at += 1
                    skip_whitespace()
                elif text.startswith("]", at):
                    at += 1
                    break
                else:
                    raise InputFileError(f"{path}: invalid JSON {after(index)}: expected ',' or ']'")
            skip_whitespace()
            if at < len(text):
                raise InputFileError(f"{path}: invalid JSON {after(index)}: data after the end of the array")
        except UnicodeDecodeError as exc:
            raise InputFileError(f"{path}: not UTF-8 text ({exc.reason}) {after(index)}") from None


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    parquet = pq.ParquetFile(path)
    columns = [name for name in RECORD_FIELDS if name in parquet.schema_arrow.names]
    index = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        for record in batch.to_pylist():
            yield index, record
            index += 1


def _normalise(source: str, index: int, location: str, record: Any) -> Conversation | Reject:
    def reject(reason: str, detail: str) -> Reject:
        return Reject(source, index, location, reason, detail)

    if isinstance(record, Reject):
        return reject(record.reason, record.detail)
    if not isinstance(record, dict):
        return reject(RejectReason.NOT_AN_OBJECT, f"record is a {type(record).__name__}, not an object")
    turns, kind = None, None
    for field in CONVERSATION_FIELDS:
        if record.get(field) is not None:
            turns, kind = record[field], field
            break
    if turns is None:
        return reject(RejectReason.MISSING_CONVERSATION, "record has neither 'conversations' nor 'messages'")
    if not isinstance(turns, list):
        return reject(RejectReason.MISSING_CONVERSATION, f"'{kind}' is a {type(turns).__name__}, not a list")
    if not turns:
        return reject(RejectReason.EMPTY_CONVERSATION, f"'{kind}' is empty")
    ignored = [
        f"record_field:{key}"
        for key, value in record.items()
        if key not in RECORD_FIELDS and key not in IDENTITY_FIELDS and value is not None
    ]
    try:
        tools = _tools(record.get("tools"))
    except _Malformed as exc:
        return reject(RejectReason.MALFORMED_TOOLS, f"'tools' {exc}")

    messages: list[Message] = []
    for position, turn in enumerate(turns):
        where = f"{kind}[{position}]"
        try:
            if kind == "conversations":
                message = _sharegpt_message(turn, where, ignored)
            else:
                message = _openai_message(turn, where, ignored)
        except _Rejected as exc:
            return reject(exc.reason, exc.detail)
        for name, text in message.texts():
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:  # JSON escapes like "\ud800" decode to lone surrogates
                    return reject(
                        RejectReason.INVALID_UTF8,
                        f"{where}.{name} holds {text[exc.start]!r} at character {exc.start}, "
                        "a lone surrogate that is not valid Unicode",
                    )
        messages.append(message)

    system = record.get("system")
    if isinstance(system, str) and system and messages[0].role != "system":
        messages.insert(0, Message("system", system))  # the ShareGPT variants' system prompt, as a system turn
    elif system is not None and system != "":
        ignored.append("record_field:system")  # not text, or a system message is already there

    if all(m.role == "system" for m in messages):
        return reject(RejectReason.NO_ASSISTANT_TURN, "only system turns")
    if not any(m.role == "assistant" for m in messages):
        return reject(RejectReason.NO_ASSISTANT_TURN, "no assistant turn to learn from")
    return Conversation(source, index, location, tuple(messages), tools, tuple(ignored))


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


def _open_binary(path: Path) -> IO[bytes]:
    if path.name.lower().endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")


def _open_text(path: Path) -> IO[str]:
    # utf-8-sig: a leading byte-order mark is not part of the JSON.
    return io.TextIOWrapper(_open_binary(path), encoding="utf-8-sig")


def _is_jsonl_name(path: Path) -> bool:
    name = path.name.lower()
    return (name[:-3] if name.endswith(".gz") else name).endswith((".jsonl", ".ndjson"))


def _peek(path: Path) -> bytes | None:
    """The first byte that is not whitespace or a byte-order mark; None for an empty file."""
    try:
        with _open_binary(path) as handle:
            return _first_significant_byte(handle)
    except EOFError as exc:
        raise InputFileError(
            f"{path}: the compressed file is truncated ({exc}); replace it with a complete copy"
        ) from None
    except _COMPRESSION_ERRORS as exc:
        raise InputFileError(f"{path}: not a readable gzip file ({exc}); is it really compressed?") from None


def _first_significant_byte(handle: IO[bytes]) -> bytes | None:
    while chunk := handle.read(4096):
        stripped = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")
        if stripped:
            return stripped[:1]
    return None
