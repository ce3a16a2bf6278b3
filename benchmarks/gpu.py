"""GPU benchmark: the pipeline against a bare forward pass and the naive design on random-weight
models at real sizes, and the model FLOP utilisation (MFU) against the measured matmul ceiling.

    python benchmarks/gpu.py            # one GPU (sized for an H200, ~139 GiB): under 8 minutes, no network
    python benchmarks/gpu.py --smoke    # the same code on the CPU with tiny configs, in seconds (tests run it)

Models, built from configs (no download): a Qwen3-8B-like dense model and a Qwen3.6-27B-like hybrid
(Gated DeltaNet linear attention + full attention, 3:1). Weights are built directly on the device:
the model is constructed on the meta device, materialised there with ``to_empty`` and initialised in
place with a seeded normal_ (norms, decay and rotary buffers as the architecture initialises them),
so a 27B model never touches host memory. The naive design and the pipeline share the weights.

MFU = 2 x parameters used x tokens / seconds / matmul ceiling, where parameters used are the
non-embedding parameters the forward pass multiplies with (the truncated backbone for bare and
pipeline; every layer and the LM head for the naive design) and the ceiling is a large bf16 GEMM
timed with CUDA events on the same GPU. Attention's own FLOPs are not counted.

Needs what hsx_dagster.core needs (torch, transformers 5.x with the Qwen3 and Qwen3.5 classes, safetensors,
pyarrow, numpy, pydantic-settings, pyyaml), not dagster.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout, installed or not

from benchmarks.contestants import CONTESTANTS, run_bare, run_naive, run_pipeline  # noqa: E402
from benchmarks.measure import tree_bytes  # noqa: E402
from benchmarks.report import table  # noqa: E402
from hsx_dagster.core.extraction.backbone import BackboneInfo  # noqa: E402
from hsx_dagster.core.layers import resolve_layers  # noqa: E402
from hsx_dagster.core.settings import ExtractionSettings  # noqa: E402
from hsx_dagster.core.storage.format import dtype_name  # noqa: E402
from hsx_dagster.core.storage.provenance import StoredLayers  # noqa: E402
from hsx_dagster.core.transformers_internals import attn_implementation_in_use  # noqa: E402

LAYERS = "eagle3"
MEAN_TOKENS = 335
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
# The auto row: the pipeline with no batch settings against bare at each (rows, tokens) of a sweep.
GPU_SWEEP = ((32, 16_384), (64, 65_536), (128, 131_072))
SMOKE_SWEEP = ((4, 256), (16, 1024))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, tiny configs, a few samples: checks the code in seconds"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--samples", type=int, nargs="+", default=None, help="samples per model (default 512 dense, 256 hybrid)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mean-tokens", type=int, default=None, help=f"mean sample length (default {MEAN_TOKENS})")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=65_536)
    parser.add_argument("--budget-s", type=float, default=360.0, help="rounds stop early rather than run past this")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="where the contestants write (default: a temporary folder)"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="folder of <date>-gpu.json/.md (default benchmarks/results; none with --smoke)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.samples = args.samples or [8]
        args.mean_tokens = args.mean_tokens or 40
        args.rounds = min(args.rounds, 1)
        args.batch_size, args.max_batch_tokens = min(args.batch_size, 4), min(args.max_batch_tokens, 1024)
    args.samples = args.samples or [512 if "dense" in name or "8b" in name else 256 for name in args.models]
    if len(args.samples) == 1:
        args.samples = args.samples * len(args.models)
    args.mean_tokens = args.mean_tokens or MEAN_TOKENS
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible; use --smoke to check the code on a CPU")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(args.seed)
    results = {
        "date": datetime.date.today().isoformat(),
        "smoke": args.smoke,
        "machine": _machine(device, transformers.__version__),
        "ceiling": matmul_ceiling(device, dtype, n=256 if args.smoke else 8192),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "models": {},
    }
    print(
        f"matmul ceiling: {results['ceiling']['tflops']:.1f} TFLOP/s ({results['ceiling']['shape']})", file=sys.stderr
    )
    out_root = Path(tempfile.mkdtemp(prefix="hsx-gpu-bench-", dir=args.out_dir))
    try:
        for position, (name, count) in enumerate(zip(args.models, args.samples)):
            left = args.budget_s - (time.perf_counter() - started)
            budget = left / (len(args.models) - position)
            results["models"][name] = bench_model(
                name, count, args, device, dtype, results["ceiling"], out_root / name, budget
            )
    finally:
        shutil.rmtree(out_root, ignore_errors=True)
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    markdown = render(results)
    print(markdown)
    folder = args.results or (None if args.smoke else REPO / "benchmarks" / "results")
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"{results['date']}-gpu{'-smoke' if args.smoke else ''}"
        stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        stem.with_suffix(".md").write_text(markdown, encoding="utf-8")
        print(f"written: {stem}.json, {stem}.md", file=sys.stderr)
    return 0


def matmul_ceiling(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 50) -> dict:
    """Achievable dense matmul throughput: an n x n x n GEMM in the compute dtype, repeated."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=out)
    seconds = _timed(device, lambda: [torch.mm(a, b, out=out) for _ in range(repeats)])
    return {"shape": f"{n}^3 {dtype_name(dtype)}", "tflops": 2 * n**3 * repeats / seconds / 1e12}


