"""The settings: one file (hsx.yaml or `HSX_CONFIG`), overridable from the environment, validated before any
expensive work.

- `schema`: every key with its type, default and description, declared once (`Settings` and its sections);
- `loading`: `load_settings` reads the file and the environment, resolves paths and checks the model directory;
- `choices`: the values a choice may take, and the one parser of ``auto`` or a positive integer;
- `errors`: `SettingsError`, naming the file, the key and the bad value;
- `reference`: the table of docs/configuration.md, generated from `schema`.

Loaded lazily: the trainer-side reader reaches `choices` through the storage format without pydantic.
"""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.settings.choices import (
        AUTO as AUTO,
        AttnImplementation as AttnImplementation,
        ComputeDtype as ComputeDtype,
        LossMask as LossMask,
        NanPolicy as NanPolicy,
        OnMismatch as OnMismatch,
        OnTruncated as OnTruncated,
        RegenerateBackend as RegenerateBackend,
        RegenerateTurns as RegenerateTurns,
        StorageDtype as StorageDtype,
        Thinking as Thinking,
        list_from_env as list_from_env,
        parse_auto_or_positive as parse_auto_or_positive,
    )
    from hsx_dagster.core.settings.errors import SettingsError as SettingsError
    from hsx_dagster.core.settings.loading import load_settings as load_settings, settings_path as settings_path
    from hsx_dagster.core.settings.schema import (
        DEFAULT_LOCK_DIR as DEFAULT_LOCK_DIR,
        DatasetSettings as DatasetSettings,
        DrafterSettings as DrafterSettings,
        ExportSettings as ExportSettings,
        ExtractionSettings as ExtractionSettings,
        ModelSettings as ModelSettings,
        OperationsSettings as OperationsSettings,
        RegenerateSettings as RegenerateSettings,
        Settings as Settings,
    )

EXPORTS = {
    "choices": [
        "AUTO",
        "AttnImplementation",
        "ComputeDtype",
        "LossMask",
        "NanPolicy",
        "OnMismatch",
        "OnTruncated",
        "RegenerateBackend",
        "RegenerateTurns",
        "StorageDtype",
        "Thinking",
        "list_from_env",
        "parse_auto_or_positive",
    ],
    "errors": ["SettingsError"],
    "loading": ["load_settings", "settings_path"],
    "schema": [
        "DEFAULT_LOCK_DIR",
        "DatasetSettings",
        "DrafterSettings",
        "ExportSettings",
        "ExtractionSettings",
        "ModelSettings",
        "OperationsSettings",
        "RegenerateSettings",
        "Settings",
    ],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
