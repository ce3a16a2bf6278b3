"""The GPU benchmark's models: configs at real sizes (or tiny for --smoke), weights built directly on the
device, the truncated backbone over the same weights, loading from a saved checkpoint in a fresh process,
and the random samples they run on. Needs only what hsx_dagster.core needs (no dagster)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from benchmarks import REPO
from hsx_dagster.core.extraction import BackboneInfo
from hsx_dagster.core.model import attn_implementation_in_use
from hsx_dagster.core.storage import StoredLayers, dtype_name

_NORM_VALUES: dict[type, float] = {}  # the value a norm weight starts at, per norm class


# Real sizes (Qwen3-8B and Qwen3.6-27B config.json); smoke runs shrink them with SMOKE.
MODELS = {
    "qwen3-8b-like": {
        "config": "Qwen3Config",
        "causal_lm": "Qwen3ForCausalLM",
        "sizes": dict(
            vocab_size=151_936,
            hidden_size=4096,
            intermediate_size=12_288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40_960,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    },
    "qwen3.6-27b-like": {
        "config": "Qwen3_5TextConfig",
        "causal_lm": "Qwen3_5ForCausalLM",
        "sizes": dict(
            vocab_size=248_320,
            hidden_size=5120,
            intermediate_size=17_408,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            max_position_embeddings=262_144,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
        ),
    },
}


SMOKE = dict(
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    max_position_embeddings=4096,
)  # fmt: skip


SMOKE_MROPE = [2, 1, 1]  # head_dim 32 x 0.25 rotary = 4 frequencies


def make_config(name: str, smoke: bool):
    import transformers

    spec = MODELS[name]
    config_class = getattr(transformers, spec["config"])
    sizes = dict(spec["sizes"])
    if smoke:
        sizes |= {k: v for k, v in SMOKE.items() if k in sizes}
        if "mrope_section" in sizes["rope_parameters"]:
            sizes["rope_parameters"] = sizes["rope_parameters"] | {"mrope_section": SMOKE_MROPE}
    return config_class(**sizes), getattr(transformers, spec["causal_lm"])


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_on_device(model_class, config, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """Construct on the meta device, materialise on ``device``, initialise in place."""
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(config)
    model.to_empty(device=device)
    initialise(model, config.initializer_range, seed)
    recreate_buffers(model, device)
    return model.eval().requires_grad_(False)


def _norm_value(module: torch.nn.Module, size: int) -> float:
    """What a norm's weight starts at: 1 (x * w), or 0 for Qwen3.5's (1 + w) norms. Read from a fresh
    CPU instance of the same class, so this follows the installed transformers."""
    kind = type(module)
    if kind not in _NORM_VALUES:
        try:
            _NORM_VALUES[kind] = float(kind(size).weight.detach().flatten()[0])
        except Exception:  # a constructor with other arguments: the usual x * w convention
            _NORM_VALUES[kind] = 1.0
    return _NORM_VALUES[kind]


@torch.no_grad()
def initialise(model: torch.nn.Module, std: float, seed: int) -> None:
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if name == "A_log":  # Gated DeltaNet decay rates: log of U(0.01, 16), as transformers initialises them
                param.uniform_(0.01, 16.0, generator=generator).log_()
            elif name == "dt_bias":
                param.fill_(1.0)
            elif name == "bias":
                param.zero_()
            elif name == "weight" and param.dim() == 1:  # a norm
                param.fill_(_norm_value(module, param.shape[0]))
            else:
                param.normal_(0.0, std, generator=generator)


def recreate_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inverse frequencies) hold garbage after ``to_empty``: rebuild
    their modules from the config. Any other buffer would be garbage too, so it is refused."""
    rebuilt = set()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if "inv_freq" in dict(child.named_buffers(recurse=False)):
                setattr(parent, child_name, type(child)(child.config).to(device))
                rebuilt.add(f"{parent_name}.{child_name}".lstrip("."))
    leftover = [n for n, _ in model.named_buffers() if n.rsplit(".", 1)[0] not in rebuilt]
    if leftover:
        raise RuntimeError(f"buffers this builder does not know how to initialise: {leftover[:5]}")


