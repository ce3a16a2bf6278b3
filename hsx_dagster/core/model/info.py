"""What the pipeline knows about a target model before any weight loads, read from its directory once.

Everything here comes from ``config.json`` and the weight files' names (the index of a sharded
checkpoint, or the JSON headers of the safetensors files); nothing imports torch or transformers, so
settings validation, size estimates and provenance stay cheap. Multimodal wrappers (Qwen3.5/3.6,
Gemma 3, ...) keep the language model's shape under ``text_config``; that is the shape reported.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
INDEX_PATTERN = "*.index.json"
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


class ModelDirError(ValueError):
    """The directory is not a usable Hugging Face model; the message says what is missing."""


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    config: dict[str, Any]  # the whole config.json
    model_type: str
    architectures: tuple[str, ...]
    num_hidden_layers: int  # decoder layers of the text model
    hidden_size: int | None  # of the text model (None when config.json does not say)

    @classmethod
    def read(cls, model_path: Path | str) -> ModelInfo:
        path = Path(model_path)
        config_file = path / "config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelDirError(f"{path} has no config.json (not a Hugging Face model directory)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelDirError(f"{config_file} is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ModelDirError(f"{config_file} is not a JSON object")
        text = text_config_of(config)
        layers = next((c[k] for c in (text, config) for k in _LAYER_COUNT_KEYS if isinstance(c.get(k), int)), None)
        if layers is None:
            raise ModelDirError(f"{config_file} does not say how many layers the model has (num_hidden_layers)")
        hidden = next((c["hidden_size"] for c in (text, config) if isinstance(c.get("hidden_size"), int)), None)
        return cls(
            path=path,
            config=config,
            model_type=str(config.get("model_type", "")),
            architectures=tuple(config.get("architectures") or ()),
            num_hidden_layers=layers,
            hidden_size=hidden,
        )

    def require_hidden_size(self) -> int:
        if self.hidden_size is None:
            raise ModelDirError(f"{self.path / 'config.json'} does not say the model's hidden_size")
        return self.hidden_size

    @property
    def text_model_type(self) -> str:
        return str(text_config_of(self.config).get("model_type", self.model_type))

    @property
    def architecture(self) -> str:
        """The release's architecture (``architectures[0]``, e.g. Qwen3_5ForConditionalGeneration), else the
        model type."""
        return self.architectures[0] if self.architectures else self.model_type

    def fingerprint(self) -> dict[str, str]:
        """Hashes of what defines the model: its config (as read, without the transformers version that saved
        it) and its weights index (or the weight files' names and sizes)."""
        config = {key: value for key, value in self.config.items() if key != "transformers_version"}
        config_hash = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        index_files = sorted(self.path.glob(INDEX_PATTERN))
        if index_files:
            weights = b"".join(path.read_bytes() for path in index_files)
        else:
            weights = json.dumps(sorted((p.name, p.stat().st_size) for p in weight_files(self.path))).encode()
        return {"config_sha256": config_hash, "weights_index_sha256": hashlib.sha256(weights).hexdigest()}

    def describe(self) -> dict[str, Any]:
        """JSON-ready description for manifests, shard provenance and metadata: the text model's layer count
        and width, and what the release is."""
        return {
            "architecture": self.architecture,
            "architectures": list(self.architectures),
            "model_type": self.model_type,
            "text_model_type": self.text_model_type,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
        }


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def weight_files(model_path: Path) -> list[Path]:
    return sorted(p for pattern in WEIGHT_PATTERNS for p in Path(model_path).glob(pattern))


def missing_weight_files(model_path: Path) -> list[str]:
    """Weight files a sharded checkpoint's index names but the directory lacks (read from JSON only)."""
    missing: set[str] = set()
    for index_file in sorted(Path(model_path).glob(INDEX_PATTERN)):
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8")).get("weight_map") or {}
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            missing.add(f"{index_file.name} (not valid JSON)")
            continue
        missing.update(name for name in set(weight_map.values()) if not (Path(model_path) / name).is_file())
    return sorted(missing)


def weight_names(model_path: Path) -> list[str]:
    """Every weight's name in the checkpoint, from its index or the safetensors headers (no tensor is read);
    empty for pickled ``*.bin`` checkpoints without an index, whose names cannot be read without torch."""
    model_path = Path(model_path)
    names: set[str] = set()
    index_files = sorted(model_path.glob(INDEX_PATTERN))
    for index_file in index_files:
        try:
            names.update((json.loads(index_file.read_text(encoding="utf-8")).get("weight_map") or {}).keys())
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            continue
    if not index_files:
        for path in sorted(model_path.glob("*.safetensors")):
            names.update(_safetensors_names(path))
    return sorted(names)


def _safetensors_names(path: Path) -> list[str]:
    with open(path, "rb") as handle:
        header_size = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(header_size))
    return [name for name in header if name != "__metadata__"]


def text_weights_prefix(names: Iterable[str]) -> str | None:
    """The prefix under which the checkpoint keeps its text decoder (``""``, ``model.``,
    ``model.language_model.``, ``language_model.model.``, ...): the one holding both ``embed_tokens``
    and ``layers.0``; None when the names do not say (no such pair, or several)."""
    names = set(names)
    found = {
        name[: -len("embed_tokens.weight")]
        for name in names
        if name.endswith("embed_tokens.weight")
        and any(other.startswith(name[: -len("embed_tokens.weight")] + "layers.0.") for other in names)
    }
    return found.pop() if len(found) == 1 else None


def check_model_dir(model_path: Path) -> ModelInfo:
    """A config, weights, and every weight file its index names: checked before anything heavy happens."""
    info = ModelInfo.read(model_path)
    if not weight_files(model_path):
        patterns = " or ".join(WEIGHT_PATTERNS)
        raise ModelDirError(f"{model_path} holds no weights ({patterns})")
    missing = missing_weight_files(model_path)
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise ModelDirError(
            f"{model_path} lacks weight files its index names: {', '.join(missing[:5])}{more}; "
            "finish downloading the model"
        )
    return info
