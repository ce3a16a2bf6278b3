"""How each release lays out its weights, as state-dict transforms applied to transformers' in-memory layout:
experts stored one by one, multi-token-prediction modules (``mtp.*``; DeepSeek-V3's as one extra decoder layer),
multimodal prefixes, and a tied head left out. release_checkpoints.py names one per family."""

from __future__ import annotations

import re
from typing import Any

import torch


def split_experts(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Fused expert tensors (transformers' in-memory layout) -> one tensor per expert and projection, as
    Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE and DeepSeek-V3 releases store them."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        if match is None or tensor.dim() != 3:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for expert in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                gate, up = tensor[expert].chunk(2, dim=0)
                out[f"{prefix}.{expert}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{expert}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{prefix}.{expert}.down_proj.weight"] = tensor[expert].contiguous()
    return out


def random_like(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if tensor.dim() == 1:  # norms
        return torch.ones_like(tensor)
    return (torch.randn(tensor.shape, generator=generator) * 0.05).to(tensor.dtype)


def qwen_mtp(state: dict[str, torch.Tensor], text_prefix: str, num_layers: int) -> dict[str, torch.Tensor]:
    """The release's ``mtp.*`` module: fc over [embedding; hidden], its norms and one decoder layer shaped like
    the last full-attention layer."""
    generator = torch.Generator().manual_seed(1234)
    layer = f"{text_prefix}layers.{num_layers - 1}."
    hidden = state[f"{text_prefix}norm.weight"].shape[0]
    extra = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.05,
        "mtp.norm.weight": torch.ones(hidden),
        "mtp.pre_fc_norm_embedding.weight": torch.ones(hidden),
        "mtp.pre_fc_norm_hidden.weight": torch.ones(hidden),
    }
    for name, tensor in state.items():
        if name.startswith(layer):
            extra["mtp.layers.0." + name[len(layer) :]] = random_like(tensor, generator)
    return extra


def qwen3_5_vl_release(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    state = split_experts(state, config)
    return {**state, **qwen_mtp(state, "model.language_model.", config.text_config.num_hidden_layers)}


def qwen_text_release(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    state = split_experts(state, config)
    return {**state, **qwen_mtp(state, "model.", config.num_hidden_layers)}


def deepseek_release(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 stores its MTP module as decoder layer N (one past ``num_hidden_layers``): a full MoE
    decoder layer plus enorm, hnorm, eh_proj and a shared head with its own embedding."""
    state = split_experts(state, config)
    generator = torch.Generator().manual_seed(4321)
    n = config.num_hidden_layers
    last = f"model.layers.{n - 1}."
    hidden, vocab = config.hidden_size, config.vocab_size
    extra = {
        f"model.layers.{n}." + k[len(last) :]: random_like(v, generator) for k, v in state.items() if k.startswith(last)
    }
    extra.update({
        f"model.layers.{n}.enorm.weight": torch.ones(hidden),
        f"model.layers.{n}.hnorm.weight": torch.ones(hidden),
        f"model.layers.{n}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.05,
        f"model.layers.{n}.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator) * 0.05,
        f"model.layers.{n}.shared_head.norm.weight": torch.ones(hidden),
        f"model.layers.{n}.shared_head.head.weight": torch.randn(vocab, hidden, generator=generator) * 0.05,
    })  # fmt: skip
    return {**state, **extra}


_GEMMA3_RELEASE_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def gemma3_vl_release(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """gemma-3-4b-it and larger: ``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``,
    no LM head (tied to the embedding)."""
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        for old, new in _GEMMA3_RELEASE_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = tensor
    return out


def drop_tied_head(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != "lm_head.weight"}
