"""Every target family drafters are trained for, laid out as its public release is, through tokenize ->
extract -> assemble with default settings, against an independent per-sample forward pass of the whole
model built by transformers' own class.

For each family (hsx_dagster_tests/support/release_checkpoints.py builds them): the stored layers and, in a second
run with ``include_final``, the final state match the reference within bfloat16 storage's rounding; the
extraction loaded nothing but the text decoder's embedding, the layers up to the deepest requested one
and the final norm (parameter count against the checkpoint's own headers: no vision tower, LM head, MTP
module or later layer); the manifest, every shard.json and the reader state the model's layer count,
width, architecture and the preset behind the ids; the parity check passes with a reference that loads
only the layers it needs. A family is skipped only where the installed transformers lacks its classes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hsx_dagster import DrafterDataset
from hsx_dagster.core.dataset import assemble, check_parity
from hsx_dagster.core.extraction import (
    BackboneError,
    ShardJob,
    ShardResult,
    attention_support,
    decoder_layers,
    resolve_attn_implementation,
    run_shard,
)
from hsx_dagster.core.inputs import tokenize_dataset
from hsx_dagster.core.model import AttentionFlags, text_weights_prefix, weight_names
from hsx_dagster.core.settings import Settings, load_settings
from hsx_dagster.core.storage import SHARD_FILE
from hsx_dagster_tests.support.helpers import write_settings as write_settings_file
from hsx_dagster_tests.support.release_checkpoints import FAMILIES, build_release, checkpoint_parameters
from hsx_dagster_tests.support.sweeps import sweep

MAX_RELATIVE_ERROR = 1.2e-2  # per token, bfloat16 storage of float32 states
SAMPLES = 4
# Where each release keeps its text decoder, spelled out here rather than found by the code under test.
TEXT_PREFIX = {"qwen3_5-vl": "model.language_model.", "qwen3_5_moe-vl": "model.language_model.",
               "gemma3-vl": "language_model.model."}  # fmt: skip
# On a CPU without flash-attention: gpt-oss has no sdpa in transformers, every other family does.
CPU_ATTENTION = {"gpt_oss": "eager"}
# Stored beside the weights but buffers, not parameters (DeepSeek-V3's router bias).
BUFFERS = ("e_score_correction_bias",)


def _skip_if_unavailable(name: str) -> None:
    import transformers

    missing = FAMILIES[name].missing_classes()
    if missing:
        pytest.skip(f"transformers {transformers.__version__} lacks {', '.join(missing)}: {name} is not tested")


@pytest.fixture(scope="module")
def family_inputs(demo_conversations, tmp_path_factory) -> Path:
    """A handful of demo conversations of different lengths (so batches are padded), as JSONL."""
    ordered = sorted(demo_conversations, key=lambda c: sum(len(m.content) for m in c.messages))
    usable = ordered[: len(ordered) // 5]  # short ones: the reference runs every sample through the whole model
    picked = [usable[int(i * (len(usable) - 1) / (SAMPLES - 1))] for i in range(SAMPLES)]
    path = tmp_path_factory.mktemp("family-inputs") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c.as_chat()}) + "\n" for c in picked))
    return path


@pytest.fixture(scope="module")
def release_dirs(demo_tokenizer, tmp_path_factory):
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = build_release(FAMILIES[name], tmp_path_factory.mktemp(name) / "model", demo_tokenizer)
        return built[name]

    return build


def write_settings(folder: Path, inputs: Path, model_dir: Path, **sections) -> Settings:
    """A user's settings file: the inputs, the model and an output folder; every other key at its default."""
    data = {"dataset": {"paths": [inputs]}, "model": {"path": model_dir}, "output_dir": folder / "out"}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return load_settings(write_settings_file(folder / "hsx.yaml", **data))


def run_pipeline(settings: Settings) -> list[ShardResult]:
    """What the three assets do, in order, with these settings."""
    tokenize_dataset(settings.dataset, settings.model, settings.tokenized_dir, shards=settings.shards)
    results = [run_shard(ShardJob.from_settings(settings, shard)) for shard in settings.shard_keys]
    assemble(
        settings.tokenized_dir,
        settings.hidden_states_dir,
        settings.shard_keys,
        settings.drafter_dir,
        val_fraction=settings.drafter.val_fraction,
        settings=settings.public_dict(),
    )
    return results


