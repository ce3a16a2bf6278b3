"""Content fingerprints of the pipeline's inputs, and the versions of what shapes its outputs.

The orchestrator observes the inputs (the conversation files, the model directory) by these
fingerprints and compares them with the ones each output was made from, so it can tell which
outputs are stale. Files are identified by content: a streaming sha256, cached by path, size and
modification time, so an unchanged file is not read again. The model by what defines it: its
``config.json`` and its weight index (`ModelInfo.fingerprint`).

`code_versions` folds the settings that change what each step writes into the version of the
code that writes it: editing ``model.layers`` or ``extraction.storage_dtype`` makes the hidden
states out of date, exactly like a new format version would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hsx_dagster.core.model.info import ModelInfo
from hsx_dagster.core.settings import Settings
from hsx_dagster.core.storage.files import file_sha256
from hsx_dagster.core.storage.format import DRAFTER_VERSION, HIDDEN_STATES_VERSION, TOKENIZED_VERSION

CACHE_FILE = "input_fingerprints.json"


@dataclass(frozen=True)
class FileFingerprint:
    path: str
    bytes: int
    mtime_ns: int
    sha256: str


def fingerprint_files(paths: Sequence[Path], cache_file: Path | None = None) -> list[FileFingerprint]:
    """Size, modification time and content hash of each file; a file whose path, size and mtime are in
    ``cache_file`` is not read again. A missing file raises FileNotFoundError naming it."""
    cached: dict[str, dict] = {}
    if cache_file is not None and cache_file.is_file():
        with contextlib.suppress(ValueError, OSError):
            cached = json.loads(cache_file.read_text(encoding="utf-8"))
    prints = []
    for path in paths:
        resolved = Path(path).resolve()
        stat = resolved.stat()
        entry = cached.get(str(resolved))
        if entry and entry.get("bytes") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
            digest = entry["sha256"]
        else:
            digest = file_sha256(resolved)
        prints.append(FileFingerprint(str(resolved), stat.st_size, stat.st_mtime_ns, digest))
    if cache_file is not None:
        with contextlib.suppress(OSError):  # a read-only output folder only costs a re-hash next time
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            temporary = cache_file.with_name(f".{cache_file.name}.tmp-{os.getpid()}")
            temporary.write_text(json.dumps({**cached, **{p.path: asdict(p) for p in prints}}, indent=1))
            os.replace(temporary, cache_file)
    return prints


def files_version(prints: Sequence[FileFingerprint]) -> str:
    """One version for a set of files: their paths and contents (not their modification times)."""
    return _short({p.path: p.sha256 for p in prints})


def model_version(model: ModelInfo) -> tuple[str, dict[str, str]]:
    """The model directory's version (its config and weight index) and the two hashes it is made of."""
    prints = model.fingerprint()
    return _short(prints), prints


def code_versions(settings: Settings) -> dict[str, str]:
    """Per asset, the format version of the code that writes it and a digest of the settings that shape it."""
    dataset = settings.dataset
    extraction = settings.extraction
    tokenized = {
        "max_length": dataset.max_length,
        "min_loss_tokens": dataset.min_loss_tokens,
        "thinking": dataset.thinking,
        "loss_mask": dataset.loss_mask,
        "shards": settings.shards,
    }
    hidden = {
        "layer_ids": settings.layer_ids,
        "include_final": settings.model.include_final,
        "storage_dtype": extraction.storage_dtype,
        "compute_dtype": extraction.compute_dtype,
    }
    # Each version folds in the one before it: a change that makes the shards out of date makes the dataset
    # assembled from them out of date too (Dagster's staleness looks one hop upstream).
    versions = {"tokenized_dataset": f"v{TOKENIZED_VERSION}-{_short(tokenized)}"}
    versions["hidden_states"] = f"v{HIDDEN_STATES_VERSION}-{_short([hidden, versions['tokenized_dataset']])}"
    drafter = {"val_fraction": settings.drafter.val_fraction}
    versions["drafter_dataset"] = f"v{DRAFTER_VERSION}-{_short([drafter, versions['hidden_states']])}"
    export = settings.export
    speculators = {"files": export.speculators_files}
    versions["speculators_dataset"] = f"v1-{_short([speculators, versions['drafter_dataset']])}"
    versions["specforge_dataset"] = f"v1-{_short([export.specforge_layout, versions['drafter_dataset']])}"
    return versions


def _short(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
