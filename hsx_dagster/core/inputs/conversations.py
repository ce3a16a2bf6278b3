"""Read conversation files into one normalised form, streaming, with every bad record accounted for.

Inputs: JSON Lines (``.jsonl``, ``.ndjson``, optionally ``.gz``), a JSON array (the form raw ShareGPT
dumps come in) or Parquet. Each record is either ShareGPT (``conversations: [{from, value}]``) or
OpenAI chat (``messages: [{role, content}]``); the form is detected per record, so mixed files work.

`iter_records` yields a `Conversation` for every usable record and a `Reject` (with the file, the
record's position and a reason code) for every other one; nothing is skipped silently. Problems
with a whole file (unknown format, empty file, wrong Parquet schema, not gzip) raise `InputFileError`
naming the file, before any tokenisation starts (`check_input_file`); damage found only while
reading (a truncated gzip, a syntax error inside a JSON array, which loses the array's structure)
raises it naming the file and the last record read.

A JSON array is parsed one item at a time with the standard library's decoder: memory holds one
item, and a hostile file (nesting thousands of levels deep) fails with a message instead of
exhausting memory.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import pyarrow as pa
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


def iter_records(path: Path) -> Iterator[Conversation | Reject]:
    """Stream a file's records, normalised, in file order; memory does not grow with the file."""
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
            yield _normalise(source, index, location, record)
    except _COMPRESSION_ERRORS as exc:
        where = f"after {location}" if location else "before its first record"
        raise InputFileError(
            f"{path}: the compressed file is truncated or corrupt ({where}: {exc}); replace it with a complete copy"
        ) from None
    except pa.ArrowException as exc:
        where = f"after {location}" if location else "in its first row group"
        raise InputFileError(f"{path}: cannot read the Parquet file {where}: {exc}") from None


def _iter_jsonl(path: Path, strict_first: bool = False) -> Iterator[tuple[int, Any]]:
    with _open_binary(path) as handle:
        first = True
        for index, raw in enumerate(handle):
            if index == 0 and raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM) :]  # editors on Windows start files with a byte-order mark
            if not raw.strip():
                continue  # blank lines separate nothing and hold no record
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield index, Reject("", 0, "", RejectReason.INVALID_UTF8, f"not UTF-8 at byte {exc.start}")
                first = False
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                if first and strict_first:
                    raise InputFileError(
                        f"{path}: line {index + 1} is not a whole JSON record ({exc.msg} at column {exc.colno}); "
                        "a .json file must hold a JSON array of records or one record per line "
                        "(a single pretty-printed object is neither)"
                    ) from None
                record = Reject("", 0, "", RejectReason.INVALID_JSON, f"{exc.msg} at column {exc.colno}")
            except RecursionError:
                record = Reject("", 0, "", RejectReason.INVALID_JSON, "nested too deeply to be a conversation")
            first = False
            yield index, record


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
        if not content.isascii():
            try:
                content.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON escapes like "\ud800" decode to lone surrogates
                return reject(
                    RejectReason.INVALID_UTF8,
                    f"{where}.{content_key} holds {content[exc.start]!r} at character {exc.start}, "
                    "a lone surrogate that is not valid Unicode",
                )
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
