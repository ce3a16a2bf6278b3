"""One settings file for the whole pipeline, validated before any expensive work.

`hsx.yaml` at the repository root is the default; `HSX_CONFIG` names another file. Any key can be
overridden from the environment as ``HSX_<SECTION>__<KEY>`` (e.g. ``HSX_EXTRACTION__BATCH_SIZE=64``);
the environment wins over the file. Relative paths resolve against the settings file's folder, so a
settings file can be moved together with its data.

Every error names the file, the key and the bad value (``SettingsError``), and is raised before
model weights are touched: the model directory is checked from its ``config.json`` alone.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings import SettingsError as EnvironmentSettingsError

from hsx_dagster.core.extraction.devices import DEFAULT_LOCK_DIR
from hsx_dagster.core.layers import LayerSpecError, parse_layer_spec, resolve_layers
from hsx_dagster.core.model_info import ModelDirError, ModelInfo, check_model_dir

CONFIG_ENV_VAR = "HSX_CONFIG"
DEFAULT_SETTINGS_FILE = "hsx.yaml"
SHARD_KEY = re.compile(r"shard-\d{2,}")


class SettingsError(ValueError):
    """A settings problem, worded for the user: file, key, bad value, what is expected."""


def list_from_env(value: Any) -> Any:
    """A list given as one environment string: JSON, or comma-separated (friendlier in a shell)."""
    if isinstance(value, str):
        return json.loads(value) if value.startswith("[") else [p.strip() for p in value.split(",") if p.strip()]
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatasetSettings(_Section):
    paths: list[Path] = Field(min_length=1, description="Conversation files: JSONL, JSON array or Parquet")
    max_length: int = Field(4096, ge=16, description="Samples are truncated to this many tokens")
    min_loss_tokens: int = Field(1, ge=1, description="Samples with fewer supervised tokens are rejected")
    thinking: Literal["keep", "strip", "exclude_from_loss"] = Field(
        "keep",
        description=(
            "keep: reasoning (reasoning_content or inline <think>) as the chat template renders it (supervised); "
            "strip: remove it from every assistant turn; exclude_from_loss: render it but mask it out"
        ),
    )
    tokenize_workers: int | Literal["auto"] = Field(
        "auto",
        description="Processes that parse, render and tokenise conversations, one core each; auto: every core, "
        "but no more than one per 256 KB of input; 1: in the main process, on one core. The output is the same "
        "whatever the count",
    )

    @field_validator("tokenize_workers", mode="before")
    @classmethod
    def _workers_auto_or_positive(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("expected a positive integer or 'auto'")
        return value


class ModelSettings(_Section):
    path: Path
    layers: list[int] | str = Field("eagle3", description="Layer ids, 'eagle3' or 'dflash-K'")
    include_final: bool = Field(False, description="Also store the final-norm output (what the LM head reads)")
    trust_remote_code: bool = False

    @field_validator("layers", mode="before")
    @classmethod
    def _layers_from_env(cls, value: Any) -> Any:
        # Environment values arrive as strings: accept "[1, 5, 9]" and "1,5,9" as lists.
        if isinstance(value, str) and (value.startswith("[") or re.fullmatch(r"\s*-?\d+(\s*,\s*-?\d+)*\s*", value)):
            return json.loads(value if value.startswith("[") else f"[{value}]")
        return value

    @field_validator("layers")
    @classmethod
    def _layer_spec_is_known(cls, value: list[int] | str) -> list[int] | str:
        try:
            parse_layer_spec(value)
        except LayerSpecError as exc:
            raise ValueError(str(exc)) from None
        return value


class ExtractionSettings(_Section):
    devices: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["auto"],
        description="'auto' (every visible GPU, else the CPU), 'cpu', 'cuda', or ids like 'cuda:0'; "
        "shard k runs on devices[k % len(devices)]",
    )
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="auto: bfloat16 on a GPU, float32 on the CPU"
    )
    storage_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3"] = Field(
        "bfloat16",
        description="float8_e4m3: block-scaled fp8, half of bfloat16's bytes (error per token: docs/benchmarks.md)",
    )
    nan_policy: Literal["fail", "quarantine"] = Field(
        "fail",
        description="NaN/Inf in a sample's states: fail the shard naming the samples, or set them aside "
        "in quarantine.jsonl and go on",
    )
    attn_implementation: Literal[
        "auto", "flash_attention_3", "flash_attention_2", "flash_attention_4", "sdpa", "eager"
    ] = Field(
        "auto",
        description="auto: the fastest the model supports on the device (flash-attention when installed on a "
        "GPU, else sdpa, else eager); an explicit value the model cannot use is refused before loading",
    )
    batch_size: int | Literal["auto"] = Field(
        "auto",
        description="Most rows in one forward pass; auto: probed at the start of each shard run together with "
        "max_batch_tokens (a number fixes it)",
    )
    max_batch_tokens: int | Literal["auto"] = Field(
        "auto",
        description="Most computed tokens in one forward pass (rows x longest row, padding included); auto: the "
        "fastest of a few sizes timed on the shard's first batches, re-probed when throughput drops",
    )
    chunk_mb: float = Field(256.0, gt=0, description="Target size of one safetensors chunk file")
    device_wait_s: float = Field(600.0, ge=0, description="How long a shard run waits for a free GPU before failing")
    device_lock_dir: Path = Field(DEFAULT_LOCK_DIR, description="Per-host folder of GPU claims (one run per GPU)")
    on_mismatch: Literal["refuse", "start_over"] = Field(
        "refuse",
        description="A shard folder made with another model, layers, dtype or tokenized input: refuse "
        "to mix, or start_over (delete that shard's states and redo it)",
    )

    @field_validator("batch_size", "max_batch_tokens", mode="before")
    @classmethod
    def _auto_or_positive(cls, value: Any) -> Any:
        # 'auto' or a positive integer; the environment and run config may pass "64" or "AUTO".
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("expected a positive integer or 'auto'")
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _devices_from_env(cls, value: Any) -> Any:
        return list_from_env(value)  # HSX_EXTRACTION__DEVICES=cuda:0,cuda:1

    @field_validator("devices")
    @classmethod
    def _devices_are_known(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("list at least one device")
        for device in value:
            if not re.fullmatch(r"auto|cpu|cuda|cuda:\d+|mps", device):
                raise ValueError(f"{device!r} is not a device; use auto, cpu, cuda or cuda:N")
        return value


class DrafterSettings(_Section):
    val_fraction: float = Field(
        0.02, ge=0.0, lt=1.0, description="Share of samples in the validation split (by sample id)"
    )
    parity_samples: int = Field(8, ge=0, description="Samples the parity check re-extracts one at a time")
    parity_seed: int = Field(0, description="Which samples the parity check picks")


class OperationsSettings(_Section):
    retry_cron: str = Field("*/15 * * * *", description="When retry_failed_shards looks for failed shards")
    max_retries: int = Field(3, ge=0, description="Retries of one shard by the schedule since its last success")
    k8s_run_config: Path | None = Field(
        None, description="YAML of the dagster-k8s/config tag for shard runs (deploy/k8s/shard-run-config.yaml)"
    )

    @field_validator("retry_cron")
    @classmethod
    def _five_cron_fields(cls, value: str) -> str:
        if len(value.split()) != 5 or not re.fullmatch(r"[\d*/,\-A-Za-z\s]+", value):
            raise ValueError("a cron expression has five fields, e.g. '*/15 * * * *'")
        return value


class RegenerateSettings(_Section):
    """`regenerate`: rewrite every assistant turn with the target before tokenisation (optional step)."""

    enabled: bool = Field(
        False, description="Add regenerated_conversations upstream of tokenized_dataset, which then reads its output"
    )
    backend: Literal["local", "openai"] = Field(
        "local", description="local: the target in-process (transformers generate); openai: OpenAI-compatible servers"
    )
    endpoints: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000/v1"],
        description="openai backend: base URLs ending in /v1 (vLLM, SGLang, transformers serve), used together",
    )
    served_model: str | None = Field(
        None,
        description="openai backend: the name the servers serve the target under; default: model.path or its "
        "folder name",
    )
    api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable holding the servers' API key, if any")
    concurrency: int = Field(16, ge=1, le=4096, description="openai backend: requests in flight per endpoint")
    batch_size: int = Field(16, ge=1, description="local backend: conversations per generate() batch")
    turns: Literal["all", "last"] = Field(
        "all", description="all: every assistant turn in order, on the regenerated history; last: the last one only"
    )
    max_tokens: int = Field(2048, ge=1, description="Most generated tokens per assistant turn")
    temperature: float = Field(0.7, ge=0.0, description="Sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling")
    seed: int | None = Field(0, description="Sampling seed (none: unseeded)")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the chat template, e.g. {enable_thinking: true}"
    )
    on_truncated: Literal["keep", "reject"] = Field(
        "keep", description="A response cut by max_tokens: keep it, or reject the conversation (counted either way)"
    )
    request_timeout_s: float = Field(600.0, gt=0, description="openai backend: most seconds for one response")
    connect_timeout_s: float = Field(10.0, gt=0, description="openai backend: most seconds to connect")
    retries: int = Field(3, ge=0, description="openai backend: retries of a failed request (timeouts, 5xx, 429)")
    backoff_s: float = Field(1.0, ge=0, description="openai backend: first retry delay, doubled per retry (max 60 s)")
    chunk_conversations: int = Field(64, ge=1, description="Conversations per committed chunk (what a crash can lose)")
    retry_failed: bool = Field(False, description="Regenerate conversations recorded as failed by an earlier run")

    @field_validator("endpoints", mode="before")
    @classmethod
    def _endpoints_from_env(cls, value: Any) -> Any:
        return list_from_env(value)  # HSX_REGENERATE__ENDPOINTS=http://a:8000/v1,http://b:8000/v1

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_base_urls(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("list at least one endpoint")
        cleaned = []
        for url in value:
            url = url.rstrip("/")
            if not re.fullmatch(r"https?://[^/\s]+(/[^\s]*)?/v1", url):
                raise ValueError(f"{url!r} is not a base URL ending in /v1 (e.g. http://127.0.0.1:8000/v1)")
            if url in cleaned:
                raise ValueError(f"{url!r} is listed twice")
            cleaned.append(url)
        return cleaned


class Settings(BaseSettings):
    """The validated settings. Paths are absolute once loaded through `load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="HSX_", env_nested_delimiter="__", extra="forbid", frozen=True, protected_namespaces=()
    )

    dataset: DatasetSettings
    model: ModelSettings
    shards: int = Field(1, ge=1, le=4096, description="Number of hidden-state partitions (one per GPU run)")
    output_dir: Path = Path("data/out")
    extraction: ExtractionSettings = ExtractionSettings()
    drafter: DrafterSettings = DrafterSettings()
    operations: OperationsSettings = OperationsSettings()
    regenerate: RegenerateSettings = RegenerateSettings()

    # Where the settings came from, for messages and provenance; not a settings key.
    _source: Path | None = None
    _num_model_layers: int | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init kwargs; the environment overrides them.
        return (env_settings, init_settings)

    @property
    def source(self) -> Path | None:
        return self._source

    @property
    def shard_keys(self) -> list[str]:
        return shard_keys(self.shards)

    @property
    def layer_ids(self) -> list[int]:
        """Resolved layer ids (the model's config.json was read when the settings were loaded)."""
        assert self._num_model_layers is not None, "settings were not loaded through load_settings()"
        return resolve_layers(self.model.layers, self._num_model_layers)

    @property
    def num_model_layers(self) -> int:
        assert self._num_model_layers is not None, "settings were not loaded through load_settings()"
        return self._num_model_layers

    @property
    def tokenized_dir(self) -> Path:
        return self.output_dir / "tokenized"

    @property
    def hidden_states_dir(self) -> Path:
        return self.output_dir / "hidden_states"

    @property
    def drafter_dir(self) -> Path:
        return self.output_dir / "drafter"

    @property
    def regenerated_dir(self) -> Path:
        return self.output_dir / "regenerated"

    def shard_index(self, key: str) -> int:
        """Position of a partition key among the shards; a key that is not one of them is a SettingsError."""
        if key not in self.shard_keys:
            check_shard_key(key)
            raise SettingsError(
                f"{self._source or 'settings'}: partition {key!r} is not one of the {self.shards} shards of key "
                "`shards` "
                f"({self.shard_keys[0]} .. {self.shard_keys[-1]})"
            )
        return self.shard_keys.index(key)

    def shard_dir(self, key: str) -> Path:
        """A shard's hidden-state folder; only the settings' own shard keys reach the file system."""
        return self.hidden_states_dir / self.shard_keys[self.shard_index(key)]

    def public_dict(self) -> dict[str, Any]:
        """JSON-ready settings, for metadata and manifests."""
        return json.loads(self.model_dump_json())


def shard_keys(count: int) -> list[str]:
    """`shard-00`, `shard-01`, ...; wider numbers only when there are more than 100 shards."""
    width = max(2, len(str(count - 1)))
    return [f"shard-{index:0{width}d}" for index in range(count)]


def check_shard_key(key: str) -> str:
    """Shard keys name files and folders under output_dir: anything but shard-NN could escape it."""
    if not isinstance(key, str) or not SHARD_KEY.fullmatch(key):
        raise SettingsError(
            f"{key!r} is not a shard key (shard-00, shard-01, ...); shard keys name folders under output_dir"
        )
    return key


def settings_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The settings file to use: the argument, else $HSX_CONFIG, else ./hsx.yaml."""
    chosen = path or os.environ.get(CONFIG_ENV_VAR) or DEFAULT_SETTINGS_FILE
    return Path(chosen).expanduser().resolve()


def load_settings(path: str | os.PathLike[str] | None = None, *, check_files: bool = True) -> Settings:
    """Read, validate and resolve the settings file; raise `SettingsError` naming the key on any problem.

    With ``check_files`` (the default) the input files and the model directory must exist, and the
    layer ids are checked against the model's ``config.json``; no weights are read.
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
                    "k8s_run_config": settings.operations.k8s_run_config
                    and _resolve(base, settings.operations.k8s_run_config)
                }
            ),
        }
    )
    resolved._source = file
    if check_files:
        _check_files(file, resolved)
        resolved._num_model_layers = read_num_layers(resolved.model.path, file)
        try:
            resolve_layers(resolved.model.layers, resolved._num_model_layers)
        except LayerSpecError as exc:
            raise SettingsError(f"{file}: key `model.layers`: {exc}") from None
    return resolved


def read_num_layers(model_path: Path, settings_file: Path | None = None) -> int:
    """Number of decoder layers, read from the model's config.json (no weights, no imports of torch)."""
    try:
        return ModelInfo.read(model_path).num_hidden_layers
    except ModelDirError as exc:
        raise SettingsError(f"{settings_file}: key `model.path`: {exc}" if settings_file else str(exc)) from None


def _check_files(file: Path, settings: Settings) -> None:
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
    k8s = settings.operations.k8s_run_config
    if k8s is not None and not k8s.is_file():
        raise SettingsError(f"{file}: key `operations.k8s_run_config`: file not found: {k8s}")
    model_path = settings.model.path
    if not model_path.is_dir():
        raise SettingsError(f"{file}: key `model.path`: model directory not found: {model_path}")
    try:
        check_model_dir(model_path)
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
            message = "unknown key"
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
