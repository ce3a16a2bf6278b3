"""Dagster resources: the settings file and the GPU the extraction runs on.

Both are `ConfigurableResource`s, so every field can be changed per run from the launchpad or the
CLI (``--config-json '{"resources": {"gpu": {"config": {"batch_size": 64}}}}'``); the defaults come
from hsx.yaml (and its ``HSX_*`` environment overrides) when the definitions load.
"""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field, ValidationError

from hsx_dagster.core.settings import ExtractionSettings, Settings, SettingsError, load_settings


class HsxSettings(ConfigurableResource):
    """Where the pipeline's settings file is; runs load and validate it before any work starts."""

    path: str = Field(description="Settings file (hsx.yaml); relative paths in it resolve against its folder")

    def load(self) -> Settings:
        return load_settings(self.path)


class GpuResource(ConfigurableResource):
    """The accelerator a shard run extracts on, and how its forward passes are shaped.

    Defaults come from the ``extraction`` section of hsx.yaml (and ``HSX_EXTRACTION__*``); run config
    overrides them for one run.
    """

    devices: list[str] = Field(
        default_factory=lambda: ["auto"],
        description="'auto' (every visible GPU, else CPU), 'cpu', 'cuda', or ids like 'cuda:0'; "
        "shard k runs on devices[k % len(devices)]",
    )
    compute_dtype: str = Field("auto", description="auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16, float32")
    storage_dtype: str = Field(
        "bfloat16", description="dtype of the stored states: bfloat16, float16, float32, float8_e4m3 (block-scaled)"
    )
    nan_policy: str = Field("fail", description="NaN/Inf in a sample's states: fail, or quarantine (set aside, go on)")
    attn_implementation: str = Field("sdpa", description="sdpa, eager, or flash_attention_2 when installed")
    batch_size: int = Field(32, ge=1, description="Most rows in one forward pass")
    max_batch_tokens: int = Field(
        32768, ge=1, description="Most computed tokens (rows x longest row) in one forward pass"
    )
    chunk_mb: float = Field(256.0, gt=0, description="Target size of one safetensors chunk file")
    device_wait_s: float = Field(600.0, ge=0, description="How long a shard run waits for a free GPU before failing")
    device_lock_dir: str = Field("/tmp/hsx-dagster-device-locks", description="Per-host folder of GPU claims")
    on_mismatch: str = Field(
        "refuse",
        description="A shard folder made with another model, layers, dtype or tokenized input: refuse, "
        "or start_over (delete that shard's states and redo it)",
    )

    @classmethod
    def from_settings(cls, settings: Settings) -> GpuResource:
        return cls(**settings.extraction.model_dump(mode="json"))

    def validated(self) -> ExtractionSettings:
        """These values checked by the same rules as the settings file (run config bypasses the file)."""
        try:
            return ExtractionSettings(**self.model_dump(include=set(ExtractionSettings.model_fields)))
        except ValidationError as exc:
            problems = "; ".join(f"`{'.'.join(map(str, e['loc']))}`: {e['msg']}" for e in exc.errors())
            raise SettingsError(f"resource `gpu` config: {problems}") from None