def check_against_reference(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Smoke check: every parameter that a normal construction sets to a constant (norms, biases,
    dt_bias) has that constant here, and every buffer matches."""
    ours = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        values = param.detach().float()
        constant = values.numel() and bool((values == values.flatten()[0]).all())
        if constant and not bool((ours[name].float() == values.flatten()[0]).all()):
            raise AssertionError(f"{name}: expected constant {float(values.flatten()[0])}, built otherwise")
    ours_buffers = dict(model.named_buffers())
    for name, buffer in reference.named_buffers():
        if not torch.allclose(ours_buffers[name].float().cpu(), buffer.float()):
            raise AssertionError(f"buffer {name} differs from a normal construction")


def truncated_backbone(causal_lm: torch.nn.Module, layer_ids: list[int], device: torch.device, dtype: torch.dtype):
    """The decoder stack cut after the deepest requested layer, no LM head, sharing the weights of
    ``causal_lm`` (what hsx_dagster.core.extraction.backbone.load_backbone makes from a checkpoint)."""
    full = causal_lm.model
    config = copy.deepcopy(full.config)
    keep = StoredLayers(tuple(layer_ids), include_final=False).kept_decoder_layers(config.num_hidden_layers)
    config.num_hidden_layers = keep
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:keep]
    with torch.device("meta"), _default_dtype(dtype):
        backbone = type(full)(config)
    state = full.state_dict()
    result = backbone.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys:
        raise RuntimeError(f"truncated backbone: weights not shared: {result.missing_keys[:5]}")
    recreate_buffers(backbone, device)
    backbone.eval().requires_grad_(False)
    info = BackboneInfo(
        model_type=str(config.model_type),
        num_layers=full.config.num_hidden_layers,
        kept_layers=keep,
        hidden_size=int(config.hidden_size),
        layer_ids=tuple(layer_ids),
        include_final=False,
        compute_dtype=dtype_name(dtype),
        device=str(device),
        attn_implementation=str(attn_implementation_in_use(config)),
        parameters=sum(p.numel() for p in backbone.parameters()),
    )
    return backbone, info


# Run in a fresh process, so its peak RSS is the loading's alone: load_backbone on a saved checkpoint.
LOAD_PROBE = """
import json, resource, sys, time
import torch
import transformers  # imported (and the GPU context made) before the baseline: only the loading is measured
from pathlib import Path
from hsx_dagster.core.extraction import load_backbone
from hsx_dagster.core.model import check_model_dir
from hsx_dagster.core.storage import COMPUTE_DTYPES
path, layer_ids, device, dtype = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
if device.startswith("cuda"):
    torch.zeros(1, device=device)
model = check_model_dir(Path(path))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
started = time.perf_counter()
backbone = load_backbone(model, layer_ids, device=device, compute_dtype=COMPUTE_DTYPES[dtype])
if device.startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
loaded = sum(p.numel() * p.element_size() for p in backbone.model.parameters())
print(json.dumps({"load_s": seconds, "rss_before": before, "rss_peak": peak, "loaded_bytes": loaded,
                  "attn_implementation": backbone.info.attn_implementation}))
"""


def measure_loading(causal_lm, layer_ids: list[int], device: torch.device, dtype: torch.dtype, folder: Path) -> dict:
    """Save ``causal_lm`` as a sharded checkpoint and load its backbone with load_backbone in a fresh process:
    the seconds, and the host's peak RSS above what the process held before (on a GPU the weights go
    straight to the device, so it stays far below the bytes loaded)."""
    checkpoint_bytes = sum(p.numel() * p.element_size() for p in causal_lm.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < 1.5 * checkpoint_bytes:
        return {"skipped": f"{free / 2**30:.0f} GiB free for a {checkpoint_bytes / 2**30:.0f} GiB checkpoint"}
    try:
        causal_lm.save_pretrained(folder, max_shard_size="4GB")
        completed = subprocess.run(
            [sys.executable, "-c", LOAD_PROBE, str(folder), json.dumps(layer_ids), str(device),
             dtype_name(dtype)],
            capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False,
        )  # fmt: skip
        if completed.returncode != 0:
            raise RuntimeError(f"loading probe failed: {completed.stderr[-2000:]}")
        probe = json.loads(completed.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "checkpoint_gib": round(checkpoint_bytes / 2**30, 2),
        "loaded_gib": round(probe["loaded_bytes"] / 2**30, 2),
        "load_s": round(probe["load_s"], 1),
        "host_peak_rss_gib": round(probe["rss_peak"] / 2**30, 2),
        "host_rss_growth_gib": round((probe["rss_peak"] - probe["rss_before"]) / 2**30, 2),
        "attn_implementation": probe["attn_implementation"],
    }


def matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters a forward pass multiplies with: all but the embedding table (a lookup)."""
    return sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)


