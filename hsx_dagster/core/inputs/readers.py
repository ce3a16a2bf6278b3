"""Conversation files as streams of records: JSON Lines (``.jsonl``, ``.ndjson``, optionally ``.gz``), a JSON
array (read by `hsx_dagster.core.inputs.json_array`) or Parquet, in file order, memory flat in the file's size.

Problems with a whole file (unknown format, empty file, wrong Parquet schema, not gzip) raise
`InputFileError` naming the file before any tokenisation starts (`check_input_file`); damage found only
while reading (a truncated gzip, a syntax error inside a JSON array) raises it naming the file and the last
record read. A record is handed on as read (`RawRecord`; a JSON line still as bytes): parsing and checking it
is `hsx_dagster.core.inputs.normalise`'s job, which may run in a worker process.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import pyarrow as pa
import pyarrow.parquet as pq

from hsx_dagster.core.inputs.json_array import iter_json_array
from hsx_dagster.core.inputs.records import CONVERSATION_FIELDS, RECORD_FIELDS, InputFileError, RawRecord

PARQUET_BATCH_ROWS = 512
UTF8_BOM = b"\xef\xbb\xbf"
# What a damaged compressed file raises while it is read.
_COMPRESSION_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


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


def _iter_json_array(path: Path) -> Iterator[tuple[int, Any]]:
    with _open_text(path) as handle:
        yield from iter_json_array(handle, path)


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    parquet = pq.ParquetFile(path)
    columns = [name for name in RECORD_FIELDS if name in parquet.schema_arrow.names]
    index = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        for record in batch.to_pylist():
            yield index, record
            index += 1


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
