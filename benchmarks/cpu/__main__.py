"""The CPU benchmark (`make bench`): throughput against the naive design and a bare forward pass,
storage dtypes, memory scaling and tokenization, in one process run so that machine noise hits
every contestant alike.

Every timed run (model x contestant, and model x storage dtype) is repeated in rounds; within a
round all runs are interleaved, in an order rotated from round to round. Figures are medians over
rounds; ratios are medians of the per-round ratios (paired, so a slow round slows both sides).

    .venv/bin/python -m benchmarks.cpu                       # everything, within --budget-s
    .venv/bin/python -m benchmarks.cpu --samples 8 --rounds 1 --memory-samples 8 --out /tmp/bench
    .venv/bin/python -m benchmarks.cpu --batch-shape-only   # auto against a sweep of fixed shapes, alone
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from benchmarks.cpu.batch_shape import measure_batch_shape, render_batch_shape, shape_samples
from benchmarks.cpu.memory import measure_memory
from benchmarks.cpu.models import DEMO, LAYERS, MODEL_NAMES, REPO, SPECS, pick_samples
from benchmarks.cpu.report import render, targets
from benchmarks.cpu.runs import (
    HEADLINE,
    Job,
    load_model,
    machine,
    measure_rounds,
    noise,
    padding,
    storage_section,
    throughput,
)
from benchmarks.cpu.storage import (
    storage_dtypes,
)
from benchmarks.cpu.tokenization import COLUMNS, measure_tokenization, measure_workers
from benchmarks.shared.contestants import CONTESTANTS
from benchmarks.shared.report import write_results
from hsx_dagster.core.inputs import read_tokenized_shard
from hsx_dagster.core.settings import ExtractionSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu", description=__doc__.splitlines()[0])
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
    results = {"date": args.date, "machine": machine(args.threads, load_start)}
    results |= _measure_everything(args, options, started)
    results["targets"] = targets(results, args.models)
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    results["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    write_results(args.out / f"{args.date}-cpu", results, render(results))
    return 0


def _measure_everything(args: argparse.Namespace, options: ExtractionSettings, started: float) -> dict:
    """Every section but the targets: tokenization first (it makes the samples), then the models' runs in
    interleaved rounds, the storage dtypes from their outputs, the batch shape, and memory in child processes."""
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
        loaded = {name: load_model(name, work, args.hidden_size, naive=name in args.models) for name in names}
        jobs = [Job(name, contestant) for name in args.models for contestant in CONTESTANTS]
        jobs += [Job(name, "pipeline", dtype) for name in args.storage_models for dtype in storage_dtypes()]
        jobs = list({job.key: job for job in jobs}.values())

        kept = measure_rounds(jobs, loaded, samples, options, work, args, started)
        storage = storage_section(jobs, kept, loaded, samples, args.storage_models)
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
    return {
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
            "padding_efficiency": padding(samples, options),
            "demo_set_samples": everything.num_rows,
            "demo_set_mean_tokens": round(float(np.mean(everything.column("num_tokens").to_numpy())), 1),
            "demo_set_padding_efficiency": padding(everything, options),
        },
        "models": {name: model.facts for name, model in loaded.items()},
        "throughput": {name: throughput(jobs, name, samples, loaded[name].facts) for name in args.models},
        "storage": storage,
        "noise": noise(jobs, args.quiet_cores),
        "memory": memory,
        "tokenization": tokenization,
        "batch_shape": batch_shape,
    }


def _batch_shape_only(args, started: float, load_start) -> int:
    """The batch-shape section alone: tokenize, load the Qwen3.6-shaped model, interleaved rounds."""
    with tempfile.TemporaryDirectory(prefix="hsx-bench-") as tmp:
        work = Path(tmp)
        print("tokenizing the demo conversations ...", file=sys.stderr)
        measure_tokenization(work / "tokenized", 1)
        everything = read_tokenized_shard(work / "tokenized", "shard-00", columns=COLUMNS)
        model = load_model(HEADLINE, work, args.hidden_size, naive=False)
        section = measure_batch_shape(
            model.backbone, model.info, shape_samples(everything, args.shape_samples), int(args.chunk_mb * 2**20),
            work, args.rounds, quiet_cores=args.quiet_cores, max_repeats=args.max_repeats,
            deadline=started + args.budget_s,
        )  # fmt: skip
    results = {
        "date": args.date,
        "machine": machine(args.threads, load_start),
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
    write_results(args.out / f"{args.date}-cpu-batch-shape", results, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
