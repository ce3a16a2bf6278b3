"""settings"""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.settings.choices import (
        AUTO as AUTO,
    )
    from hsx_dagster.core.settings.choices import (
        AttnImplementation as AttnImplementation,
    )
    from hsx_dagster.core.settings.choices import (
        ComputeDtype as ComputeDtype,
    )
    from hsx_dagster.core.settings.choices import (
        NanPolicy as NanPolicy,
    )
    from hsx_dagster.core.settings.choices import (
        OnMismatch as OnMismatch,
    )
    from hsx_dagster.core.settings.choices import (
        OnTruncated as OnTruncated,
    )
    from hsx_dagster.core.settings.choices import (
        RegenerateBackend as RegenerateBackend,
    )
    from hsx_dagster.core.settings.choices import (
        RegenerateTurns as RegenerateTurns,
    )
    from hsx_dagster.core.settings.choices import (
        StorageDtype as StorageDtype,
    )
    from hsx_dagster.core.settings.choices import (
        Thinking as Thinking,
    )
    from hsx_dagster.core.settings.choices import (
        list_from_env as list_from_env,
    )
    from hsx_dagster.core.settings.choices import (
        parse_auto_or_positive as parse_auto_or_positive,
    )
    from hsx_dagster.core.settings.errors import SettingsError as SettingsError
    from hsx_dagster.core.settings.loading import load_settings as load_settings
    from hsx_dagster.core.settings.loading import settings_path as settings_path
    from hsx_dagster.core.settings.schema import (
        DEFAULT_LOCK_DIR as DEFAULT_LOCK_DIR,
    )
    from hsx_dagster.core.settings.schema import (
        DatasetSettings as DatasetSettings,
    )
    from hsx_dagster.core.settings.schema import (
        DrafterSettings as DrafterSettings,
    )
    from hsx_dagster.core.settings.schema import (
        ExportSettings as ExportSettings,
    )
    from hsx_dagster.core.settings.schema import (
        ExtractionSettings as ExtractionSettings,
    )
    from hsx_dagster.core.settings.schema import (
        ModelSettings as ModelSettings,
    )
    from hsx_dagster.core.settings.schema import (
        OperationsSettings as OperationsSettings,
    )
    from hsx_dagster.core.settings.schema import (
        RegenerateSettings as RegenerateSettings,
    )
    from hsx_dagster.core.settings.schema import (
        Settings as Settings,
    )

EXPORTS = {
    "choices": [
        "AUTO",
        "AttnImplementation",
        "ComputeDtype",
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