def text_parameters(name: str, model_dir: Path, kept_layers: int) -> int:
    """Parameters of the text decoder's embedding, first ``kept_layers`` layers and final norm, as stored."""
    prefix = TEXT_PREFIX.get(name, "model.")
    layer = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")

    def kept(weight: str) -> bool:
        if not weight.startswith(prefix) or weight.endswith(BUFFERS):
            return False
        match = layer.match(weight)
        return int(match.group(1)) < kept_layers if match else weight.removeprefix(prefix).split(".")[0] != "layers"

    return checkpoint_parameters(model_dir, kept)


def full_reference(name: str, model_dir: Path):
    """The whole release (vision tower, head and all) built by transformers' own class: per-sample states."""
    import transformers

    model = getattr(transformers, FAMILIES[name].model_class).from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    seen: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}

    def states(input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = tuple(input_ids.tolist())
        if key not in seen:
            with torch.inference_mode():
                seen[key] = model(input_ids=input_ids[None], output_hidden_states=True).hidden_states
        return seen[key]

    return model, states


def relative_error(stored: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.float()
    return float(((stored.float() - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-6)).max())


def eagle3(num_layers: int) -> list[int]:
    return sorted({1, num_layers // 2 - 1, num_layers - 4})


# Quick loop: Qwen3.5 MoE multimodal (hybrid attention, experts, a wrapper; Gemma 3 multimodal, whose weights
# are renamed on load, runs in the last-layer test); every family in the whole suite.
@pytest.mark.parametrize("name", sweep(FAMILIES, quick=["qwen3_5_moe-vl"]))
def test_family_extracts_with_default_settings(name, release_dirs, family_inputs, tmp_path):
    _skip_if_unavailable(name)
    family = FAMILIES[name]
    model_dir = release_dirs(name)
    n = family.num_layers
    ids = eagle3(n)

    assert text_weights_prefix(weight_names(model_dir)) == TEXT_PREFIX.get(name, "model.")

    # 1. Default settings: eagle3 layers, no final state, attention auto, bfloat16 storage.
    settings = write_settings(tmp_path / "default", family_inputs, model_dir)
    (result,) = run_pipeline(settings)
    info = result.backbone
    assert info is not None and info.attn_implementation == CPU_ATTENTION.get(name, "sdpa")
    assert (info.num_layers, info.kept_layers) == (n, max(ids) + 1) and info.kept_layers < n
    # Loaded: embedding, layers 0..max(ids), final norm. Not loaded: vision tower, LM head, MTP, later layers.
    assert info.parameters == text_parameters(name, model_dir, max(ids) + 1)
    assert info.parameters < checkpoint_parameters(model_dir, lambda weight: True)

    ds = DrafterDataset(settings.drafter_dir)
    assert len(ds) == SAMPLES
    assert (ds.num_hidden_layers, ds.hidden_size, ds.architecture) == (n, 64, family.model_class)
    assert (ds.layer_preset, ds.layer_ids) == ("eagle3", ids)
    assert ds.manifest["layers"]["num_hidden_layers"] == n and ds.model["architectures"] == [family.model_class]
    shard_json = json.loads((settings.hidden_states_dir / "shard-00" / SHARD_FILE).read_text())
    assert shard_json["layer_preset"] == "eagle3"
    assert {k: shard_json["model"][k] for k in ("num_hidden_layers", "hidden_size", "architecture")} == {
        "num_hidden_layers": n,
        "hidden_size": 64,
        "architecture": family.model_class,
    }

    full, reference = full_reference(name, model_dir)
    assert decoder_layers(full) is _explicit_layers(name, full)  # the shared lookup sees through the wrapper
    worst = 0.0
    for index in range(len(ds)):
        sample = ds[index]
        assert sample["hidden_states"].dtype == torch.bfloat16
        hidden = reference(sample["input_ids"])
        assert len(hidden) == n + 1
        for position, layer in enumerate(ids):
            worst = max(worst, relative_error(sample["hidden_states"][:, position], hidden[layer + 1][0]))
    assert worst <= MAX_RELATIVE_ERROR, f"{name}: stored layers differ from the reference by {worst:.3g}"

    parity = check_parity(settings.drafter_dir, settings.tokenized_dir, samples=2)
    assert parity.passed, parity.description
    assert parity.metadata["reference_layers_loaded"] == f"{max(ids) + 1} of {n}"

    # 2. The final state too (model.include_final): every layer is loaded, the final norm's output is stored.
    final_settings = write_settings(tmp_path / "final", family_inputs, model_dir, model={"include_final": True})
    (final_result,) = run_pipeline(final_settings)
    assert final_result.backbone is not None and final_result.backbone.kept_layers == n
    assert final_result.backbone.parameters == text_parameters(name, model_dir, n)
    final_ds = DrafterDataset(final_settings.drafter_dir)
    worst = 0.0
    for index in range(len(final_ds)):
        sample = final_ds[index]
        hidden = reference(sample["input_ids"])
        worst = max(worst, relative_error(sample["final_hidden_states"], hidden[-1][0]))
        for position, layer in enumerate(ids):
            worst = max(worst, relative_error(sample["hidden_states"][:, position], hidden[layer + 1][0]))
    assert worst <= MAX_RELATIVE_ERROR, f"{name}: stored states with the final one differ by {worst:.3g}"
    parity = check_parity(final_settings.drafter_dir, final_settings.tokenized_dir, samples=1)
    assert parity.passed and parity.metadata["reference_layers_loaded"] == f"{n} of {n}", parity.description


def _explicit_layers(name: str, full: torch.nn.Module) -> torch.nn.ModuleList:
    if name == "gemma3-vl" or name.endswith("-vl"):
        return full.model.language_model.layers
    return full.model.layers


def test_the_last_layer_is_stored_raw_not_normed(release_dirs, family_inputs, tmp_path):
    """Layer id N-1 is the raw output of the last layer (Hugging Face's last hidden state is normed)."""
    _skip_if_unavailable("gemma3-vl")
    model_dir = release_dirs("gemma3-vl")
    settings = write_settings(tmp_path, family_inputs, model_dir, model={"layers": [0, 7], "include_final": True})
    run_pipeline(settings)
    ds = DrafterDataset(settings.drafter_dir)
    assert ds.layer_preset is None and ds.layer_ids == [0, 7]
    full, reference = full_reference("gemma3-vl", model_dir)
    captured = {}
    _explicit_layers("gemma3-vl", full)[7].register_forward_hook(lambda m, i, o: captured.update(raw=o))
    sample = ds[0]
    hidden = reference(sample["input_ids"])
    raw = captured["raw"][0] if isinstance(captured["raw"], tuple) else captured["raw"]
    assert relative_error(sample["hidden_states"][:, 1], raw[0]) <= MAX_RELATIVE_ERROR
    assert relative_error(sample["hidden_states"][:, 1], hidden[-1][0]) > 0.1  # not the normed one
    assert relative_error(sample["final_hidden_states"], hidden[-1][0]) <= MAX_RELATIVE_ERROR
    parity = check_parity(settings.drafter_dir, settings.tokenized_dir, samples=2)
    assert parity.passed, parity.description


def test_an_attention_the_model_cannot_use_is_refused_before_loading(
    release_dirs, family_inputs, tmp_path, monkeypatch
):
    _skip_if_unavailable("gpt_oss")
    import transformers

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the attention implementation was checked")

    monkeypatch.setattr(transformers.GptOssModel, "from_pretrained", must_not_load)
    settings = write_settings(
        tmp_path, family_inputs, release_dirs("gpt_oss"), extraction={"attn_implementation": "sdpa"}
    )
    tokenize_dataset(settings.dataset, settings.model, settings.tokenized_dir, shards=settings.shards)
    with pytest.raises(BackboneError) as refused:
        run_shard(ShardJob.from_settings(settings, "shard-00"))
    message = str(refused.value)
    assert message.startswith("extraction.attn_implementation is sdpa but GptOssModel has no sdpa attention")
    assert "values that work for GptOssModel on cpu: auto, eager" in message


# What three kinds of model class say they support (the flags the resolution reads; real classes' flags are read
# in test_seams.py): sdpa and every flash variant; gpt-oss (no sdpa, flash only with attention sinks); neither.
_Decoder = AttentionFlags("_Decoder", sdpa=True, flash=True)
_SinksDecoder = AttentionFlags(
    "_SinksDecoder", sdpa=False, flash=True, flash_variants=("kernels-community/vllm-flash-attn3", "flash_attention_4")
)
_PlainDecoder = AttentionFlags("_PlainDecoder", sdpa=False, flash=False)


def test_auto_takes_the_fastest_attention_that_works(monkeypatch):
    from hsx_dagster.core.extraction import backbone

    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert resolve_attn_implementation("auto", _Decoder, cpu, torch.float32) == "sdpa"
    assert resolve_attn_implementation("auto", _SinksDecoder, cpu, torch.float32) == "eager"
    assert resolve_attn_implementation("auto", _PlainDecoder, gpu, torch.bfloat16) == "eager"
    monkeypatch.setattr(backbone, "_flash_installed", lambda implementation: implementation == "flash_attention_2")
    monkeypatch.setattr(backbone, "_flash_usable", lambda implementation: True)
    assert resolve_attn_implementation("auto", _Decoder, gpu, torch.bfloat16) == "flash_attention_2"
    assert resolve_attn_implementation("auto", _Decoder, cpu, torch.bfloat16) == "sdpa"  # flash needs a GPU
    assert resolve_attn_implementation("auto", _Decoder, gpu, torch.float32) == "sdpa"  # and bf16/fp16 compute
    assert resolve_attn_implementation("auto", _SinksDecoder, gpu, torch.bfloat16) == "eager"  # FA2 lacks sinks
    monkeypatch.setattr(backbone, "_flash_installed", lambda implementation: True)
    assert resolve_attn_implementation("auto", _Decoder, gpu, torch.bfloat16) == "flash_attention_3"
    assert resolve_attn_implementation("auto", _SinksDecoder, gpu, torch.bfloat16) == "flash_attention_4"
    support = attention_support(_SinksDecoder, gpu, torch.bfloat16)
    assert support["eager"] is None and "only these flash-attention variants" in str(support["flash_attention_2"])
    with pytest.raises(
        BackboneError,
        match=r"is flash_attention_2 but .*only these flash-attention variants.*: auto, flash_attention_4, eager",
    ):
        resolve_attn_implementation("flash_attention_2", _SinksDecoder, gpu, torch.bfloat16)


def test_flash_attention_on_a_cpu_names_the_setting_and_what_works(monkeypatch):
    from hsx_dagster.core.extraction import backbone

    monkeypatch.setattr(backbone, "_flash_installed", lambda implementation: False)
    with pytest.raises(BackboneError) as refused:
        resolve_attn_implementation("flash_attention_2", _Decoder, "cpu", torch.float32)
    assert str(refused.value) == (
        "extraction.attn_implementation is flash_attention_2 but flash-attn is not installed; values that work "
        "for _Decoder on cpu: auto, sdpa, eager (auto picks sdpa)"
    )


def test_weight_names_come_from_the_index_or_the_safetensors_headers(demo_model_dir, tmp_path):
    names = weight_names(demo_model_dir)  # one safetensors file, no index: read from its header
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert text_weights_prefix(names) == "model."
    assert text_weights_prefix(["language_model.model.embed_tokens.weight", "language_model.model.layers.0.x"]) == (
        "language_model.model."
    )
    assert text_weights_prefix(["embed_tokens.weight", "layers.0.mlp.weight"]) == ""
    assert text_weights_prefix(["model.embed_tokens.weight"]) is None  # no layers beside it: unknown
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.b": "x.safetensors"}}))
    assert weight_names(tmp_path) == ["a.b"]
