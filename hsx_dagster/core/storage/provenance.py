"""What a hidden-state shard holds, as one record: `ShardProvenance` (its shard.json) and what follows from it.

Written once by the shard run, compared by the store before a run writes into the folder, checked against
every chunk's header by the integrity checks, compared across shards by the assembly, and read back by the
report. What follows from it lives here too, so the writer, the checks, the assembly and the parity check
agree by construction:

- `StoredLayers`: which states each token keeps (the layer ids, and the final norm's output), the names of
  those slots (``layer {i}``, ``final``) and how many decoder layers a model needs loaded to make them;
- `chunk_header`: the entries of every chunk's safetensors header that say what it holds;
- `ChunkLayout`: the tensors (names, dtypes, shapes) a chunk of so many tokens holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsx_dagster import __version__
from hsx_dagster.core.model.layers import LAYER_CONVENTION
from hsx_dagster.core.storage.atomic import StoreError, write_atomic
from hsx_dagster.core.storage.format import (
    FP8_DTYPE,
    HIDDEN_STATES_FORMAT,
    HIDDEN_STATES_VERSION,
    SAFETENSORS_DTYPE_NAMES,
    SCALES_SUFFIX,
    SHARD_FILE,
    STORAGE_DTYPES,
)
from hsx_dagster.core.storage.quantization import SCALE_DTYPE, block_size_for, scale_layout
from hsx_dagster.core.storage.staging import RowSpec

FINAL_SLOT = "final"


@dataclass(frozen=True)
class StoredLayers:
    """Which states every token keeps: the outputs of the decoder layers ``ids`` (sorted), and with
    ``include_final`` the output of the final norm, stored apart (``final_hidden_states``)."""

    ids: tuple[int, ...]
    include_final: bool

    @property
    def slot_names(self) -> list[str]:
        """One name per stored vector, in storage order: ``layer {i}`` for each id, then ``final``."""
        return [f"layer {i}" for i in self.ids] + ([FINAL_SLOT] if self.include_final else [])

    @property
    def capture_keys(self) -> list[int | str]:
        """What the backbone's hooks capture for them, in storage order: each layer id, then ``final``."""
        return [*self.ids, *([FINAL_SLOT] if self.include_final else [])]

    @property
    def count(self) -> int:
        """Vectors stored per token."""
        return len(self.ids) + int(self.include_final)

    def kept_decoder_layers(self, num_layers: int) -> int:
        """Decoder layers a model of ``num_layers`` must run to produce them: up to the deepest id, or all of
        them when the final norm's output is stored."""
        return num_layers if self.include_final else max(self.ids) + 1


def chunk_header(shard: str, layers: StoredLayers, storage_dtype: str) -> dict[str, str]:
    """The entries of a chunk's safetensors header that say what it holds (the integrity checks compare them)."""
    return {
        "format": HIDDEN_STATES_FORMAT,
        "shard": shard,
        "layer_ids": json.dumps(list(layers.ids)),
        "include_final": json.dumps(layers.include_final),
        "storage_dtype": storage_dtype,
    }


@dataclass(frozen=True)
class ChunkLayout:
    """What every chunk of a shard must hold: the stored layers, their width and dtype."""

    layers: StoredLayers
    hidden_size: int
    storage_dtype: str

    def expected_tensors(self, tokens: int) -> dict[str, tuple[str, list[int]]]:
        """Name -> (safetensors dtype, shape) of every state tensor (and fp8 scales) a chunk of ``tokens`` holds."""
        dtype = STORAGE_DTYPES[self.storage_dtype]
        name = SAFETENSORS_DTYPE_NAMES[dtype]
        expected = {"hidden_states": (name, [tokens, len(self.layers.ids), self.hidden_size])}
        if self.layers.include_final:
            expected["final_hidden_states"] = (name, [tokens, self.hidden_size])
        if dtype == FP8_DTYPE:
            columns = self.hidden_size // block_size_for(self.hidden_size)
            for tensor, (_, shape) in list(expected.items()):
                expected[tensor + SCALES_SUFFIX] = (SAFETENSORS_DTYPE_NAMES[SCALE_DTYPE], [*shape[:-1], columns])
        return expected

    def row_specs(self) -> dict[str, RowSpec]:
        """Per token, the shape and dtype of every token-major tensor a chunk holds (the rows the writer stages)."""
        dtype = STORAGE_DTYPES[self.storage_dtype]
        layers, hidden = len(self.layers.ids), self.hidden_size
        specs = {
            "input_ids": RowSpec((), torch.int32),
            "loss_mask": RowSpec((), torch.uint8),
            "hidden_states": RowSpec((layers, hidden), dtype),
        }
        if self.layers.include_final:
            specs["final_hidden_states"] = RowSpec((hidden,), dtype)
        if dtype == FP8_DTYPE:
            columns = hidden // block_size_for(hidden)
            specs["hidden_states" + SCALES_SUFFIX] = RowSpec((layers, columns), SCALE_DTYPE)
            if self.layers.include_final:
                specs["final_hidden_states" + SCALES_SUFFIX] = RowSpec((columns,), SCALE_DTYPE)
        return specs


