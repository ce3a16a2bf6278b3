"""The backend named by ``regenerate.backend``, built from the settings."""

from __future__ import annotations

from pathlib import Path

from hsx_dagster.core.regenerate.local_backend import LocalBackend
from hsx_dagster.core.regenerate.openai_backend import OpenAIBackend
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
    if regenerate.backend == "openai":
        return OpenAIBackend(regenerate, model_path, trust_remote_code=trust_remote_code)
    return LocalBackend(regenerate, extraction, model_path, owner=owner, trust_remote_code=trust_remote_code)
