"""Read conversation files into one normalised form, streaming, with every bad record accounted for.

Inputs: JSON Lines (``.jsonl``, ``.ndjson``, optionally ``.gz``), a JSON array (the form raw ShareGPT
dumps come in) or Parquet. Each record is either ShareGPT (``conversations: [{from, value}]``) or
OpenAI chat (``messages: [{role, content}]``); the form is detected per record, so mixed files work.

`iter_records` yields a `Conversation` for every usable record and a `Reject` (with the file, the
record's position and a reason code) for every other one; nothing is skipped silently. Problems
with a whole file (unknown format, empty file, wrong Parquet schema) raise `InputFileError` naming
the file, before any tokenisation starts (`check_input_file`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import ijson
import pyarrow.parquet as pq

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
CONVERSATION_FIELDS = ("conversations", "messages")
PARQUET_BATCH_ROWS = 512


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
    # Decided later, by tokenisation:
    DUPLICATE = "duplicate"
    CONTROL_TOKEN_IN_CONTENT = "control_token_in_content"
    TEMPLATE_ERROR = "template_error"
    TOO_FEW_LOSS_TOKENS = "too_few_loss_tokens"


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str


@dataclass(frozen=True, slots=True)
class Conversation:
    source: str  # the input file
    source_index: int  # 0-based position of the record in its file (line, row or array item)
    location: str  # the same position for humans: "line 12", "row 4", "item 7"
    messages: tuple[Message, ...]

    def as_chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


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
        with _open_binary(path) as handle:
            first = _first_significant_byte(handle)
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
    else:
        with _open_binary(path) as handle:
            if _first_significant_byte(handle) is None:
                raise InputFileError(f"{path}: the file is empty")
    return fmt


def iter_records(path: Path) -> Iterator[Conversation | Reject]:
    """Stream a file's records, normalised, in file order; memory does not grow with the file."""
    fmt = check_input_file(path)
    source = str(path)
    if fmt == "jsonl":
        for index, record in _iter_jsonl(path):
            yield _normalise(source, index, f"line {index + 1}", record)
    elif fmt == "json_array":
        for index, record in _iter_json_array(path):
            yield _normalise(source, index, f"item {index}", record)
    else:
        for index, record in _iter_parquet(path):
            yield _normalise(source, index, f"row {index}", record)


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with _open_binary(path) as handle:
        for index, raw in enumerate(handle):
            if not raw.strip():
                continue  # blank lines separate nothing and hold no record
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield index, Reject("", 0, "", RejectReason.INVALID_UTF8, f"not UTF-8 at byte {exc.start}")
                continue
            try:
                yield index, json.loads(text)
            except json.JSONDecodeError as exc:
                yield index, Reject("", 0, "", RejectReason.INVALID_JSON, f"{exc.msg} at column {exc.colno}")


def _iter_json_array(path: Path) -> Iterator[tuple[int, Any]]:
    index = -1
    with _open_binary(path) as handle:
        try:
            for index, record in enumerate(ijson.items(handle, "item", use_float=True)):
                yield index, record
        except (ijson.JSONError, UnicodeDecodeError) as exc:
            # Past a syntax error the array's structure is lost: no later item can be trusted.
            raise InputFileError(f"{path}: invalid JSON after item {index}: {exc}") from None
    if index < 0:
        raise InputFileError(f"{path}: the JSON array holds no records")


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    parquet = pq.ParquetFile(path)
    columns = [name for name in CONVERSATION_FIELDS if name in parquet.schema_arrow.names]
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
    role_key, content_key = ("from", "value") if kind == "conversations" else ("role", "content")

    messages = []
    for position, turn in enumerate(turns):
        where = f"{kind}[{position}]"
        if not isinstance(turn, dict) or role_key not in turn:
            return reject(RejectReason.MALFORMED_MESSAGE, f"{where} has no '{role_key}'")
        raw_role = turn[role_key]
        role = ROLE_ALIASES.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            return reject(RejectReason.UNKNOWN_ROLE, f"{where}.{role_key} is {raw_role!r}")
        content = _text_content(turn.get(content_key))
        if content is None:
            shown = type(turn.get(content_key)).__name__
            return reject(RejectReason.NON_TEXT_CONTENT, f"{where}.{content_key} is a {shown}, not text")
        messages.append(Message(role, content))

    if all(m.role == "system" for m in messages):
        return reject(RejectReason.NO_ASSISTANT_TURN, "only system turns")
    if not any(m.role == "assistant" for m in messages):
        return reject(RejectReason.NO_ASSISTANT_TURN, "no assistant turn to learn from")
    return Conversation(source, index, location, tuple(messages))


def _text_content(content: Any) -> str | None:
    """A message's text; OpenAI lists of text parts are joined, anything else is not text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                return None
        return "".join(parts)
    return None


def _open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _first_significant_byte(handle: IO[bytes]) -> bytes | None:
    while chunk := handle.read(4096):
        stripped = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")
        if stripped:
            return stripped[:1]
    return None