# Keys that describe the shard without defining its content (the model's description is derived from its
# config, whose hash is compared; a preset resolves to the layer ids, which are compared; the tokenized samples
# change as the inputs grow or shrink, and each committed sample's tokens are compared on their own by the shard
# run, shard_membership.py): a change is recorded in shard.json, never refused.
DESCRIPTIVE_KEYS = frozenset({"layer_preset", "model", "tokenized_sha256"})
# Keys every shard of one dataset shares (the assembly refuses shards that differ in one).
DATASET_KEYS = ("config_sha256", "weights_index_sha256", "layer_ids", "include_final", "storage_dtype", "compute_dtype")
# What a changed key means, for the message that refuses to mix.
MEANING = {
    "tokenized_sha256": "the shard's tokenized samples changed: re-tokenized with other inputs, dataset settings "
    "or shard count",
    "config_sha256": "the model's config.json changed",
    "weights_index_sha256": "the model's weights changed",
    "model_path": "model.path",
    "layer_ids": "model.layers",
    "include_final": "model.include_final",
    "storage_dtype": "extraction.storage_dtype",
    "compute_dtype": "extraction.compute_dtype, or another kind of device",
}


@dataclass(frozen=True)
class ShardProvenance:
    """What a shard's states were made from and how: its shard.json."""

    shard: str
    model_path: str
    config_sha256: str
    weights_index_sha256: str
    layer_ids: tuple[int, ...]
    include_final: bool
    storage_dtype: str
    compute_dtype: str
    tokenized_sha256: str  # the shard's tokenized samples (ids, tokens, masks) at its last run (descriptive)
    layer_preset: str | None = None  # eagle3, dflash-K; None for an explicit list (or a shard written before)
    model: dict[str, Any] | None = None  # the text model's description (ModelInfo.describe()); None before
    format: str = HIDDEN_STATES_FORMAT
    format_version: int = HIDDEN_STATES_VERSION
    layer_convention: str = LAYER_CONVENTION

    @property
    def layers(self) -> StoredLayers:
        return StoredLayers(tuple(self.layer_ids), self.include_final)

    @property
    def hidden_size(self) -> int | None:
        """The text model's width as recorded (None for shards written before the description was)."""
        size = (self.model or {}).get("hidden_size")
        return int(size) if isinstance(size, int) else None

    def chunk_header(self) -> dict[str, str]:
        return chunk_header(self.shard, self.layers, self.storage_dtype)

    def chunk_metadata(self, hidden_size: int) -> dict[str, str]:
        """Everything the writer puts in a chunk's header: what it holds, the versions, the fp8 scale layout."""
        metadata = {**self.chunk_header(), "format_version": str(self.format_version), "hsx_version": __version__}
        if STORAGE_DTYPES[self.storage_dtype] == FP8_DTYPE:
            metadata["quantization"] = json.dumps(scale_layout(hidden_size))
        return metadata

    def layout(self, hidden_size: int) -> ChunkLayout:
        return ChunkLayout(self.layers, hidden_size, self.storage_dtype)

    def to_dict(self) -> dict[str, Any]:
        """shard.json's content (JSON-ready)."""
        return {
            "format": self.format,
            "format_version": self.format_version,
            "shard": self.shard,
            "model_path": self.model_path,
            "config_sha256": self.config_sha256,
            "weights_index_sha256": self.weights_index_sha256,
            "layer_ids": list(self.layer_ids),
            "layer_convention": self.layer_convention,
            "layer_preset": self.layer_preset,
            "model": self.model,
            "include_final": self.include_final,
            "storage_dtype": self.storage_dtype,
            "compute_dtype": self.compute_dtype,
            "tokenized_sha256": self.tokenized_sha256,
        }

    def changes_from(self, recorded: dict[str, Any]) -> tuple[list[str], list[str]]:
        """Keys whose value differs from ``recorded`` (another shard.json's content): (those that define the
        states, those that only describe them)."""
        current = self.to_dict()
        differing = {key for key in set(recorded) | set(current) if recorded.get(key) != current.get(key)}
        return sorted(differing - DESCRIPTIVE_KEYS), sorted(differing & DESCRIPTIVE_KEYS)

    def differs_for_a_dataset(self, other: ShardProvenance) -> list[str]:
        """The keys every shard of one dataset must share, where ``other`` differs."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [key for key in DATASET_KEYS if mine[key] != theirs[key]]

    @classmethod
    def from_dict(cls, data: Any, source: Path) -> ShardProvenance:
        """The record in ``data`` (a parsed shard.json, ``source`` named in errors)."""
        if not isinstance(data, dict) or data.get("format") != HIDDEN_STATES_FORMAT:
            raise StoreError(f"{source}: not the provenance of an hsx hidden-states shard")
        try:
            return cls(
                shard=str(data["shard"]),
                model_path=str(data["model_path"]),
                config_sha256=data["config_sha256"],
                weights_index_sha256=data["weights_index_sha256"],
                layer_ids=tuple(int(i) for i in data["layer_ids"]),
                include_final=bool(data["include_final"]),
                storage_dtype=data["storage_dtype"],
                compute_dtype=data["compute_dtype"],
                tokenized_sha256=data["tokenized_sha256"],
                layer_preset=data.get("layer_preset"),
                model=data.get("model") if isinstance(data.get("model"), dict) else None,
                format_version=int(data.get("format_version", HIDDEN_STATES_VERSION)),
                layer_convention=data.get("layer_convention", LAYER_CONVENTION),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{source}: shard provenance without a usable {exc}") from None

    @classmethod
    def read(cls, shard_dir: Path) -> ShardProvenance:
        path = Path(shard_dir) / SHARD_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StoreError(f"{path} not found: the shard was never extracted") from None
        except json.JSONDecodeError as exc:
            raise StoreError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, path)

    def write(self, shard_dir: Path) -> None:
        write_atomic(Path(shard_dir) / SHARD_FILE, json.dumps(self.to_dict(), indent=2, sort_keys=True).encode())
