"""The CPU benchmark (`make bench`): throughput against the naive design and a bare forward pass,
storage dtypes, memory scaling and tokenization, in one process run so that machine noise hits
every contestant alike.

Every timed run (model x contestant, and model x storage dtype) is repeated in rounds; within a
round all runs are interleaved, in an order rotated from round to round. Figures are medians over
rounds; ratios are medians of the per-round ratios (paired, so a slow round slows both sides).

    .venv/bin/python -m benchmarks.cpu                       # everything, under 10 minutes on 2 cores
    .venv/bin/python -m benchmarks.cpu --samples 8 --rounds 1 --memory-samples 8 --out /tmp/bench
    .venv/bin/python -m benchmarks.cpu --batch-shape-only   # auto against a sweep of fixed shapes, alone
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import transformers

from benchmarks.batch_shape import measure_batch_shape, render_batch_shape, shape_samples
from benchmarks.contestants import CONTESTANTS, run_bare, run_naive, run_pipeline
from benchmarks.measure import Run, median, mib, timed, tree_bytes
from benchmarks.memory import measure_memory
from benchmarks.models import DEMO, LAYERS, MODEL_NAMES, REPO, SPECS, build_model, describe, pick_samples
from benchmarks.report import table
from benchmarks.storage import (
    BASELINE,
    REFERENCE,
    error_summary,
    payload_bytes,
    read_states,
    relative_errors,
    storage_dtypes,
)
from benchmarks.tokenization import COLUMNS, measure_tokenization, measure_workers, render_workers
from hsx_dagster.core.extraction.backbone import load_backbone
from hsx_dagster.core.extraction.batching import padding_efficiency, plan_batches
from hsx_dagster.core.inputs.tokenized import read_tokenized_shard
from hsx_dagster.core.model_info import check_model_dir
from hsx_dagster.core.settings import ExtractionSettings

ID_MASK_BYTES = 5  # per token: input id (int32) and loss mask (uint8), stored with the states
HEADLINE = "qwen3.6-shaped"  # the model the pipeline / naive target is about, and the memory runs use
TARGETS = {
    "pipeline_over_bare": 0.95,
    "pipeline_over_naive": 20.0,
    "padding_efficiency": 0.97,
    "bytes_over_payload": 1.01,
    "memory_growth": 1.10,
    "auto_over_best_bare": 0.90,
}


@dataclass
class Loaded:
    directory: Path
    facts: dict
    backbone: torch.nn.Module  # the truncated decoder stack (no hooks outside pipeline runs)
    info: object
    causal_lm: torch.nn.Module | None = None  # the whole model with its LM head, for the naive design


@dataclass
class Job:
    model: str
    contestant: str  # naive | bare | pipeline
    dtype: str = BASELINE  # the storage dtype (the naive design stores bfloat16 too)
    runs: list[Run] = field(default_factory=list)
    bytes_on_disk: list[int] = field(default_factory=list)
    repeats: int = 0  # runs measured again because other processes were busy

    @property
    def key(self) -> str:
        return f"{self.model}/{self.contestant}" + (f"/{self.dtype}" if self.contestant == "pipeline" else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=160, help="about this many demo samples (whole batches), for every run"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--models", nargs="+", default=list(SPECS), choices=list(SPECS), help="models of the throughput table"
    )
    parser.add_argument("--storage-models", nargs="+", default=[DEMO, HEADLINE], choices=list(MODEL_NAMES))
    parser.add_argument(
        "--hidden-size", type=int, default=64, help="hidden size of the Qwen3.6-shaped and dense models"
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="rows per forward (the CPU sweet spot; GPUs want more)"
    )
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument(
        "--chunk-mb", type=float, default=2.0, help="chunk size: small enough that every run writes several"
    )
    parser.add_argument("--memory-samples", type=int, default=64, help="samples of the 1x memory run")
    parser.add_argument("--memory-factor", type=int, default=10)
    parser.add_argument("--tokenize-repeats", type=int, default=3)
    parser.add_argument(
        "--tokenize-conversations",
        type=int,
        default=20_000,
        help="generated conversations of the tokenize_workers 1 vs 2 comparison (0: leave it out)",
    )
    parser.add_argument("--tokenize-rounds", type=int, default=2, help="interleaved rounds of that comparison")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=0.25,
        help="a run during which other processes kept more cores busy is repeated",
    )
    parser.add_argument("--max-repeats", type=int, default=4, help="repeats per model x contestant, over all rounds")
    parser.add_argument(
        "--budget-s", type=float, default=540.0, help="no repeat that would make the whole run end later than this"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results", help="folder of the JSON and Markdown results"
    )
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="date in the result file names")
    parser.add_argument(
        "--shape-samples",
        type=int,
        default=None,
        help="samples of the batch-shape section (auto against a sweep of fixed shapes; 0: leave it out); "
        "default 600, or 4 x --samples when that is fewer",
    )
    parser.add_argument(
        "--batch-shape-only",
        action="store_true",
        help="run only the batch-shape section (Qwen3.6-shaped model): <date>-cpu-batch-shape.json and .md",
    )
    args = parser.parse_args(argv)
    if args.shape_samples is None:
        args.shape_samples = min(600, 4 * args.samples)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    load_start = os.getloadavg()
    options = ExtractionSettings(
        batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens, chunk_mb=args.chunk_mb
    )

    if args.batch_shape_only:
        return _batch_shape_only(args, started, load_start)
    with tempfile.TemporaryDirectory(prefix="hsx-bench-") as tmp:
        work = Path(tmp)
        print("tokenizing the demo conversations ...", file=sys.stderr)
        tokenization = measure_tokenization(work / "tokenized", args.tokenize_repeats)
        if args.tokenize_conversations:
            print(f"tokenize_workers 1 vs 2 on {args.tokenize_conversations} conversations ...", file=sys.stderr)
            (work / "workers").mkdir()
            tokenization["workers"] = measure_workers(
                work / "workers", args.tokenize_conversations, args.tokenize_rounds, workers=2
            )
        everything = read_tokenized_shard(work / "tokenized", "shard-00", columns=COLUMNS)
        samples = pick_samples(everything, args.samples, args.batch_size, args.max_batch_tokens)

        names = list(dict.fromkeys([*args.models, *args.storage_models]))
        print(f"building and loading models: {', '.join(names)} ...", file=sys.stderr)
        loaded = {name: _load(name, work, args.hidden_size, naive=name in args.models) for name in names}
        jobs = [Job(name, contestant) for name in args.models for contestant in CONTESTANTS]
        jobs += [Job(name, "pipeline", dtype) for name in args.storage_models for dtype in storage_dtypes()]
        jobs = list({job.key: job for job in jobs}.values())

        kept = _measure(jobs, loaded, samples, options, work, args, started)
        storage = _storage(jobs, kept, loaded, samples, args.storage_models)
        batch_shape = None
        if args.shape_samples and HEADLINE in loaded:
            model = loaded[HEADLINE]
            batch_shape = measure_batch_shape(
                model.backbone, model.info, shape_samples(everything, args.shape_samples), options.chunk_bytes,
                work, args.rounds, quiet_cores=args.quiet_cores, max_repeats=args.max_repeats,
                deadline=started + args.budget_s,
            )  # fmt: skip
        print("memory scaling (child processes) ...", file=sys.stderr)
        memory = measure_memory(loaded[HEADLINE].directory if HEADLINE in loaded else loaded[names[0]].directory,
                                work / "tokenized", args.memory_samples, args.memory_factor, options)  # fmt: skip

    tokens = int(np.sum(samples.column("num_tokens").to_numpy()))
    results = {
        "date": args.date,
        "machine": _machine(args.threads, load_start),
        "settings": {
            "samples": samples.num_rows,
            "rounds": args.rounds,
            "layers": LAYERS,
            "batch_size": args.batch_size,
            "max_batch_tokens": args.max_batch_tokens,
            "chunk_bytes": options.chunk_bytes,
            "hidden_size": args.hidden_size,
            "compute_dtype": "float32",
        },
        "samples": {
            "count": samples.num_rows,
            "tokens": tokens,
            "mean_tokens": round(tokens / samples.num_rows, 1),
            "padding_efficiency": _padding(samples, options),
            "demo_set_samples": everything.num_rows,
            "demo_set_mean_tokens": round(float(np.mean(everything.column("num_tokens").to_numpy())), 1),
            "demo_set_padding_efficiency": _padding(everything, options),
        },
        "models": {name: model.facts for name, model in loaded.items()},
        "throughput": {name: _throughput(jobs, name, samples, loaded[name].facts) for name in args.models},
        "storage": storage,
        "noise": _noise(jobs, args.quiet_cores),
        "memory": memory,
        "tokenization": tokenization,
        "batch_shape": batch_shape,
    }
    results["targets"] = _targets(results, args.models)
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    results["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]

    markdown = render(results)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{args.date}-cpu"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    stem.with_suffix(".md").write_text(markdown, encoding="utf-8")
    print(markdown)
    print(f"written: {stem}.json, {stem}.md ({results['elapsed_s']:.0f} s)")
    return 0


def _batch_shape_only(args, started: float, load_start) -> int:
    """The batch-shape section alone: tokenize, load the Qwen3.6-shaped model, interleaved rounds."""
    with tempfile.TemporaryDirectory(prefix="hsx-bench-") as tmp:
        work = Path(tmp)
        print("tokenizing the demo conversations ...", file=sys.stderr)
        measure_tokenization(work / "tokenized", 1)
        everything = read_tokenized_shard(work / "tokenized", "shard-00", columns=COLUMNS)
        model = _load(HEADLINE, work, args.hidden_size, naive=False)
        section = measure_batch_shape(
            model.backbone, model.info, shape_samples(everything, args.shape_samples), int(args.chunk_mb * 2**20),
            work, args.rounds, quiet_cores=args.quiet_cores, max_repeats=args.max_repeats,
            deadline=started + args.budget_s,
        )  # fmt: skip
    results = {
        "date": args.date,
        "machine": _machine(args.threads, load_start),
        "model": HEADLINE,
        "facts": model.facts,
        "chunk_bytes": ExtractionSettings(chunk_mb=args.chunk_mb).chunk_bytes,
        "batch_shape": section,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    results["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    m = results["machine"]
    markdown = "\n".join(
        [
            f"# CPU benchmark, batch shape only, {args.date}",
            "",
            f"{m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}; model {HEADLINE} "
            f"({model.facts['about']}); chunks of {args.chunk_mb:g} MiB. Load average "
            f"{m['load_average_start'][0]} at the start, {m['load_average_end'][0]} at the end; "
            f"{results['elapsed_s']:.0f} s in all.",
            "",
            *render_batch_shape(section),
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{args.date}-cpu-batch-shape"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    stem.with_suffix(".md").write_text(markdown, encoding="utf-8")
    print(markdown)
    print(f"written: {stem}.json, {stem}.md ({results['elapsed_s']:.0f} s)")
    return 0


def _load(name: str, work: Path, hidden_size: int, naive: bool) -> Loaded:
    from transformers import AutoModelForCausalLM

    directory = build_model(name, work, hidden_size)
    facts = describe(name, directory)
    backbone = load_backbone(check_model_dir(directory), facts["layer_ids"])
    backbone.close()  # hooks go on per pipeline run
    facts["kept_layers"] = backbone.info.kept_layers
    facts["backbone_parameters"] = backbone.info.parameters
    causal_lm = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval() if naive else None
    return Loaded(directory, facts, backbone.model, backbone.info, causal_lm)


def _measure(
    jobs: list[Job],
    loaded: dict[str, Loaded],
    samples: pa.Table,
    options: ExtractionSettings,
    work: Path,
    args,
    started: float,
) -> dict[str, Path]:
    """Every job once per round, interleaved, in an order rotated from round to round. A run that other
    processes disturbed is measured again while the budget allows. Returns the first round's pipeline
    outputs (for the reconstruction errors)."""
    print(f"warming up {len(jobs)} runs ...", file=sys.stderr)
    for job in jobs:
        _execute(job, loaded[job.model], samples.slice(0, 4), options, work / "warm-up")
        shutil.rmtree(work / "warm-up", ignore_errors=True)
    kept: dict[str, Path] = {}
    for round_number in range(args.rounds):
        shift = round_number * len(jobs) // args.rounds
        order = jobs[shift:] + jobs[:shift]
        for position, job in enumerate(order):
            out = work / "runs" / f"{job.key.replace('/', '-')}-{round_number}"
            while True:
                shutil.rmtree(out, ignore_errors=True)
                run = timed(lambda job=job, out=out: _execute(job, loaded[job.model], samples, options, out))
                noisy = run.others_cores is not None and run.others_cores > args.quiet_cores
                rest = (order[position + 1 :], args.rounds - round_number - 1)
                if (
                    not noisy
                    or job.repeats >= args.max_repeats
                    or not _affordable(run.seconds, jobs, *rest, started, args)
                ):
                    break
                job.repeats += 1
            job.runs.append(run)
            job.bytes_on_disk.append(tree_bytes(out) if out.exists() else 0)
            if round_number == 0 and job.contestant == "pipeline":
                kept[job.key] = out
            else:
                shutil.rmtree(out, ignore_errors=True)
        print(f"round {round_number + 1}/{args.rounds} done, {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return kept


def _affordable(
    seconds: float, jobs: list[Job], left_in_round: list[Job], rounds_left: int, started: float, args
) -> bool:
    """Whether one more run of ``seconds`` still lets everything planned end within the budget."""
    latest = {job.key: job.runs[-1].seconds for job in jobs if job.runs}
    unknown = max(latest.values(), default=seconds)  # not run yet: assume the slowest
    rest = sum(latest.get(j.key, unknown) for j in left_in_round) + rounds_left * sum(
        latest.get(j.key, unknown) for j in jobs
    )
    reserve = 60.0  # the memory runs and the report
    return time.perf_counter() - started + seconds + rest + reserve < args.budget_s


def _execute(job: Job, model: Loaded, samples: pa.Table, options: ExtractionSettings, out: Path):
    if job.contestant == "naive":
        return run_naive(model.causal_lm, samples, model.facts["layer_ids"], out, torch.bfloat16)
    if job.contestant == "bare":
        return run_bare(model.backbone, samples, options)
    return run_pipeline(model.backbone, model.info, samples, _with_dtype(options, job.dtype), out)


def _with_dtype(options: ExtractionSettings, dtype: str) -> ExtractionSettings:
    return options.model_copy(update={"storage_dtype": dtype})


def _padding(table: pa.Table, options: ExtractionSettings) -> float:
    lengths = table.column("num_tokens").to_numpy()
    return round(padding_efficiency(plan_batches(lengths, options.batch_size, options.max_batch_tokens)), 4)


def _find(jobs: list[Job], model: str, contestant: str, dtype: str = BASELINE) -> Job:
    return next(
        j
        for j in jobs
        if j.model == model and j.contestant == contestant and (contestant != "pipeline" or j.dtype == dtype)
    )


def _paired(numerator: Job, denominator: Job) -> dict:
    """Per-round ratios of seconds (numerator / denominator) and their median."""
    ratios = [a.seconds / b.seconds for a, b in zip(numerator.runs, denominator.runs)]
    return {"per_round": [round(r, 3) for r in ratios], "median": round(median(ratios), 3)}


def _throughput(jobs: list[Job], name: str, samples: pa.Table, facts: dict) -> dict:
    tokens = int(np.sum(samples.column("num_tokens").to_numpy()))
    payload = payload_bytes(tokens, len(facts["layer_ids"]), facts["hidden_size"], BASELINE)
    figures = {}
    for contestant in CONTESTANTS:
        job = _find(jobs, name, contestant)
        seconds = median([r.seconds for r in job.runs])
        growth = [r.peak_rss_growth_bytes for r in job.runs if r.peak_rss_growth_bytes is not None]
        entry = {
            "seconds": [round(r.seconds, 3) for r in job.runs],
            "median_s": round(seconds, 3),
            "samples_per_s": round(samples.num_rows / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1),
            "cpu_busy": round(median([r.cpu_seconds / r.seconds for r in job.runs]), 2),  # cores this process kept busy
            "others_cores": _others(job),
            "repeats": job.repeats,
            "peak_rss_mib": mib(median([r.peak_rss_bytes for r in job.runs])) if growth else None,
            "peak_rss_growth_mib": mib(median(growth)) if growth else None,
        }
        if contestant != "bare":
            written = median(job.bytes_on_disk)
            entry |= {
                "bytes_on_disk": int(written),
                "bytes_per_token": round(written / tokens, 2),
                "bytes_over_payload": round(written / payload, 4),
                # what is left once the 5 bytes per token of ids (int32) and loss mask (uint8) are counted
                "bytes_over_payload_ids_mask": round(written / (payload + ID_MASK_BYTES * tokens), 4),
            }
        if contestant == "pipeline":
            report = job.runs[0].result
            entry |= {
                "padding_efficiency": report["padding_efficiency"],
                "forward_share": report["forward_share"],
                "chunks": len(report["chunks"]),
            }
        figures[contestant] = entry
    pipeline, naive, bare = (_find(jobs, name, c) for c in ("pipeline", "naive", "bare"))
    return {
        "tokens": tokens,
        "payload_bytes_per_token": payload / tokens,
        "contestants": figures,
        "pipeline_over_naive": _paired(naive, pipeline),  # c/a: naive seconds / pipeline seconds
        "pipeline_over_bare": _paired(bare, pipeline),  # c/b
    }


def _noise(jobs: list[Job], quiet_cores: float) -> dict:
    others = [r.others_cores for job in jobs for r in job.runs if r.others_cores is not None]
    return {
        "quiet_cores": quiet_cores,
        "repeated_runs": sum(job.repeats for job in jobs),
        "kept_runs": sum(len(job.runs) for job in jobs),
        "noisy_kept_runs": sum(x > quiet_cores for x in others),
        "others_cores_median": round(median(others), 3) if others else None,
        "others_cores_max": round(max(others), 3) if others else None,
    }


def _others(job: Job) -> float | None:
    """Median cores other processes kept busy during the kept runs (0 on a quiet machine)."""
    values = [r.others_cores for r in job.runs if r.others_cores is not None]
    return round(median(values), 3) if values else None


def _storage(
    jobs: list[Job], kept: dict[str, Path], loaded: dict[str, Loaded], samples: pa.Table, names: list[str]
) -> dict:
    tokens = int(np.sum(samples.column("num_tokens").to_numpy()))
    storage = {}
    for name in names:
        facts = loaded[name].facts
        reference = read_states(kept[_find(jobs, name, "pipeline", REFERENCE).key])
        baseline = _find(jobs, name, "pipeline", BASELINE)
        rows = {}
        for dtype in storage_dtypes():
            job = _find(jobs, name, "pipeline", dtype)
            written = median(job.bytes_on_disk)
            payload = payload_bytes(tokens, len(facts["layer_ids"]), facts["hidden_size"], dtype)
            rows[dtype] = {
                "bytes_per_token": round(written / tokens, 2),
                "over_bfloat16_bytes": round(written / median(baseline.bytes_on_disk), 4),
                "over_payload": round(written / payload, 4),
                "relative_error": error_summary(relative_errors(kept[job.key], reference)),
                "tokens_per_s": round(tokens / median([r.seconds for r in job.runs]), 1),
                "throughput_over_bfloat16": _paired(baseline, job),  # bfloat16 seconds / this dtype's seconds
            }
        storage[name] = {"reference": REFERENCE, "dtypes": rows}
    return storage


def _targets(results: dict, models: list[str]) -> list[dict]:
    t = TARGETS
    rows = []
    for name in models:
        figures = results["throughput"][name]
        rows.append(
            _target(
                f"pipeline / bare >= {t['pipeline_over_bare']}",
                name,
                figures["pipeline_over_bare"]["median"],
                t["pipeline_over_bare"],
            )
        )
    if HEADLINE in results["throughput"]:
        ratio = results["throughput"][HEADLINE]["pipeline_over_naive"]["median"]
        rows.append(
            _target(f"pipeline / naive >= {t['pipeline_over_naive']:.0f}x", HEADLINE, ratio, t["pipeline_over_naive"])
        )
    workers = results.get("tokenization", {}).get("workers")
    if workers:
        bound = workers["target_speedup"]
        rows.append(_target(f"tokenize_workers 2 / 1 >= {bound}x", "tokenizer", workers["speedup"]["median"], bound))
    efficiency = results["samples"]["demo_set_padding_efficiency"]
    rows.append(
        _target(
            f"padding efficiency >= {t['padding_efficiency']} (whole demo set)",
            "all",
            efficiency,
            t["padding_efficiency"],
        )
    )
    for name in models:
        ratio = results["throughput"][name]["contestants"]["pipeline"]["bytes_over_payload"]
        rows.append(
            _target(
                f"bytes on disk <= {t['bytes_over_payload']} x payload",
                name,
                ratio,
                t["bytes_over_payload"],
                at_most=True,
            )
        )
    if results.get("batch_shape"):
        rows.append(
            _target(
                f"auto pipeline / best bare of the sweep >= {t['auto_over_best_bare']}",
                HEADLINE,
                results["batch_shape"]["auto_over_best_bare"]["median"],
                t["auto_over_best_bare"],
            )
        )
    growth = results["memory"]["peak_ratio"]
    rows.append(
        _target(
            f"peak RSS {results['memory']['factor']}x / 1x <= {t['memory_growth']}",
            "memory",
            growth,
            t["memory_growth"],
            at_most=True,
        )
    )
    return rows


def _target(name: str, model: str, measured: float, bound: float, at_most: bool = False) -> dict:
    return {
        "target": name,
        "model": model,
        "measured": measured,
        "met": measured <= bound if at_most else measured >= bound,
    }


def _machine(threads: int, load_start) -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_start": [round(x, 2) for x in load_start],
    }


def _noise_line(noise: dict) -> str:
    return (
        f"Other processes on the machine: {noise['repeated_runs']} runs measured again because others kept more than "
        f"{noise['quiet_cores']} cores busy meanwhile; {noise['noisy_kept_runs']} of the {noise['kept_runs']} "
        "kept runs were "
        f"still disturbed; others' median {noise['others_cores_median']} cores, max {noise['others_cores_max']}."
    )


def render(results: dict) -> str:
    s, m = results["samples"], results["machine"]
    out = [
        f"# CPU benchmark, {results['date']}",
        "",
        f"{m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}, transformers "
        f"{m['transformers']}. "
        f"{s['count']} demo samples in whole batches ({s['tokens']:,} tokens, mean {s['mean_tokens']}), "
        f"{results['settings']['rounds']} interleaved rounds, medians; layers {LAYERS}, float32 compute, "
        f"batches of <= {results['settings']['batch_size']} rows / {results['settings']['max_batch_tokens']:,} tokens. "
        f"Load average {m['load_average_start'][0]} at the start, {m['load_average_end'][0]} at the end; "
        f"{results['elapsed_s']:.0f} s in all.",
        "",
        _noise_line(results["noise"]),
        "",
        "## Throughput",
        "",
    ]
    rows = []
    for name, figures in results["throughput"].items():
        for contestant, f in figures["contestants"].items():
            rows.append([
                name, contestant, f["samples_per_s"], f["tokens_per_s"],
                figures["pipeline_over_naive"]["median"] if contestant == "pipeline" else None,
                figures["pipeline_over_bare"]["median"] if contestant == "pipeline" else None,
                f.get("padding_efficiency"), f.get("bytes_per_token"), f.get("bytes_over_payload"),
                f["peak_rss_growth_mib"], f["cpu_busy"],
            ])  # fmt: skip
    headers = [
        "model",
        "contestant",
        "samples/s",
        "tokens/s",
        "c/a (x naive)",
        "c/b (x bare)",
        "padding eff.",
        "bytes/token",
        "x payload",
        "peak RSS +MiB",
        "cores busy",
    ]
    out += [table(headers, rows, [0, 0, 2, 0, 2, 3, 3, 1, 4, 0, 2]), ""]
    out += [
        f"Padding efficiency of the whole demo set ({s['demo_set_samples']:,} samples, mean "
        f"{s['demo_set_mean_tokens']} tokens) "
        f"with the same batches: {s['demo_set_padding_efficiency']}.",
        "",
        "## Storage dtypes",
        "",
    ]
    rows = []
    for name, entry in results["storage"].items():
        for dtype, f in entry["dtypes"].items():
            e = f["relative_error"]
            rows.append(
                [
                    name,
                    dtype,
                    f["bytes_per_token"],
                    f["over_bfloat16_bytes"],
                    f["over_payload"],
                    e["median"],
                    e["p99"],
                    f["throughput_over_bfloat16"]["median"],
                ]
            )
    headers = [
        "model",
        "storage dtype",
        "bytes/token",
        "x bfloat16",
        "x payload",
        "rel. error median",
        "rel. error p99",
        "throughput x bfloat16",
    ]
    out += [table(headers, rows, [0, 0, 1, 3, 4, 4, 4, 2]), ""]
    mem = results["memory"]
    out += ["## Memory scaling (pipeline, Qwen3.6-shaped, child processes)", ""]
    rows = [
        [
            run,
            r["samples"],
            r["tokens"],
            r["chunks"],
            mib(r["extraction_peak_rss_bytes"]),
            mib(r["process_peak_rss_bytes"]),
            mib(r["rss_after_load_bytes"]),
            r["seconds"],
        ]
        for run, r in mem["runs"].items()
    ]
    out += [
        table(
            [
                "run",
                "samples",
                "tokens",
                "chunks",
                "extraction peak RSS MiB",
                "process peak RSS MiB",
                "RSS after load MiB",
                "seconds",
            ],
            rows,
            1,
        ),
        "",
    ]
    compared = "the extraction's own peak" if mem["compared"].startswith("extraction") else "the process's peak"
    out += [
        f"Peak RSS {mem['factor']}x / 1x: {mem['peak_ratio']} ({compared}); whole process, imports and loading "
        f"included: {mem['process_peak_ratio']}.",
        "",
    ]
    if results.get("batch_shape"):
        out += render_batch_shape(results["batch_shape"])
    tok = results["tokenization"]
    out += [
        "## Tokenization",
        "",
        f"{tok['conversations']:,} demo conversations -> {tok['samples']:,} samples ({tok['tokens']:,} tokens): "
        f"{tok['conversations_per_s']:,} conversations/s, {tok['tokens_per_s']:,} tokens/s (median of "
        f"{len(tok['seconds'])}).",
        "",
        *([render_workers(tok["workers"]), ""] if tok.get("workers") else []),
        "## Targets",
        "",
        table(
            ["target", "model", "measured", "met"],
            [[r["target"], r["model"], r["measured"], r["met"]] for r in results["targets"]],
            3,
        ),
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
