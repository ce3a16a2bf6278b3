"""A top-level JSON array read one item at a time (the form raw ShareGPT dumps come in).

Parsed with the standard library's decoder over a sliding window of the text: memory holds one item (and
a read-ahead), and a hostile file (nesting thousands of levels deep, an item that never closes) fails with
a message naming the file and the item instead of exhausting memory. A syntax error ends the file: past it
the array's structure is lost, so no later item can be trusted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from hsx_dagster.core.inputs.records import InputFileError

ARRAY_READ_CHARS = 1 << 20
MAX_ITEM_CHARS = 256 << 20  # one conversation larger than this is refused rather than buffered
# A decoded item is taken only when this many characters follow it (or the file ends), so a number
# or literal cut by a read boundary is never mistaken for a whole one.
_LOOKAHEAD = 16

_WHITESPACE = re.compile(r"[ \t\n\r]*")


def iter_json_array(handle: IO[str], path: Path) -> Iterator[tuple[int, Any]]:
    """(index, item) for every item of the JSON array ``handle`` holds (opened past any byte-order mark);
    errors name ``path``."""
    window = _Window(handle, path)
    index = 0
    try:
        window.skip_whitespace()
        window.at += 1  # the "[" that detect_format saw
        window.skip_whitespace()
        if window.text.startswith("]", window.at):
            raise InputFileError(f"{path}: the JSON array holds no records")
        while True:
            yield index, window.decode_item(index)
            index += 1
            window.skip_whitespace()
            if window.take(","):
                window.skip_whitespace()
            elif window.take("]"):
                break
            else:
                raise InputFileError(f"{path}: invalid JSON {_after(index)}: expected ',' or ']'")
        window.skip_whitespace()
        if window.at < len(window.text):
            raise InputFileError(f"{path}: invalid JSON {_after(index)}: data after the end of the array")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{path}: not UTF-8 text ({exc.reason}) {_after(index)}") from None


def _after(index: int) -> str:
    return f"after item {index - 1}" if index else "in its first item"


class _Window:
    """The array's text around the read position: read ahead in blocks, consumed from the front."""

    def __init__(self, handle: IO[str], path: Path) -> None:
        self.handle, self.path = handle, path
        self.text, self.at, self.eof = "", 0, False
        self.decoder = json.JSONDecoder()

    def fill(self, wanted: int) -> None:
        """Read until ``wanted`` characters lie ahead of the position (or the file ends)."""
        while not self.eof and len(self.text) - self.at < wanted:
            chunk = self.handle.read(max(ARRAY_READ_CHARS, wanted))
            if not chunk:
                self.eof = True
            self.text, self.at = self.text[self.at :] + chunk, 0

    def skip_whitespace(self) -> None:
        while True:
            self.fill(1)
            self.at = _WHITESPACE.match(self.text, self.at).end()  # type: ignore[union-attr]  # \s* always matches
            if self.at < len(self.text) or self.eof:
                return

    def take(self, literal: str) -> bool:
        """Move past ``literal`` if it is at the position."""
        if self.text.startswith(literal, self.at):
            self.at += len(literal)
            return True
        return False

    def decode_item(self, index: int) -> Any:
        """The JSON value at the position, read ahead until it is whole; the position moves past it."""
        wanted = ARRAY_READ_CHARS
        while True:
            self.fill(wanted)
            try:
                item, end = self.decoder.raw_decode(self.text, self.at)
                if self.eof or end + _LOOKAHEAD <= len(self.text):
                    self.at = end
                    return item
            except json.JSONDecodeError as exc:
                cut_by_read = exc.pos >= len(self.text) - _LOOKAHEAD or exc.msg.startswith("Unterminated string")
                if self.eof or not cut_by_read:
                    raise InputFileError(
                        f"{self.path}: invalid JSON {_after(index)}: {exc.msg}; the rest of the array "
                        "cannot be read (fix the file, or convert it to JSON Lines, where a bad "
                        "line is rejected alone)"
                    ) from None
            except RecursionError:
                raise InputFileError(
                    f"{self.path}: item {index} is nested too deeply to be a conversation; the rest "
                    "of the array cannot be read"
                ) from None
            if len(self.text) - self.at >= MAX_ITEM_CHARS:
                raise InputFileError(
                    f"{self.path}: item {index} is larger than {MAX_ITEM_CHARS >> 20} M characters "
                    "(or its JSON never closes)"
                )
            wanted = 2 * (len(self.text) - self.at)
