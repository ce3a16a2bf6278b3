"""One settings file for the whole pipeline, validated before any expensive work.

`hsx.yaml` at the repository root is the default; `HSX_CONFIG` names another file. Any key can be overridden from
the environment as ``HSX_<SECTION>__<KEY>`` (e.g. ``HSX_EXTRACTION__BATCH_SIZE=64``); the environment wins over the
file. Relative paths resolve against the settings file's folder, so a settings file can be moved with its data.

Every setting is declared once, here: its type (choices from `core/settings/choices.py`), default and description.
The core takes these sections as they are (no copy of a field with its own default), the Dagster layer generates its
run config from them (`hsx_dagster.defs.resources`), and the reference table of docs/configuration.md is generated from
the descriptions (`hsx_dagster.core.settings.reference`).

Every error names the file, the key and the bad value (``SettingsError``), and is raised before model weights are
touched: the model directory is checked from its ``config.json`` alone (`load_settings`, in
`hsx_dagster.core.settings.loading`, which reads it once and keeps it as `model_info`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from hsx_dagster.core.model.info import ModelInfo
from hsx_dagster.core.model.layers import LayerSpecError, parse_layer_spec, resolve_layers
from hsx_dagster.core.settings.choices import (
    AUTO,
    AttnImplementation,
    ComputeDtype,
    DirectIo,
    LossMask,
    NanPolicy,
    OnMismatch,
    OnTruncated,
    RegenerateBackend,
    RegenerateTurns,
    StorageDtype,
    Thinking,
    list_from_env,
    parse_auto_or_positive,
)
from hsx_dagster.core.settings.errors import SettingsError
from hsx_dagster.core.shard_keys import check_shard_key, shard_keys

DEFAULT_LOCK_DIR = Path("/tmp/hsx-dagster-device-locks")  # per host, like the GPUs (and the cores) it guards


def _auto_or_positive(value: Any) -> Any:
    if value is None:
        raise ValueError("expected a positive integer or 'auto'")
    number = parse_auto_or_positive(value)
    return AUTO if number is None else number


AutoOrPositive = Annotated[int | Literal["auto"], BeforeValidator(_auto_or_positive)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatasetSettings(_Section):
    paths: list[Path] = Field(
        min_length=1, description="Conversation files; format detected per file, ShareGPT/OpenAI per record"
    )
    max_length: int = Field(
        4096, ge=16, description="Samples are truncated to this many tokens (the loss mask with them)"
    )
    min_loss_tokens: int = Field(
        1, ge=1, description="Samples with fewer supervised tokens are rejected (`too_few_loss_tokens`)"
    )
    thinking: Thinking = Field(
        "keep",
        description="Reasoning (`reasoning_content` or inline `<think>`): `keep` as the chat template renders it "
        "(supervised), `strip` it from every assistant turn, or `exclude_from_loss` (rendered, masked out)",
    )
    loss_mask: LossMask = Field(
        "assistant",
        description="The tokens the drafter learns to predict: `assistant` (assistant turns and their end; `thinking` "
        "decides for their reasoning) or `all` (every token: system, user and tool turns, the template's markup)",
    )
    tokenize_workers: AutoOrPositive = Field(
        "auto",
        description="Processes that parse, render and tokenise conversations, one core each: `auto` = every core, "
        "but no more than one per 256 KB of input (on a small input starting a worker costs more than it saves), "
        "`1` = in the main process on one core (the fast tokenizer's own thread pool is off in every "
        "worker, so the count bounds the cores tokenisation takes beside extraction); the output (order, sample "
        "ids, Parquet bytes) is the same whatever the count",
    )


class ModelSettings(_Section):
    path: Path = Field(description="Local Hugging Face model directory (config, tokenizer, weights)")
    layers: list[int] | str = Field(
        "eagle3",
        description="List of layer ids, `eagle3` = [1, N//2-1, N-4], `dflash-K` = K ids evenly over [1, N-3], or "
        "`speculators` = [1, N//2-1, N-4, N-1] (what speculators' own data generation captures, last slot included)",
    )
    include_final: bool = Field(False, description="Also store the final-norm output (what the LM head reads)")
    trust_remote_code: bool = Field(False, description="Allow the model directory's own code")

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

    @property
    def layer_preset(self) -> str | None:
        """The preset the layer ids are resolved from (``eagle3``, ``dflash-K``); None for an explicit list."""
        return self.layers if isinstance(self.layers, str) else None


class ExtractionSettings(_Section):
    devices: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["auto"],
        description="`auto` (every visible GPU, else the CPU), `cpu`, `cuda`, `cuda:N`, `mps` (Apple GPUs, shared "
        "like the CPU); shard k runs on devices[k % len(devices)]",
    )
    compute_dtype: ComputeDtype = Field(
        "auto", description="`auto` = bfloat16 on a GPU, float32 on the CPU; or bfloat16, float16, float32"
    )
    storage_dtype: StorageDtype = Field(
        "bfloat16",
        description="Dtype of the stored states: bfloat16, float16, float32, float8_e4m3 (block-scaled fp8, half "
        "of bfloat16's bytes; its error per token: docs/benchmarks.md)",
    )
    nan_policy: NanPolicy = Field(
        "fail",
        description="NaN/Inf in a sample's states: `fail` the shard naming the samples, or `quarantine` them "
        "(set aside in quarantine.jsonl with the reason) and go on",
    )
    attn_implementation: Literal["auto"] | AttnImplementation = Field(
        "auto",
        description="`auto` = the fastest the model supports on the device, chosen before the weights load "
        "(flash-attention when installed on a GPU, else sdpa, else eager; the choice is in the `hidden_states` "
        "metadata); or `flash_attention_3`, `flash_attention_2`, `flash_attention_4`, `sdpa`, `eager`: one the "
        "model cannot use is refused before loading, naming the values that work",
    )
    batch_size: AutoOrPositive = Field(
        "auto",
        description="Most rows in one forward pass; `auto`: probed at the start of each shard run together with "
        "`max_batch_tokens`; a number fixes it",
    )
    max_batch_tokens: AutoOrPositive = Field(
        "auto",
        description="Most computed tokens (rows x longest row, padding included) in one forward pass; `auto`: the "
        "fastest of a few budgets timed on each shard's first batches, re-probed when throughput drops; a number "
        "fixes it",
    )
    chunk_mb: float = Field(256.0, gt=0, description="Most MiB in one chunk file (whole batches; a larger one is cut)")
    direct_io: DirectIo = Field(
        "auto",
        description="Chunk files written with O_DIRECT from the staging memory, past the page cache: `auto` on ext4 "
        "and xfs, `on` everywhere (buffered where the file system refuses it), `off` never; the choice is in the "
        "`hidden_states` metadata",
    )
    host_threads: AutoOrPositive = Field(
        "auto", description="PyTorch's threads per shard run: `auto` = its share of the cores of a shared host"
    )
    device_wait_s: float = Field(600.0, ge=0, description="How long a shard run waits for a free GPU before failing")
    device_lock_dir: Path = Field(DEFAULT_LOCK_DIR, description="Folder of GPU claims, keyed by GPU UUID; needs flock")
    device_claim: Literal["lock", "scheduler"] = Field(
        "lock",
        description="`lock`: claim the GPU with a lock in device_lock_dir, keyed by its UUID (works under any "
        "scheduler); `scheduler`: no lock, the scheduler that set CUDA_VISIBLE_DEVICES (Ray, Kubernetes, Slurm) keeps "
        "runs apart (docs/cluster.md)",
    )
    on_mismatch: OnMismatch = Field(
        "refuse",
        description="A shard folder made with another model, layers, dtype or tokenized input: `refuse` to mix, "
        "or `start_over` (delete that shard's states, logged, and redo it)",
    )

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

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * 2**20)


class DrafterSettings(_Section):
    val_fraction: float = Field(
        0.02, ge=0.0, lt=1.0, description="Share of samples in the validation split (decided by sample id)"
    )
    parity_samples: int = Field(
        8,
        ge=0,
        description="Samples the parity check re-extracts one at a time (0: the check passes as skipped, claims "
        "no device and loads no model)",
    )
    parity_seed: int = Field(0, description="Which samples the parity check picks")


class OperationsSettings(_Section):
    retry_every_s: float = Field(
        900.0,
        ge=30,
        description="How often the sensor `retry_failed_shards` looks for failed shards (each tick's retries: one "
        "backfill)",
    )
    max_retries: int = Field(
        3, ge=0, description="Retries of one shard by `retry_failed_shards` since its last success"
    )
    progress_every_s: float = Field(
        60.0, gt=0, description="How often a running shard reports its progress to its asset page and run log"
    )
    k8s_run_config: Path | None = Field(
        None,
        description="YAML of the `dagster-k8s/config` tag for shard runs on Kubernetes "
        "(deploy/k8s/shard-run-config.yaml)",
    )
    ray_run_config: Path | None = Field(
        None,
        description="YAML of the `dagster-ray/config` tag for shard runs on a Ray cluster: one GPU each "
        "(deploy/ray/shard-run-config.yaml); drafter_dataset runs get it too while its parity check loads the model",
    )


class RegenerateSettings(_Section):
    """`regenerate`: rewrite every assistant turn with the target before tokenisation (optional step)."""

    enabled: bool = Field(
        False,
        description="Add `regenerated_conversations` upstream of `tokenized_dataset`, which then reads "
        "`output_dir/regenerated/conversations.jsonl` instead of `dataset.paths`",
    )
    backend: RegenerateBackend = Field(
        "local",
        description="`local`: the target in-process (transformers `generate`, on the `gpu` resource's device); "
        "`openai`: OpenAI-compatible servers (vLLM, SGLang, `transformers serve`)",
    )
    endpoints: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000/v1"],
        description="openai: base URLs ending in /v1, used together; `HSX_REGENERATE__ENDPOINTS=url1,url2`",
    )
    served_model: str | None = Field(
        None,
        description="openai: the name the servers serve the target under; default: `model.path` or its folder name",
    )
    api_key_env: str = Field(
        "OPENAI_API_KEY", description="Environment variable holding the servers' API key, sent when set"
    )
    concurrency: int = Field(16, ge=1, le=4096, description="openai: requests in flight per endpoint")
    batch_size: int = Field(16, ge=1, description="local: conversations per `generate` batch")
    turns: RegenerateTurns = Field(
        "all", description="`all`: every assistant turn in order, on the regenerated history; `last`: the last one only"
    )
    max_tokens: int = Field(2048, ge=1, description="Most generated tokens per assistant turn")
    temperature: float = Field(0.7, ge=0.0, description="Sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling")
    seed: int | None = Field(0, description="Sampling seed (`null`: unseeded)")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the chat template, e.g. `{enable_thinking: true}`"
    )
    on_truncated: OnTruncated = Field(
        "keep",
        description="A response cut by `max_tokens`: `keep` it, or `reject` the conversation (counted either way)",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="openai: most seconds for one response")
    connect_timeout_s: float = Field(10.0, gt=0, description="openai: most seconds to connect")
    retries: int = Field(
        3, ge=0, description="openai: retries of a request that timed out or got 5xx/429, with backoff"
    )
    backoff_s: float = Field(1.0, ge=0, description="openai: first retry delay, doubled per retry (at most 60 s)")
    chunk_conversations: int = Field(64, ge=1, description="Conversations per committed part (what a crash can lose)")
    retry_failed: bool = Field(False, description="Regenerate conversations an earlier run recorded as failed")

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


class ExportSettings(_Section):
    """`export`: folders the drafter trainers take as their data path (docs/trainers-speculators.md, -specforge.md)."""

    speculators: bool = Field(
        False,
        description="Materialize `speculators_dataset` (`output_dir/speculators/`) with the pipeline; selecting the "
        "asset builds it either way",
    )
    speculators_files: bool = Field(
        False,
        description="Also write speculators' plain `file` layout (`hidden_states/hs_<row>.safetensors`, a copy of "
        "every state); without it the states are served from our chunks by the `hsx` hidden-states backend",
    )
    specforge: bool = Field(
        False,
        description="Materialize `specforge_dataset` (`output_dir/specforge/`, SpecForge's offline `.ckpt` files: "
        "a copy of the states, the one pickle-based container written, tensors only) with the pipeline",
    )
    specforge_layout: Literal["eagle3", "dflash"] = Field(
        "eagle3",
        description="SpecForge layout: `eagle3` (`aux_hidden_state` = 3 stored layers, `hidden_state` = the final "
        "norm's output, needs `model.include_final`) or `dflash` (`hidden_states` = every stored layer, whose ids "
        "are the draft config's `target_layer_ids`)",
    )


class Settings(BaseSettings):
    """The validated settings. Paths are absolute once loaded through `load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="HSX_", env_nested_delimiter="__", extra="forbid", frozen=True, protected_namespaces=()
    )

    dataset: DatasetSettings
    model: ModelSettings
    shards: int = Field(
        1, ge=1, le=4096, description="Number of `hidden_states` partitions (`shard-00`, ...), one run per GPU"
    )
    output_dir: Path = Field(
        Path("data/out"),
        description="All outputs: `tokenized/`, `hidden_states/<shard>/`, `drafter/` (and `speculators/`, "
        "`specforge/` when exported)",
    )
    extraction: ExtractionSettings = ExtractionSettings()
    drafter: DrafterSettings = DrafterSettings()
    operations: OperationsSettings = OperationsSettings()
    regenerate: RegenerateSettings = RegenerateSettings()
    export: ExportSettings = ExportSettings()

    # Where the settings came from and what the model's config.json says (read once, by load_settings): not keys.
    _source: Path | None = None
    _model_info: ModelInfo | None = None

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

    def mark_loaded(self, source: Path, model_info: ModelInfo | None) -> None:
        """Record the file the settings came from and the model's config as read (`load_settings` calls this)."""
        self._source = source
        self._model_info = model_info

    @property
    def source(self) -> Path | None:
        return self._source

    @property
    def model_info(self) -> ModelInfo:
        """The model's config.json as read when the settings were loaded: layer count, width, architecture."""
        assert self._model_info is not None, "settings were not loaded through load_settings()"
        return self._model_info

    @property
    def shard_keys(self) -> list[str]:
        return shard_keys(self.shards)

    @property
    def layer_ids(self) -> list[int]:
        """Resolved layer ids (the model's config.json was read when the settings were loaded)."""
        return resolve_layers(self.model.layers, self.num_model_layers)

    @property
    def num_model_layers(self) -> int:
        return self.model_info.num_hidden_layers

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

    @property
    def speculators_dir(self) -> Path:
        return self.output_dir / "speculators"

    @property
    def specforge_dir(self) -> Path:
        return self.output_dir / "specforge"

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
        return json.loads(self.model_dump_json())  # JSON-ready settings, for metadata and manifests
