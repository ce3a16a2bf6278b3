"""The settings' choices, declared once: the settings sections take their types from here, and the code that
acts on a choice lists its values with ``typing.get_args`` (so a new value cannot reach one place only).

Also the one parser of "``auto`` or a positive integer" (batch limits, tokenize workers), for the settings
file, the environment, run config and direct callers alike. Imports only the standard library: the
trainer-side reader reaches this module through the storage format.
"""

from __future__ import annotations

import json
from typing import Any, Literal

AUTO = "auto"

Thinking = Literal["keep", "strip", "exclude_from_loss"]  # reasoning in assistant turns
LossMask = Literal["assistant", "all"]  # the tokens a drafter learns to predict
ComputeDtype = Literal["auto", "bfloat16", "float16", "float32"]  # auto: bfloat16 on a GPU, float32 on the CPU
StorageDtype = Literal["bfloat16", "float16", "float32", "float8_e4m3"]
NanPolicy = Literal["fail", "quarantine"]
DirectIo = Literal["auto", "on", "off"]  # chunk files written with O_DIRECT (core/storage/direct_io.py)
# Explicit attention implementations, fastest first: `auto` takes the first one that works for the model.
AttnImplementation = Literal["flash_attention_3", "flash_attention_2", "flash_attention_4", "sdpa", "eager"]
OnMismatch = Literal["refuse", "start_over"]  # a shard folder made differently
RegenerateBackend = Literal["local", "openai"]
RegenerateTurns = Literal["all", "last"]
OnTruncated = Literal["keep", "reject"]


def parse_auto_or_positive(value: Any) -> int | None:
    """None for ``auto`` (any case; None too), else the positive integer: an int, or its digits as a string
    (the environment and run config pass "64" or "AUTO")."""
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("expected a positive integer or 'auto'")
    return value


def list_from_env(value: Any) -> Any:
    """A list given as one environment string: JSON, or comma-separated (friendlier in a shell)."""
    if isinstance(value, str):
        return json.loads(value) if value.startswith("[") else [p.strip() for p in value.split(",") if p.strip()]
    return value
