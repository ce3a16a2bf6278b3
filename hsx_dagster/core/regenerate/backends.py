"""The backend named by ``regenerate.backend``, built from the settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hsx_dagster.core.regenerate.local_backend import LocalBackend
from hsx_dagster.core.regenerate.openai_backend import OpenAIBackend, OpenAIOptions
from hsx_dagster.core.regenerate.run import Backend
from hsx_dagster.core.settings import ExtractionSettings, RegenerateSettings


def build_backend(
    regenerate: RegenerateSettings,
    model_path: Path,
    extraction: ExtractionSettings,
    *,
    owner: str,
    trust_remote_code: bool = False,
) -> Backend:
    """``openai``: the servers of ``regenerate.endpoints``; ``local``: the target on the device of the
    ``extraction`` settings (the gpu resource), claimed like a shard run claims it."""
    sampling: dict[str, Any] = {
        "max_tokens": regenerate.max_tokens,
        "temperature": regenerate.temperature,
        "top_p": regenerate.top_p,
        "seed": regenerate.seed,
        "chat_template_kwargs": dict(regenerate.chat_template_kwargs),
        "trust_remote_code": trust_remote_code,
    }
    if regenerate.backend == "openai":
        return OpenAIBackend(OpenAIOptions.from_settings(regenerate), model_path, **sampling)
    return LocalBackend(
        model_path,
        devices=extraction.devices,
        compute_dtype=extraction.compute_dtype,
        lock_dir=extraction.device_lock_dir,
        wait_s=extraction.device_wait_s,
        owner=owner,
        batch_size=regenerate.batch_size,
        **sampling,
    )
