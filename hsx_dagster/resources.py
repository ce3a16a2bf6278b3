"""Dagster resources: the settings file and the GPU the extraction runs on.

Both are `ConfigurableResource`s, so every field can be changed per run from the launchpad or the
CLI (``--config-json '{"resources": {"gpu": {"config": {"batch_size": 64}}}}'``); the defaults come
from hsx.yaml (and its ``HSX_*`` environment overrides) when the definitions load.
"""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from hsx_dagster.core.settings import Settings, load_settings


class HsxSettings(ConfigurableResource):
    """Where the pipeline's settings file is; runs load and validate it before any work starts."""

    path: str = Field(description="Settings file (hsx.yaml); relative paths in it resolve against its folder")

    def load(self) -> Settings:
        return load_settings(self.path)


class GpuResource(ConfigurableResource):
    """The accelerator a shard run extracts on, and how big its forward passes are."""

    devices: list[str] = Field(
        default_factory=lambda: ["auto"],
        description="Devices to map shards onto: 'auto', 'cpu', 'cuda', or ids like 'cuda:0'",
    )
    batch_size: int = Field(32, ge=1, description="Most rows in one forward pass")
    max_batch_tokens: int = Field(32768, ge=1, description="Most computed tokens (rows x longest row) in one forward pass")

    @classmethod
    def from_settings(cls, settings: Settings) -> GpuResource:
        return cls(batch_size=settings.extraction.batch_size, max_batch_tokens=settings.extraction.max_batch_tokens)
