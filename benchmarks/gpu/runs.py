"""The GPU benchmark's runs: the matmul ceiling, and per model every contestant (naive, bare, pipeline, bare
at each shape of a sweep, the pipeline with auto batch shapes) in interleaved rounds timed with CUDA events,
with their throughput, MFU and paired ratios. Needs only what hsx_dagster.core needs (no dagster)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from benchmarks.gpu.models import (
    MODELS,
    build_on_device,
    check_against_reference,
    check_finite,
    linear_attention_kernel,
    make_config,
    make_samples,
    matmul_parameters,
    measure_loading,
    truncated_backbone,
)
from benchmarks.shared.contestants import CONTESTANTS, run_bare, run_naive, run_pipeline
from benchmarks.shared.measure import tree_bytes
from hsx_dagster.core.model import resolve_layers
from hsx_dagster.core.settings import ExtractionSettings
from hsx_dagster.core.storage import dtype_name

LAYERS = "eagle3"


# The auto row: the pipeline with no batch settings against bare at each (rows, tokens) of a sweep.
GPU_SWEEP = ((32, 16_384), (64, 65_536), (128, 131_072))


SMOKE_SWEEP = ((4, 256), (16, 1024))


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
    check_finite(backbone, device)
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
    runs = _rounds(name, names, execute, samples, out, device, args.rounds, started, budget_s)

    used = {
        "naive": matmul_parameters(causal_lm),
        "bare": matmul_parameters(backbone),
        "pipeline": matmul_parameters(backbone),
        **{contestant: matmul_parameters(backbone) for contestant in (*sweep, "pipeline auto")},
    }
    figures = {c: _figures(entries, count, tokens, used[c], ceiling) for c, entries in runs.items()}

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
        **_states_rates(figures["pipeline"]["bytes_on_disk"], runs),
        "batch_shape": _auto_row(runs, ["bare", *sweep], auto_reports),
    }
    del causal_lm, backbone
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _states_rates(stored: int, runs: dict[str, list[dict]]) -> dict:
    """What the host must keep pace with: the GB the pipeline stores per second at the bare forward's pace, and
    what the pipeline stored per second (benchmarks/shared/host_path.py measures the host path's own rate)."""

    def per_s(contestant: str) -> float:
        return round(stored / 1e9 / float(np.median([entry["seconds"] for entry in runs[contestant]])), 3)

    return {"states_gb_per_s_at_bare_pace": per_s("bare"), "states_gb_per_s_pipeline": per_s("pipeline")}


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


def _rounds(name, names, execute, samples: pa.Table, out: Path, device, rounds: int, started: float, budget_s: float):
    """Every contestant once per round, in an order rotated from round to round; stops early rather than run
    past the model's share of the time budget."""
    runs: dict[str, list[dict]] = {c: [] for c in names}
    for round_number in range(rounds):
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
        if spent + (time.perf_counter() - round_started) > budget_s and round_number + 1 < rounds:
            print(f"{name}: stopping after {round_number + 1} rounds to stay within the time budget", file=sys.stderr)
            break
    return runs


def _figures(entries: list[dict], count: int, tokens: int, used: int, ceiling: dict) -> dict:
    """One contestant's medians over its rounds: throughput, MFU, peak device memory, bytes written."""
    seconds = float(np.median([e["seconds"] for e in entries]))
    peak = [e["peak_device_bytes"] for e in entries if e["peak_device_bytes"] is not None]
    return {
        "seconds": [round(e["seconds"], 3) for e in entries],
        "samples_per_s": round(count / seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "parameters_used": used,
        "mfu": round(2 * used * tokens / seconds / (ceiling["tflops"] * 1e12), 4),
        "peak_device_gib": round(max(peak) / 2**30, 2) if peak else None,
        "bytes_on_disk": int(np.median([e["bytes_on_disk"] for e in entries])),
    }