def _timed(device: torch.device, function) -> float:
    """Seconds of ``function``; CUDA events on a GPU, so queued kernels are counted to their end."""
    if device.type != "cuda":
        started = time.perf_counter()
        function()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    function()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1000


# --- models -------------------------------------------------------------------------------------


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


_NORM_VALUES: dict[type, float] = {}


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
from hsx_dagster.core.extraction.backbone import load_backbone
from hsx_dagster.core.model_info import check_model_dir
from hsx_dagster.core.storage.format import COMPUTE_DTYPES
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


# --- samples and runs ---------------------------------------------------------------------------


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


def bench_model(name, count, args, device, dtype, ceiling, out: Path, budget_s: float) -> dict:
    started = time.perf_counter()
    config, model_class = make_config(name, args.smoke)
    build_s = time.perf_counter()
    causal_lm = build_on_device(model_class, config, device, dtype, args.seed)
    build_s = time.perf_counter() - build_s
    if args.smoke:
        with torch.random.fork_rng(devices=[]):
            check_against_reference(causal_lm, model_class(config))
    layer_ids = resolve_layers(LAYERS, config.num_hidden_layers)
    loading = measure_loading(causal_lm, layer_ids, device, dtype, out / "checkpoint")
    print(f"{name}: loading from a checkpoint: {loading}", file=sys.stderr)
    backbone, info = truncated_backbone(causal_lm, layer_ids, device, dtype)
    samples = make_samples(count, args.mean_tokens, config.vocab_size, args.seed)
    tokens = int(np.sum(samples.column("num_tokens").to_numpy()))
    options = ExtractionSettings(batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens)
    sweep = {
        f"bare {tokens:,} x {rows}": ExtractionSettings(batch_size=rows, max_batch_tokens=tokens)
        for rows, tokens in (SMOKE_SWEEP if args.smoke else GPU_SWEEP)
    }
    names = (*CONTESTANTS, *sweep, "pipeline auto")
    auto_reports: list[dict] = []
    _check_finite(backbone, device)
    print(f"{name}: built in {build_s:.1f} s; {count} samples, {tokens} tokens", file=sys.stderr)

    def execute(contestant: str, table: pa.Table, folder: Path):
        if contestant in sweep:
            return run_bare(backbone, table, sweep[contestant])  # noqa: F821
        if contestant == "pipeline auto":  # the default settings: batch_size and max_batch_tokens auto
            auto_reports.append(run_pipeline(backbone, info, table, ExtractionSettings(), folder))  # noqa: F821
            return auto_reports[-1]
        if contestant == "naive":
            return run_naive(causal_lm, table, layer_ids, folder, dtype)  # noqa: F821 (ruff misreads the del below)
        if contestant == "bare":
            return run_bare(backbone, table, options)  # noqa: F821
        return run_pipeline(backbone, info, table, options, folder)  # noqa: F821

    for contestant in names:  # warm-up: kernels, allocator, pinned memory
        execute(contestant, samples.slice(0, min(4, count)), out / "warm-up")
        shutil.rmtree(out / "warm-up", ignore_errors=True)
    auto_reports.clear()
    runs: dict[str, list[dict]] = {c: [] for c in names}
    for round_number in range(args.rounds):
        round_started = time.perf_counter()
        shift = round_number % len(names)
        for contestant in names[shift:] + names[:shift]:
            folder = out / f"{contestant.replace(' ', '-').replace(',', '')}-{round_number}"
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds = _timed(device, lambda c=contestant, f=folder: execute(c, samples, f))
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            runs[contestant].append(
                {
                    "seconds": seconds,
                    "peak_device_bytes": peak,
                    "bytes_on_disk": tree_bytes(folder) if folder.exists() else 0,
                }
            )
            shutil.rmtree(folder, ignore_errors=True)
        spent = time.perf_counter() - started
        if spent + (time.perf_counter() - round_started) > budget_s and round_number + 1 < args.rounds:
            print(f"{name}: stopping after {round_number + 1} rounds to stay within the time budget", file=sys.stderr)
            break

    used = {
        "naive": matmul_parameters(causal_lm),
        "bare": matmul_parameters(backbone),
        "pipeline": matmul_parameters(backbone),
        **{contestant: matmul_parameters(backbone) for contestant in (*sweep, "pipeline auto")},
    }
    figures = {}
    for contestant, entries in runs.items():
        seconds = float(np.median([e["seconds"] for e in entries]))
        peak = [e["peak_device_bytes"] for e in entries if e["peak_device_bytes"] is not None]
        figures[contestant] = {
            "seconds": [round(e["seconds"], 3) for e in entries],
            "samples_per_s": round(count / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1),
            "parameters_used": used[contestant],
            "mfu": round(2 * used[contestant] * tokens / seconds / (ceiling["tflops"] * 1e12), 4),
            "peak_device_gib": round(max(peak) / 2**30, 2) if peak else None,
            "bytes_on_disk": int(np.median([e["bytes_on_disk"] for e in entries])),
        }

    def paired(numerator: str, denominator: str) -> float:  # median of per-round ratios of seconds
        return round(
            float(np.median([x["seconds"] / y["seconds"] for x, y in zip(runs[numerator], runs[denominator])])), 3
        )

    result = {
        "config": {k: v for k, v in config.to_dict().items() if k in MODELS[name]["sizes"] or k == "layer_types"},
        "parameters": sum(p.numel() for p in causal_lm.parameters()),
        "layer_ids": layer_ids,
        "kept_layers": info.kept_layers,
        "attn_implementation": info.attn_implementation,
        "linear_attention": linear_attention_kernel(causal_lm),
        "build_s": round(build_s, 1),
        "loading": loading,
        "samples": count,
        "tokens": tokens,
        "mean_tokens": round(tokens / count, 1),
        "rounds": len(runs["bare"]),
        "contestants": figures,
        "pipeline_over_naive": paired("naive", "pipeline"),
        "pipeline_over_bare": paired("bare", "pipeline"),
        "batch_shape": _auto_row(runs, ["bare", *sweep], auto_reports),
    }
    del causal_lm, backbone
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _auto_row(runs: dict[str, list[dict]], bare: list[str], reports: list[dict]) -> dict:
    """The pipeline with auto batch shapes against the fastest bare shape of each round."""
    rounds = len(runs["pipeline auto"])
    ratios = [min(runs[b][k]["seconds"] for b in bare) / runs["pipeline auto"][k]["seconds"] for k in range(rounds)]
    return {
        "bare_shapes": {"bare": "--batch-size x --max-batch-tokens", **{b: b for b in bare if b != "bare"}},
        "auto_over_best_bare": {
            "per_round": [round(r, 3) for r in ratios],
            "median": round(float(np.median(ratios)), 3),
        },
        "chosen": [f"{r['final_max_batch_tokens']:,} tokens x {r['final_batch_size']} rows" for r in reports],
        "probe_s": [r["batch_shape"]["probe_s"] for r in reports],
        "probe_overhead_s": [r["batch_shape"]["probe_overhead_s"] for r in reports],
        "probe_table_first_round": reports[0]["batch_shape"]["probe_table"] if reports else [],
        "token_cap": [r["batch_shape"]["token_cap"] for r in reports],
    }


