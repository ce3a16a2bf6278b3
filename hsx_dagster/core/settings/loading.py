"""Reading the settings file: YAML, then the environment, validated and resolved, every error naming the key.

`load_settings` is the one way in (also importable from `hsx_dagster.core.settings`): it reads the file
(`hsx.yaml`, or `HSX_CONFIG`), applies ``HSX_*`` overrides, resolves relative paths against the file's folder,
checks that the inputs and the model directory exist, and reads the model's ``config.json`` once: the
`ModelInfo` it keeps is what every later step knows about the model before any weight loads.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import SettingsError as EnvironmentSettingsError

from hsx_dagster.core.model.info import ModelDirError, ModelInfo, check_model_dir
from hsx_dagster.core.model.layers import LayerSpecError, resolve_layers
from hsx_dagster.core.settings.errors import SettingsError
from hsx_dagster.core.settings.schema import Settings

CONFIG_ENV_VAR = "HSX_CONFIG"
DEFAULT_SETTINGS_FILE = "hsx.yaml"
# Keys of earlier releases: what replaced them, said instead of "unknown key".
RETIRED_KEYS = {
    "operations.retry_cron": "replaced by `operations.retry_every_s` (seconds, e.g. 900): failed shards are "
    "retried by the sensor retry_failed_shards, one backfill per tick",
}


def settings_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The settings file to use: the argument, else $HSX_CONFIG, else ./hsx.yaml."""
    chosen = path or os.environ.get(CONFIG_ENV_VAR) or DEFAULT_SETTINGS_FILE
    return Path(chosen).expanduser().resolve()


def load_settings(path: str | os.PathLike[str] | None = None, *, check_files: bool = True) -> Settings:
    """Read, validate and resolve the settings file; raise `SettingsError` naming the key on any problem.

    With ``check_files`` (the default) the input files and the model directory must exist, and the
    layer ids are checked against the model's ``config.json`` (read once, kept as `Settings.model_info`);
    no weights are read.
    """
    file = settings_path(path)
    if not file.is_file():
        hint = f" (set {CONFIG_ENV_VAR} or create {DEFAULT_SETTINGS_FILE})" if path is None else ""
        raise SettingsError(f"settings file not found: {file}{hint}")
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SettingsError(f"{file}:{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{file}: not UTF-8 text ({exc})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SettingsError(f"{file}: the top level must be a mapping of keys, got {type(raw).__name__}")
    try:
        settings = Settings(**raw)
    except ValidationError as exc:
        raise SettingsError(_describe_validation_error(file, exc)) from None
    except EnvironmentSettingsError as exc:  # an HSX_* variable that is not valid JSON where JSON is needed
        raise SettingsError(f"{file}: environment override: {exc}: {exc.__cause__}") from None

    base = file.parent
    resolved = settings.model_copy(
        update={
            "output_dir": _resolve(base, settings.output_dir),
            "dataset": settings.dataset.model_copy(
                update={"paths": [_resolve(base, p) for p in settings.dataset.paths]}
            ),
            "model": settings.model.model_copy(update={"path": _resolve(base, settings.model.path)}),
            "operations": settings.operations.model_copy(
                update={
                    key: getattr(settings.operations, key) and _resolve(base, getattr(settings.operations, key))
                    for key in ("k8s_run_config", "ray_run_config")
                }
            ),
        }
    )
    model_info = None
    if check_files:
        model_info = _check_files(file, resolved)
        try:
            resolve_layers(resolved.model.layers, model_info.num_hidden_layers)
        except LayerSpecError as exc:
            raise SettingsError(f"{file}: key `model.layers`: {exc}") from None
    resolved.mark_loaded(file, model_info)
    return resolved


def _check_files(file: Path, settings: Settings) -> ModelInfo:
    """The input files and the model directory exist; the model's config.json, as read."""
    for index, path in enumerate(settings.dataset.paths):
        if not path.exists():
            raise SettingsError(f"{file}: key `dataset.paths[{index}]`: file not found: {path}")
        if not path.is_file():
            raise SettingsError(f"{file}: key `dataset.paths[{index}]`: not a file: {path}")
        if path in settings.dataset.paths[:index]:
            first = settings.dataset.paths.index(path)
            raise SettingsError(
                f"{file}: key `dataset.paths[{index}]`: {path} is already listed as dataset.paths[{first}]; "
                "list each file once (every record of the second copy would be rejected as a duplicate)"
            )
    for key in ("k8s_run_config", "ray_run_config"):
        run_config = getattr(settings.operations, key)
        if run_config is not None and not run_config.is_file():
            raise SettingsError(f"{file}: key `operations.{key}`: file not found: {run_config}")
    model_path = settings.model.path
    if not model_path.is_dir():
        raise SettingsError(
            f"{file}: key `model.path`: model directory not found: {model_path} (on {socket.gethostname()}; on a "
            "cluster every node that runs shards needs the model at this path)"
        )
    try:
        return check_model_dir(model_path)
    except ModelDirError as exc:
        raise SettingsError(f"{file}: key `model.path`: {exc}") from None


def _resolve(base: Path, path: Path) -> Path:
    path = path.expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def _describe_validation_error(file: Path, exc: ValidationError) -> str:
    lines = [f"{file}: invalid settings"]
    for error in exc.errors():
        key = _dotted(error["loc"])
        if error["type"] == "extra_forbidden":
            message = RETIRED_KEYS.get(key, "unknown key")
        elif error["type"] == "missing":
            message = "required key is missing"
        else:
            message = error["msg"]
        value = error.get("input")
        shown = "" if error["type"] == "missing" or isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"  key `{key}`: {message}{shown}")
    return "\n".join(lines)


def _dotted(loc: tuple[Any, ...]) -> str:
    key = ""
    for part in loc:
        # Union members add their type name to the location; it means nothing to a user.
        if isinstance(part, str) and (part.startswith(("list[", "str", "int")) or part in {"function-after"}):
            continue
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else part)
    return key
