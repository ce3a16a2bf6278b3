"""Dagster resources: the settings file and the GPU the extraction runs on.

Both are `ConfigurableResource`s, so every field can be changed per run from the launchpad or the
CLI (``--config-json '{"resources": {"gpu": {"config": {"batch_size": 64}}}}'``); the defaults come
from hsx.yaml (and its ``HSX_*`` environment overrides) when the definitions load.

`GpuResource`'s fields are generated from `ExtractionSettings`, the settings file's ``extraction``
section: one declaration (names, defaults, descriptions), so a new extraction setting reaches run
config without being written twice. Values are validated by the settings model's own rules. The same
generator (`resource_fields`) makes `GeneratorResource` from ``regenerate`` and the run config of
`tokenized_dataset` from three ``dataset`` keys.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

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

SectionT = TypeVar("SectionT", bound=BaseModel)


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


def resource_fields(
    model: type[BaseModel], names: Sequence[str] | None = None, *, overrides: bool = False
) -> dict[str, Any]:
    """``create_model`` field definitions mirroring ``model``'s fields (``names``, default all) as Dagster
    config: type, default and description from the settings model. ``overrides``: every field optional with
    default None, meaning "as the settings file says"."""
    fields: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if names is not None and name not in names:
            continue
        kind = config_type(field.annotation)
        if overrides:
            fields[name] = (kind | None, Field(None, description=field.description))
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, Path):
            default = str(default)
        fields[name] = (kind, Field(default, description=field.description))
    return fields


def validated(model: type[SectionT], values: dict[str, Any], what: str) -> SectionT:
    """``values`` checked by the settings model's own rules (run config bypasses the file); a `SettingsError`
    naming ``what`` and each bad key otherwise."""
    try:
        return model(**values)
    except ValidationError as exc:
        problems = "; ".join(f"`{'.'.join(map(str, e['loc']))}`: {e['msg']}" for e in exc.errors())
        raise SettingsError(f"{what}: {problems}") from None


class _GpuResourceBase(ConfigurableResource):
    @classmethod
    def from_settings(cls, settings: Settings) -> Self:
        return cls(**settings.extraction.model_dump(mode="json"))

    def validated(self) -> ExtractionSettings:
        """These values checked by the same rules as the settings file (run config bypasses the file)."""
        values = self.model_dump(include=set(ExtractionSettings.model_fields))
        return validated(ExtractionSettings, values, "resource `gpu` config")


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
        values = {**self.model_dump(include=set(RegenerateSettings.model_fields)), "enabled": True}
        return validated(RegenerateSettings, values, "resource `generator` config")


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