def _check_finite(backbone: torch.nn.Module, device: torch.device) -> None:
    ids = torch.arange(64, device=device)[None] % 1000
    with torch.inference_mode():
        states = backbone(input_ids=ids, use_cache=False).last_hidden_state
    if not bool(torch.isfinite(states).all()):
        raise RuntimeError("the randomly initialised model produces non-finite states")


def _machine(device: torch.device, transformers_version: str) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {
        "device": name,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers_version,
        "fla": importlib.util.find_spec("fla") is not None,
    }


def render(results: dict) -> str:
    m, c = results["machine"], results["ceiling"]
    lines = [
        f"# GPU benchmark{' (smoke: CPU, tiny configs)' if results['smoke'] else ''}, {results['date']}",
        "",
        f"{m['device']}, torch {m['torch']} (CUDA {m['cuda']}), transformers {m['transformers']}. "
        f"Matmul ceiling {c['tflops']:.1f} TFLOP/s ({c['shape']}). {results['elapsed_s']:.0f} s in all.",
        "",
    ]
    rows = []
    for name, r in results["models"].items():
        for contestant, f in r["contestants"].items():
            rows.append([
                name, contestant, f["samples_per_s"], f["tokens_per_s"], f["mfu"],
                r["pipeline_over_naive"] if contestant == "pipeline" else None,
                r["pipeline_over_bare"] if contestant == "pipeline" else None, f["peak_device_gib"],
            ])  # fmt: skip
    lines += [
        table(
            ["model", "contestant", "samples/s", "tokens/s", "MFU", "x naive", "x bare", "peak GPU GiB"],
            rows,
            [0, 0, 2, 0, 3, 2, 3, 1],
        ),
        "",
    ]
    for name, r in results["models"].items():
        kernel = f"; linear attention: {r['linear_attention']}" if r["linear_attention"] else ""
        lines.append(
            f"- {name}: {r['parameters']:,} parameters, layers {r['layer_ids']} ({r['kept_layers']} of "
            f"{r['config']['num_hidden_layers']} run by bare/pipeline), {r['samples']} samples, mean "
            f"{r['mean_tokens']} tokens, "
            f"{r['rounds']} rounds, attention {r['attn_implementation']}{kernel}; built in {r['build_s']} s"
        )
        load = r.get("loading") or {}
        if "load_s" in load:
            lines.append(
                f"  - loaded from a {load['checkpoint_gib']} GiB checkpoint by load_backbone in {load['load_s']} s: "
                f"{load['loaded_gib']} GiB of weights, host peak RSS {load['host_peak_rss_gib']} GiB "
                f"(+{load['host_rss_growth_gib']} GiB while loading), attention {load['attn_implementation']}"
            )
        elif load:
            lines.append(f"  - loading not measured: {load['skipped']}")
        shape = r.get("batch_shape")
        if shape:
            lines.append(
                f"  - defaults (batch_size, max_batch_tokens auto) / best bare shape of the sweep: "
                f"{shape['auto_over_best_bare']['median']} (per round {shape['auto_over_best_bare']['per_round']}); "
                f"chose {', '.join(shape['chosen'])}; probe {shape['probe_s']} s, lost to slower shapes "
                f"{shape['probe_overhead_s']} s"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
