"""Tiny random-weight checkpoints laid out like the public releases of the targets drafters are trained for.

Each family is built with transformers' own classes (fixed seed, a handful of layers, hidden size 64),
saved with ``save_pretrained`` and then laid out as the release is: the weights re-sharded into several
safetensors files with a ``model.safetensors.index.json``, keys renamed to the release's prefixes
(Gemma 3 multimodal keeps ``language_model.model.*``), per-expert MoE weights where the release stores
experts one by one, and the extra weights a release ships that transformers never instantiates:
Qwen3.5/3.6 and Qwen3-Next multi-token-prediction modules (``mtp.*``), DeepSeek-V3's MTP layer stored
as one extra decoder layer (``model.layers.N.*``). A family whose classes the installed transformers
lacks is reported by ``missing_classes`` so the matrix can skip it, saying so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hsx_dagster_tests.support.release_layouts import (
    deepseek_release,
    drop_tied_head,
    gemma3_vl_release,
    qwen3_5_vl_release,
    qwen_text_release,
    split_experts,
)

HIDDEN = 64
VOCAB_MULTIPLE = 64
SHARDS = 3


@dataclass(frozen=True)
class Family:
    name: str
    model_class: str  # the release's architecture, built with this transformers class
    config_class: str
    num_layers: int
    make_config: Callable[[Any, dict], Any]  # (transformers module, common token/vocab kwargs) -> config
    relayout: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]] = lambda state, config: state
    classes: tuple[str, ...] = ()  # other classes the family needs
    notes: str = ""
    extra_config: dict = field(default_factory=dict)  # keys the release's config.json has beyond transformers'

    def missing_classes(self) -> list[str]:
        import transformers

        return [
            name for name in (self.model_class, self.config_class, *self.classes) if not hasattr(transformers, name)
        ]


def _init_range(hidden: int) -> float:
    # 0.02 (the library default) leaves every layer of a 64-wide model a small perturbation of the
    # embeddings; states of different layers would be nearly identical and parity would prove little.
    return 0.5 / math.sqrt(hidden)


def _common(tokens: dict) -> dict:
    return dict(
        vocab_size=tokens["vocab_size"],
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=_init_range(HIDDEN),
        pad_token_id=tokens["pad_token_id"],
        eos_token_id=tokens["eos_token_id"],
        bos_token_id=tokens["bos_token_id"],
    )


def _qwen3_5_text(tf, tokens: dict, num_layers: int, moe: bool) -> dict:
    text = dict(
        _common(tokens),
        num_hidden_layers=num_layers,
        head_dim=32,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    else:
        text.update(intermediate_size=4 * HIDDEN)
    return text


_QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN, patch_size=4)


def _qwen3_5_vl(tf, tokens: dict) -> Any:
    text = tf.Qwen3_5TextConfig(**_qwen3_5_text(tf, tokens, 8, moe=False))
    return tf.Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=_QWEN_VISION,
        image_token_id=tokens["vocab_size"] - 4,
        video_token_id=tokens["vocab_size"] - 3,
        vision_start_token_id=tokens["vocab_size"] - 2,
        vision_end_token_id=tokens["vocab_size"] - 1,
        tie_word_embeddings=False,
    )


def _qwen3_5_moe_vl(tf, tokens: dict) -> Any:
    text = tf.Qwen3_5MoeTextConfig(**_qwen3_5_text(tf, tokens, 8, moe=True))
    return tf.Qwen3_5MoeConfig(
        text_config=text.to_dict(),
        vision_config=_QWEN_VISION,
        image_token_id=tokens["vocab_size"] - 4,
        video_token_id=tokens["vocab_size"] - 3,
        vision_start_token_id=tokens["vocab_size"] - 2,
        vision_end_token_id=tokens["vocab_size"] - 1,
        tie_word_embeddings=False,
    )


def _gemma3_text(tf, tokens: dict, num_layers: int) -> dict:
    return dict(
        _common(tokens),
        num_hidden_layers=num_layers,
        intermediate_size=4 * HIDDEN,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=16,  # shorter than the samples: the sliding layers really slide
        layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
    )


def _gemma3_vl(tf, tokens: dict) -> Any:
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)  # fmt: skip
    return tf.Gemma3Config(
        text_config=_gemma3_text(tf, tokens, 8),
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=tokens["vocab_size"] - 3,
        eoi_token_index=tokens["vocab_size"] - 2,
        image_token_index=tokens["vocab_size"] - 1,
        tie_word_embeddings=True,
    )


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "qwen3_5-vl",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5Config",
            8,
            _qwen3_5_vl,
            qwen3_5_vl_release,
            ("Qwen3_5TextConfig",),
            "Qwen3.5/3.6 multimodal: Gated DeltaNet + full attention, text under model.language_model, "
            "vision tower, mtp.* in the index",
            {"text_config": {"mtp_num_hidden_layers": 1}},
        ),
        Family(
            "qwen3_5-text",
            "Qwen3_5ForCausalLM",
            "Qwen3_5TextConfig",
            8,
            lambda tf, tokens: tf.Qwen3_5TextConfig(**_qwen3_5_text(tf, tokens, 8, moe=False)),
            qwen_text_release,
            notes="Qwen3.5 text-only, mtp.* in the index",
            extra_config={"mtp_num_hidden_layers": 1},
        ),
        Family(
            "qwen3_5_moe-vl",
            "Qwen3_5MoeForConditionalGeneration",
            "Qwen3_5MoeConfig",
            8,
            _qwen3_5_moe_vl,
            qwen3_5_vl_release,
            ("Qwen3_5MoeTextConfig",),
            "Qwen3.5-MoE multimodal: hybrid attention, routed + shared experts stored per expert, mtp.*",
            {"text_config": {"mtp_num_hidden_layers": 1}},
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            6,
            lambda tf, tokens: tf.Qwen3MoeConfig(
                **_common(tokens),
                num_hidden_layers=6,
                head_dim=32,
                intermediate_size=4 * HIDDEN,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            ),
            split_experts,
            notes="Qwen3 MoE: experts stored per expert",
        ),
        Family(
            "llama3",
            "LlamaForCausalLM",
            "LlamaConfig",
            6,
            lambda tf, tokens: tf.LlamaConfig(
                **_common(tokens),
                num_hidden_layers=6,
                intermediate_size=4 * HIDDEN,
                head_dim=HIDDEN // 4,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500_000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            notes="Llama 3 with llama3 rope scaling",
        ),
        Family(
            "qwen3_next",
            "Qwen3NextForCausalLM",
            "Qwen3NextConfig",
            8,
            lambda tf, tokens: tf.Qwen3NextConfig(
                **_common(tokens),
                num_hidden_layers=8,
                head_dim=32,
                intermediate_size=4 * HIDDEN,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
            ),
            qwen_text_release,
            notes="Qwen3-Next: Gated DeltaNet + gated full attention, MoE stored per expert, mtp.* in the index",
            extra_config={"num_nextn_predict_layers": 1},
        ),
        Family(
            "gpt_oss",
            "GptOssForCausalLM",
            "GptOssConfig",
            6,
            lambda tf, tokens: tf.GptOssConfig(
                **_common(tokens),
                num_hidden_layers=6,
                head_dim=16,
                intermediate_size=32,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=16,
                tie_word_embeddings=False,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(6)],
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 150_000.0,
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 4096,
                },
            ),
            notes="gpt-oss: attention sinks, alternating sliding/full attention, fused experts (bf16 layout); "
            "no sdpa support in transformers",
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            "DeepseekV3Config",
            6,
            lambda tf, tokens: tf.DeepseekV3Config(
                **{**_common(tokens), "num_key_value_heads": 4},
                num_hidden_layers=6,
                intermediate_size=4 * HIDDEN,
                moe_intermediate_size=32,
                n_routed_experts=4,
                n_shared_experts=1,
                num_experts_per_tok=2,
                n_group=2,
                topk_group=1,
                first_k_dense_replace=1,
                kv_lora_rank=32,
                q_lora_rank=48,
                qk_rope_head_dim=8,
                qk_nope_head_dim=16,
                v_head_dim=16,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10_000.0,
                    "factor": 40.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096,
                },
            ),
            deepseek_release,
            notes="DeepSeek-V3: MLA, dense then MoE layers stored per expert, MTP stored as layer N",
            extra_config={"num_nextn_predict_layers": 1},
        ),
        Family(
            "gemma3-text",
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            6,
            lambda tf, tokens: tf.Gemma3TextConfig(**_gemma3_text(tf, tokens, 6)),
            drop_tied_head,
            notes="Gemma 3 text (gemma-3-1b layout): sliding + global attention, tied head",
        ),
        Family(
            "gemma3-vl",
            "Gemma3ForConditionalGeneration",
            "Gemma3Config",
            8,
            _gemma3_vl,
            gemma3_vl_release,
            ("Gemma3TextConfig",),
            "Gemma 3 multimodal (gemma-3-4b+ layout): language_model.model.*, SigLIP vision tower, tied head",
        ),
    )
}


def tokens_of(tokenizer) -> dict:
    return dict(
        vocab_size=-(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def build_release(family: Family, out: Path, tokenizer, *, seed: int = 0, shards: int = SHARDS) -> Path:
    """Build ``family`` at toy size in ``out`` (config, sharded safetensors with an index, tokenizer)."""
    import transformers

    config = family.make_config(transformers, tokens_of(tokenizer))
    config.architectures = [family.model_class]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, family.model_class)(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    state: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("*.safetensors")):
        state.update(load_file(str(path)))
        path.unlink()
    for index in out.glob("*.index.json"):
        index.unlink()
    state = family.relayout(state, config)
    _write_sharded(out, state, shards)
    if family.extra_config:
        config_file = out / "config.json"
        saved = json.loads(config_file.read_text())
        for key, value in family.extra_config.items():
            if isinstance(value, dict):
                saved.setdefault(key, {}).update(value)
            else:
                saved[key] = value
        config_file.write_text(json.dumps(saved, indent=2))
    return out


def _write_sharded(out: Path, state: dict[str, torch.Tensor], shards: int) -> None:
    names = list(state)  # save order: a tensor's shard follows the order transformers wrote them in
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for number in range(shards):
        part = names[number * per_shard : (number + 1) * per_shard]
        if not part:
            continue
        file = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: state[name].contiguous() for name in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        total += sum(state[name].numel() * state[name].element_size() for name in part)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def checkpoint_parameters(model_dir: Path, keep: Callable[[str], bool]) -> int:
    """Parameters stored under the names ``keep`` accepts, read from the safetensors headers only."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if keep(name):
                    total += math.prod(handle.get_slice(name).get_shape())
    return total
