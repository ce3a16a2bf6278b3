"""Cache stamps: every step of the benchmark (target, data variant, drafter measurement) writes, last, the digest of
what made it, and is redone only when that digest changes."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def stamp_digest(*parts: Any) -> str:
    """What a cache stamp records: the sha256 of its parts as sorted JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()
