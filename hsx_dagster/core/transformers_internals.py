"""Every use of transformers' private API, in one place: the seam an upgrade of transformers is checked at.

transformers says which attention implementations a model class runs only in underscored class
flags, and which one a loaded model uses only in ``config._attn_implementation``; neither has a
public accessor. The extraction reads them here (through `AttentionFlags` and
`attn_implementation_in_use`), before any weight loads, to pick the fastest implementation that
works and to report the one in use.

`CHECKED_ON` lists the transformers releases these were checked on; hsx_dagster_tests/test_seams.py
fails naming this module when another release is installed (and checks the flags' meaning on real
model classes), so an upgrade is a conscious act: re-read the uses below against the new release,
then add its version. Imports nothing from transformers itself: the caller hands over the class or
the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHECKED_ON = ("5.25.0",)


@dataclass(frozen=True)
class AttentionFlags:
    """What a model class says it supports: sdpa, flash-attention, and which flash variants only."""

    name: str  # the class's name, for messages
    sdpa: bool
    flash: bool
    flash_variants: tuple[str, ...] | None = None  # None: every flash-attention variant the class supports

    @classmethod
    def of(cls, model_class: type) -> AttentionFlags:
        variants = getattr(model_class, "_compatible_flash_implementations", None)
        return cls(
            name=model_class.__name__,
            sdpa=bool(getattr(model_class, "_supports_sdpa", False)),
            flash=bool(getattr(model_class, "_supports_flash_attn", False)),
            flash_variants=tuple(variants) if variants is not None else None,
        )


def attn_implementation_in_use(model: Any) -> str | None:
    """The attention implementation a loaded model (or its config) runs, as transformers resolved it."""
    config = getattr(model, "config", model)
    return getattr(config, "_attn_implementation", None)
