"""Numbers as people read them: sizes, counts, durations, rates and shares, each with its unit.

One formatter for every place a person reads a figure (the Dagster metadata, run logs, and
`python -m hsx_dagster.report`), so the UI and the report say the same thing the same way.
Sizes are decimal (1 MB = 1,000,000 bytes), as `du --si` and disk vendors count.
"""

from __future__ import annotations

import math

_SIZE_UNITS = ("KB", "MB", "GB", "TB", "PB")


def format_bytes(count: float) -> str:
    """``229892108`` -> ``229.9 MB``; under 1 KB in bytes."""
    if count < 1000:
        return f"{int(count)} B"
    for unit in _SIZE_UNITS:
        count /= 1000
        if count < 999.95 or unit == _SIZE_UNITS[-1]:
            return f"{count:.1f} {unit}"
    raise AssertionError("unreachable")


def format_count(count: float, unit: str = "") -> str:
    """``1181848`` -> ``1,181,848``; with ``unit``, ``1,181,848 tokens``."""
    text = f"{count:,.0f}" if isinstance(count, float) else f"{count:,}"
    return f"{text} {unit}" if unit else text


def format_duration(seconds: float) -> str:
    """``452.46`` -> ``7 min 32 s``; ``20912`` -> ``5 h 49 min``; under a minute to a tenth of a second,
    whole seconds from 10 s on; days past 48 h."""
    if math.isinf(seconds) or math.isnan(seconds):
        return "unknown"
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours:02d} h"


_DURATION_UNITS = {"d": 86400.0, "h": 3600.0, "min": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds from what `format_duration` wrote: ``7 min 32 s`` -> ``452.0``; ``unknown`` -> inf. For the
    programs that read a duration shown to people (to the precision shown)."""
    if text == "unknown":
        return math.inf
    words = text.split()
    if not words or len(words) % 2 or any(unit not in _DURATION_UNITS for unit in words[1::2]):
        raise ValueError(f"not a duration as format_duration writes them: {text!r}")
    return sum(float(value) * _DURATION_UNITS[unit] for value, unit in zip(words[::2], words[1::2]))


def format_rate(per_second: float, unit: str) -> str:
    """``2611.7, "tokens"`` -> ``2,612 tokens/s``; below 10 with one decimal."""
    if per_second < 10:
        return f"{per_second:.1f} {unit}/s"
    return f"{per_second:,.0f} {unit}/s"


def format_share(fraction: float) -> str:
    """``0.4312`` -> ``43.1%``; a share of a whole, one decimal."""
    return f"{100 * fraction:.1f}%"
