"""The target's tokenizer: loaded from the model directory (a fast tokenizer, since masks are built from its
offsets), and what decides the ids besides the inputs (its provenance), compared with the one an earlier
tokenized dataset was made with."""

from __future__ import annotations

import hashlib
from pathlib import Path

from hsx_dagster.core.inputs.chat_template import TemplateError
from hsx_dagster.core.inputs.tokenized import TokenizedSummary

# Files of a Hugging Face tokenizer that decide how text becomes ids (hashed into the provenance).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def load_tokenizer(model_path: Path, trust_remote_code: bool = False):
    """The target's tokenizer; it must be a fast one, since masks are built from its offsets."""
    from transformers import AutoTokenizer  # heavy import, kept off module import

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "trust_remote_code" in str(exc):
            advice = f"set model.trust_remote_code: true if you trust the code in {model_path}"
        else:
            advice = "the model directory needs the model's tokenizer files (tokenizer.json, tokenizer_config.json)"
        raise TemplateError(f"{model_path}: cannot load the tokenizer ({first_line}); {advice}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError(
            f"{model_path}: the tokenizer is not a fast tokenizer (no tokenizer.json); offsets are needed"
        )
    return tokenizer


def tokenizer_provenance(tokenizer, model_path: Path) -> dict:
    """What decides the ids besides the inputs: the tokenizer's files, the class transformers loaded
    them as (it picks the class from ``model_type``, and two classes may tokenise the same files
    differently) and the library versions."""
    import tokenizers
    import transformers

    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = Path(model_path) / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return {
        "class": type(tokenizer).__name__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "files_sha256": digest.hexdigest(),
    }


def previous_tokenizer(out_dir: Path) -> dict | None:
    """The tokenizer provenance the tokenized dataset in ``out_dir`` records (None: none there, or unreadable)."""
    try:
        return TokenizedSummary.read(out_dir).tokenizer
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None


def tokenizer_change(previous: dict | None, current: dict) -> str:
    """What changed in the tokenizer since the earlier tokenized dataset ('' when nothing or no record)."""
    if not previous:
        return ""
    changes = [
        f"{key} {previous.get(key)!r} -> {current[key]!r}"
        for key in ("class", "files_sha256", "transformers_version", "tokenizers_version")
        if previous.get(key) != current[key]
    ]
    return "; ".join(changes)
