"""What every data-quality check of the core returns; the Dagster layer turns it into an AssetCheckResult."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)
