"""Tiny random-weight target models in Hugging Face layout.

The pipeline only needs a target whose *architecture* matches the real thing:
hidden-state extraction cares about layer types, cache/state handling and
tokenizer/template plumbing, not about what the weights know.  So we build
configs with real model types (Qwen3.5 hybrid Gated DeltaNet + full attention,
dense Llama, dense Qwen3) at toy sizes, initialise them from a fixed seed and
``save_pretrained`` them next to the demo tokenizer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hsx_dagster.demo.tokenizer import save_tokenizer

ARCHITECTURES = ("qwen3_5", "llama", "qwen3")
FULL_ATTENTION_INTERVAL = 4  # Qwen3.5: three Gated DeltaNet layers, then one full-attention layer
MAX_POSITIONS = 8192
_NUM_HEADS = 4
_NUM_KV_HEADS = 2
_LINEAR_KEY_HEADS = 2
_LINEAR_VALUE_HEADS = 4
_LINEAR_HEAD_DIM = 16
# Qwen models decouple head_dim from hidden_size / num_heads; 32 keeps a few rotary
# dims even though Qwen3.5 rotates only a quarter of each head (32 * 0.25 = 8 dims,
# i.e. 4 frequencies, which the text/height/width mrope sections must add up to).
_QWEN_HEAD_DIM = 32
_QWEN3_5_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}


def qwen3_5_layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's repeating pattern, with the last layer forced to full attention so
    even a 2-layer model has both kinds."""
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 or i == num_layers - 1 else "linear_attention"
        for i in range(num_layers)
    ]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def make_config(
    arch: str,
    *,
    vocab_size: int,
    num_layers: int,
    hidden_size: int,
    eos_token_id: int | None,
    pad_token_id: int | None,
    bos_token_id: int | None,
) -> PreTrainedConfig:
    """A small config of the given architecture (see ``ARCHITECTURES``).

    ``initializer_range`` scales with ``1/sqrt(hidden_size)``: the library default
    (0.02) is tuned for 4k-wide models, and at width 64 it would leave every
    layer's output a small perturbation of the embeddings, making the hidden
    states of different layers nearly identical, which is useless for a drafter demo.
    """
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=_NUM_HEADS,
        num_key_value_heads=_NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.5 / math.sqrt(hidden_size),
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        dtype="float32",
    )
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(
            **common,
            head_dim=_QWEN_HEAD_DIM,
            layer_types=qwen3_5_layer_types(num_layers),
            linear_num_key_heads=_LINEAR_KEY_HEADS,
            linear_num_value_heads=_LINEAR_VALUE_HEADS,
            linear_key_head_dim=_LINEAR_HEAD_DIM,
            linear_value_head_dim=_LINEAR_HEAD_DIM,
            linear_conv_kernel_dim=4,
            rope_parameters=dict(_QWEN3_5_ROPE),
        )
    if arch == "llama":
        return LlamaConfig(
            **common,
            head_dim=hidden_size // _NUM_HEADS,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        )
    if arch == "qwen3":
        return Qwen3Config(
            **common, head_dim=_QWEN_HEAD_DIM, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}
        )
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")


_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "qwen3_5": Qwen3_5ForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    tokenizer_dir_or_obj: str | os.PathLike[str] | PreTrainedTokenizerBase,
    arch: str = "qwen3_5",
    num_layers: int = 8,
    hidden_size: int = 64,
    seed: int = 0,
    vocab_size: int | None = None,
) -> PreTrainedModel:
    """Build a random-weight causal LM, save it (safetensors) with its tokenizer, and return it.

    The vocabulary defaults to ``len(tokenizer)`` rounded up to a multiple of 64
    (as real checkpoints pad their embedding matrices); special-token ids come from
    the tokenizer.  Weights are a pure function of ``seed`` and the arguments: the
    torch RNG is seeded (in a forked RNG state) right before construction, which is
    where transformers initialises parameters (including Gated DeltaNet's ``A_log``
    and ``dt_bias``, whose stock initialisation is already sane).
    """
    if isinstance(tokenizer_dir_or_obj, PreTrainedTokenizerBase):
        tokenizer = tokenizer_dir_or_obj
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir_or_obj)
    if vocab_size is None:
        vocab_size = _round_up(len(tokenizer), 64)
    elif vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = make_config(
        arch,
        vocab_size=vocab_size,
        num_layers=num_layers,
        hidden_size=hidden_size,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seed locally; leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = _MODEL_CLASSES[arch](config).eval()
    out = Path(out_dir)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return model


def check_hidden_states(model: PreTrainedModel, input_ids: torch.Tensor) -> list[float]:
    """Forward ``input_ids`` (1 x T) and return the mean L2 norm of every hidden state.

    Raises if any layer's hidden states are non-finite, collapsed to ~0 or blown up,
    which is how a badly initialised recurrent layer (e.g. Gated DeltaNet decay
    parameters) shows up on long inputs.
    """
    with torch.no_grad():
        hidden_states = model(input_ids, output_hidden_states=True).hidden_states
    norms = []
    for layer, h in enumerate(hidden_states):
        if not torch.isfinite(h).all():
            raise ValueError(f"hidden state {layer} has non-finite values")
        norm = float(h.norm(dim=-1).mean())
        if not 1e-3 < norm < 1e3:
            raise ValueError(f"hidden state {layer} has mean norm {norm:.3g}, outside (1e-3, 1e3)")
        norms.append(norm)
    return norms


def check_reload(model: PreTrainedModel, model_dir: str | os.PathLike[str], input_ids: torch.Tensor) -> None:
    """Raise unless ``AutoModelForCausalLM`` reloads ``model_dir`` with bit-identical logits."""
    reloaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if type(reloaded) is not type(model):
        raise TypeError(f"reloaded as {type(reloaded).__name__}, expected {type(model).__name__}")
    with torch.no_grad():
        expected = model(input_ids).logits
        actual = reloaded(input_ids).logits
    if not torch.equal(expected, actual):
        diff = float((expected - actual).abs().max())
        raise ValueError(f"reloaded model's logits differ from the saved model's (max |diff| {diff:.3g})")


def demo_input_ids(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[list[dict[str, str]]], length: int
) -> torch.Tensor:
    """``length`` tokens of templated demo conversations (1 x length), for sanity checks."""
    ids: list[int] = []
    for messages in conversations:
        ids.extend(cast(list[int], tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)))
        if len(ids) >= length:
            break
    return torch.tensor([ids[:length]])