def _chosen_implementation(function):
    """The function a transformers kernel wrapper calls: the ``implementation`` it closes over, found through
    the ``kernels`` package's module wrapper (transformers 5.25 and later) and the closures in between."""
    seen: set[int] = set()
    while function is not None and id(function) not in seen:
        seen.add(id(function))
        if isinstance(function, torch.nn.Module):
            function = type(function).forward
        code = getattr(function, "__code__", None)
        if code is None:
            return function
        closure = dict(zip(code.co_freevars, (cell.cell_contents for cell in function.__closure__ or ())))
        if "implementation" in closure:
            return closure["implementation"]
        inner = closure.get("func")
        if not callable(inner):
            return function
        function = inner
    return function


def linear_attention_kernel(model: torch.nn.Module) -> str | None:
    """Which implementation the Gated DeltaNet layers call: flash-linear-attention or PyTorch."""
    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is None:
        return None
    function = getattr(layer, "chunk_gated_delta_rule", None)  # transformers that pick at construction
    if function is None:  # transformers that pick at import, behind a wrapper closing over the choice
        module = sys.modules[type(layer).__module__]
        function = getattr(module, "torch_chunk_gated_delta_rule", None) or getattr(
            module, "chunk_gated_delta_rule", None
        )
        function = _chosen_implementation(function)
    origin = f"{getattr(function, '__module__', '?')}.{getattr(function, '__name__', '?')}"
    fla = importlib.util.find_spec("fla") is not None
    kind = "flash-linear-attention" if origin.startswith("fla") else "PyTorch reference path"
    return f"{kind} ({origin}; fla {'importable' if fla else 'not installed'})"


def make_samples(count: int, mean_tokens: int, vocab_size: int, seed: int, max_tokens: int = 4096) -> pa.Table:
    """Random token ids with long-tailed lengths (log-normal, like chat data: median ~2/3 of the mean)."""
    rng = np.random.default_rng(seed)
    sigma = 0.9
    lengths = rng.lognormal(np.log(mean_tokens) - sigma**2 / 2, sigma, size=count)
    lengths = np.clip(np.round(lengths * mean_tokens / lengths.mean()), 8, max_tokens).astype(np.int64)
    ids = [rng.integers(0, vocab_size, size=n, dtype=np.int32) for n in lengths]
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.table({
        "sample_id": pa.array(np.arange(count, dtype=np.int64)),
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(ids), pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(np.ones(int(lengths.sum()), np.uint8))),
        "num_tokens": pa.array(lengths.astype(np.int32)),
    })  # fmt: skip


def check_finite(backbone: torch.nn.Module, device: torch.device) -> None:
    ids = torch.arange(64, device=device)[None] % 1000
    with torch.inference_mode():
        states = backbone(input_ids=ids, use_cache=False).last_hidden_state
    if not bool(torch.isfinite(states).all()):
        raise RuntimeError("the randomly initialised model produces non-finite states")
