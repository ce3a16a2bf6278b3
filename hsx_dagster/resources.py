"""Dagster resources: the settings file and the GPU the extraction runs on.

Both are `ConfigurableResource`s, so every field can be changed per run from the launchpad or the
CLI (``--config-json '{"resources": {"gpu": {"config": {"batch_size": 64}}}}'``); the defaults come
from hsx.yaml (and its ``HSX_*`` environment overrides) when the definitions load.

`GpuResource`'s fields are generated from `ExtractionSettings`, the settings file's ``extraction``
section: one declaration (names, defaults, descriptions), so a new extraction setting reaches run
config without being written twice. Values are validated by the settings model's own rules.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

from dagster import ConfigurableResource
from pydantic import BaseModel, Field, ValidationError, create_model
from typing_extensions import Self

from hsx_dagster.core.settings import (
    ExtractionSettings,
    RegenerateSettings,
    Settings,
    SettingsError,
    load_settings,
)


class HsxSettings(ConfigurableResource):
    """Where the pipeline's settings file is; runs load and validate it before any work starts."""

    path: str = Field(description="Settings file (hsx.yaml); relative paths in it resolve against its folder")

    def load(self) -> Settings:
        return load_settings(self.path)


def config_type(annotation: Any) -> Any:
    """The Dagster config type for a settings annotation: Dagster's config system knows scalars,
    lists and Any; choices (Literal) and paths travel as strings and are checked by the settings model."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return config_type(typing.get_args(annotation)[0])
    if origin is Literal:
        kinds = {type(choice) for choice in typing.get_args(annotation)}
        return kinds.pop() if len(kinds) == 1 else Any
    if origin in (typing.Union, types.UnionType):
        members = [config_type(member) for member in typing.get_args(annotation) if member is not type(None)]
        if len(set(members)) == 1:
            return members[0] if len(members) == len(typing.get_args(annotation)) else members[0] | None
        return Any  # e.g. an int or 'auto': validated by the settings model
    if origin is list:
        (item,) = typing.get_args(annotation)
        return list[config_type(item)]  # type: ignore[misc]  # a type built at run time
    if annotation is Path:
        return str
    return annotation


def resource_fields(model: type[BaseModel]) -> dict[str, Any]:
    """``create_model`` field definitions mirroring ``model``'s fields as Dagster config."""
    fields: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, Path):
            default = str(default)
        fields[name] = (config_type(field.annotation), Field(default, description=field.description))
    return fields


class _GpuResourceBase(ConfigurableResource):
    @classmethod
    def from_settings(cls, settings: Settings) -> Self:
        return cls(**settings.extraction.model_dump(mode="json"))

    def validated(self) -> ExtractionSettings:
        """These values checked by the same rules as the settings file (run config bypasses the file)."""
        try:
            return ExtractionSettings(**self.model_dump(include=set(ExtractionSettings.model_fields)))
        except ValidationError as exc:
            problems = "; ".join(f"`{'.'.join(map(str, e['loc']))}`: {e['msg']}" for e in exc.errors())
            raise SettingsError(f"resource `gpu` config: {problems}") from None


if typing.TYPE_CHECKING:  # the checker sees the methods; the fields come from ExtractionSettings at run time

    class GpuResource(_GpuResourceBase):
        pass

else:
    GpuResource = create_model(
        "GpuResource",
        __base__=_GpuResourceBase,
        __module__=__name__,
        __doc__="The accelerator a shard run extracts on, and how its forward passes are shaped. Defaults come from "
        "the ``extraction`` section of hsx.yaml (and ``HSX_EXTRACTION__*``); run config overrides them for one run.",
        **resource_fields(ExtractionSettings),
    )


class _GeneratorResourceBase(ConfigurableResource):
    @classmethod
    def from_settings(cls, settings: Settings) -> Self:
        return cls(**settings.regenerate.model_dump(mode="json", exclude={"enabled"}))

    def validated(self) -> RegenerateSettings:
        """These values checked by the same rules as the settings file (run config bypasses the file)."""
        try:
            return RegenerateSettings(enabled=True, **self.model_dump(include=set(RegenerateSettings.model_fields)))
        except ValidationError as exc:
            problems = "; ".join(f"`{'.'.join(map(str, e['loc']))}`: {e['msg']}" for e in exc.errors())
            raise SettingsError(f"resource `generator` config: {problems}") from None


if typing.TYPE_CHECKING:  # the fields come from RegenerateSettings at run time, as for GpuResource

    class GeneratorResource(_GeneratorResourceBase):
        pass

else:
    GeneratorResource = create_model(
        "GeneratorResource",
        __base__=_GeneratorResourceBase,
        __module__=__name__,
        __doc__="What regenerates the assistant turns (regenerated_conversations): the target in-process (local) or "
        "OpenAI-compatible servers (openai), and how it samples. Defaults come from the ``regenerate`` section of "
        "hsx.yaml (and ``HSX_REGENERATE__*``); run config overrides them for one run. ``regenerate.enabled`` shapes "
        "the asset graph and is read from the settings only.",
        **{name: field for name, field in resource_fields(RegenerateSettings).items() if name != "enabled"},
    )
