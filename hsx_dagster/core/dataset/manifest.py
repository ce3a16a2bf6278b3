"""The drafter dataset's manifest.json as a typed record: written by the assembly, read by its checks, the
reader and the report.

`Manifest.to_dict` is the file's content, key for key as it has always been; `Manifest.from_dict` reads it
back (keys a manifest of an earlier release lacks read as None). Trainers read the file itself (or
``DrafterDataset.manifest``, the parsed JSON): its layout is documented in docs/data-format.md.
Imports only the standard library and the storage format, so the trainer-side reader stays light.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx_dagster.core.storage.format import (
    DRAFTER_FORMAT,
    DRAFTER_INDEX_FILE,
    DRAFTER_VERSION,
    MANIFEST_FILE,
    check_drafter_manifest,
)
from hsx_dagster.core.storage.provenance import StoredLayers


@dataclass(frozen=True)
class ShardStats:
    """One shard's part of the dataset."""

    shard: str
    samples: int
    tokens: int
    bytes: int
    chunks: int
    quarantined: int

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardStats:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class ManifestLayers:
    ids: tuple[int, ...]
    include_final: bool
    convention: str
    preset: str | None  # eagle3, dflash-K; None for an explicit list of ids
    num_hidden_layers: int | None  # the N the preset was resolved with

    @property
    def stored(self) -> StoredLayers:
        return StoredLayers(tuple(self.ids), self.include_final)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ids": list(self.ids),
            "convention": self.convention,
            "include_final": self.include_final,
            "preset": self.preset,
            "num_hidden_layers": self.num_hidden_layers,
        }


@dataclass(frozen=True)
class Manifest:
    """What the dataset is and how it was made."""

    model: dict[str, Any]  # path, config/weights/tokenizer hashes, library versions, the text model's description
    layers: ManifestLayers
    hidden_size: int
    compute_dtype: str
    storage_dtype: str
    quantization: dict[str, Any] | None  # how to de-quantise fp8 without this package; None otherwise
    samples: int
    tokens: int
    bytes: int
    quarantined_samples: int
    quarantine_file: str
    val_fraction: float
    train_samples: int
    val_samples: int
    shards: tuple[ShardStats, ...]
    settings: dict[str, Any]
    index: str  # the index file, relative to the dataset folder
    chunks_root: str = ".."  # chunk paths in the index are relative to this (from the dataset folder)
    created_at: str = ""
    hsx_version: str = ""
    format: str = DRAFTER_FORMAT
    format_version: int = DRAFTER_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # keys this release does not know

    @property
    def model_path(self) -> Path:
        return Path(self.model["path"])

    @property
    def shard_keys(self) -> list[str]:
        return [stats.shard for stats in self.shards]

    def chunks_dir(self, dataset_dir: Path) -> Path:
        """The folder the index's chunk paths are relative to."""
        return (Path(dataset_dir) / self.chunks_root).resolve()

    def to_dict(self) -> dict[str, Any]:
        """manifest.json's content."""
        return {
            "format": self.format,
            "format_version": self.format_version,
            "created_at": self.created_at,
            "hsx_version": self.hsx_version,
            "model": self.model,
            "layers": self.layers.to_dict(),
            "hidden_size": self.hidden_size,
            "compute_dtype": self.compute_dtype,
            "storage_dtype": self.storage_dtype,
            "quantization": self.quantization,
            "totals": {"samples": self.samples, "tokens": self.tokens, "bytes": self.bytes},
            "quarantined": {"samples": self.quarantined_samples, "file": self.quarantine_file},
            "splits": {"val_fraction": self.val_fraction, "train": self.train_samples, "val": self.val_samples},
            "shards": [dict(vars(stats)) for stats in self.shards],
            "settings": self.settings,
            "index": self.index,
            "chunks_root": self.chunks_root,
            **self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        layers, totals = data["layers"], data["totals"]
        quarantined, splits = data.get("quarantined") or {}, data["splits"]
        known = {
            *("format", "format_version", "created_at", "hsx_version", "model", "layers", "hidden_size"),
            *("compute_dtype", "storage_dtype", "quantization", "totals", "quarantined", "splits", "shards"),
            *("settings", "index", "chunks_root"),
        }
        return cls(
            format=data["format"],
            format_version=data["format_version"],
            created_at=data.get("created_at", ""),
            hsx_version=data.get("hsx_version", ""),
            model=dict(data["model"]),
            layers=ManifestLayers(
                ids=tuple(layers["ids"]),
                include_final=bool(layers["include_final"]),
                convention=layers.get("convention", ""),
                preset=layers.get("preset"),
                num_hidden_layers=layers.get("num_hidden_layers"),
            ),
            hidden_size=int(data["hidden_size"]),
            compute_dtype=data["compute_dtype"],
            storage_dtype=data["storage_dtype"],
            quantization=data.get("quantization"),
            samples=totals["samples"],
            tokens=totals["tokens"],
            bytes=totals["bytes"],
            quarantined_samples=quarantined.get("samples", 0),
            quarantine_file=quarantined.get("file", ""),
            val_fraction=splits["val_fraction"],
            train_samples=splits["train"],
            val_samples=splits["val"],
            shards=tuple(ShardStats.from_dict(entry) for entry in data["shards"]),
            settings=data.get("settings") or {},
            index=data.get("index", DRAFTER_INDEX_FILE),
            chunks_root=data.get("chunks_root", ".."),
            extra={key: value for key, value in data.items() if key not in known},
        )

    @classmethod
    def read(cls, dataset_dir: Path) -> Manifest:
        path = Path(dataset_dir) / MANIFEST_FILE
        return cls.from_dict(check_drafter_manifest(json.loads(path.read_text(encoding="utf-8")), path))
