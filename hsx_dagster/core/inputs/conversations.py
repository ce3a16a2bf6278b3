"""Read conversation files into one normalised form, streaming, with every bad record accounted for.

Inputs: JSON Lines (``.jsonl``, ``.ndjson``, optionally ``.gz``), a JSON array (the form raw ShareGPT
dumps come in) or Parquet. Each record is either ShareGPT (``conversations: [{from, value}]``) or
OpenAI chat (``messages: [{role, content}]``); the form is detected per record, so mixed files work.

`iter_records` yields a `Conversation` for every usable record and a `Reject` (with the file, the
record's position and a reason code) for every other one; nothing is skipped silently. It is reading
(`hsx_dagster.core.inputs.readers`: the file formats, the streaming JSON-array parser in `json_array`)
followed by normalising (`hsx_dagster.core.inputs.normalise`: ShareGPT and OpenAI records, everything a chat
template can render kept as given), two steps so that tokenisation can read in one process and parse in its
workers. The record types are in `hsx_dagster.core.inputs.records`; this module is where callers find them
together.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hsx_dagster.core.inputs.normalise import normalise_record
from hsx_dagster.core.inputs.readers import check_input_file, detect_format, iter_raw_records
from hsx_dagster.core.inputs.records import Conversation, InputFileError, Message, RawRecord, Reject, RejectReason

__all__ = [
    "Conversation",
    "InputFileError",
    "Message",
    "RawRecord",
    "Reject",
    "RejectReason",
    "check_input_file",
    "detect_format",
    "iter_raw_records",
    "iter_records",
    "normalise_record",
]


def iter_records(path: Path) -> Iterator[Conversation | Reject]:
    """Stream a file's records, normalised, in file order; memory does not grow with the file."""
    for raw in iter_raw_records(path):
        yield normalise_record(raw)
