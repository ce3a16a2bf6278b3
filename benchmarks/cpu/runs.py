"""The CPU benchmark's runs and figures: the models loaded once, every model x contestant (x storage dtype)
run in interleaved rounds, and the throughput, storage and noise figures computed from those runs."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import transformers

from benchmarks.cpu.models import build_model, describe
from benchmarks.cpu.storage import (
    BASELINE,
    REFERENCE,
    error_summary,
    payload_bytes,
    read_states,
    relative_errors,
    storage_dtypes,
)
from benchmarks.shared.contestants import CONTESTANTS, run_bare, run_naive, run_pipeline
from benchmarks.shared.measure import Run, median, mib, timed, tree_bytes
from hsx_dagster.core.extraction import load_backbone, padding_efficiency, plan_batches
from hsx_dagster.core.model import check_model_dir
from hsx_dagster.core.settings import ExtractionSettings

HEADLINE = "qwen3.6-shaped"  # the model the pipeline / naive target is about, and the memory runs use


ID_MASK_BYTES = 5  # per token: input id (int32) and loss mask (uint8), stored with the states


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


def load_model(name: str, work: Path, hidden_size: int, naive: bool) -> Loaded:
    from transformers import AutoModelForCausalLM

    directory = build_model(name, work, hidden_size)
    facts = describe(name, directory)
    backbone = load_backbone(check_model_dir(directory), facts["layer_ids"])
    backbone.close()  # hooks go on per pipeline run
    facts["kept_layers"] = backbone.info.kept_layers
    facts["backbone_parameters"] = backbone.info.parameters
    causal_lm = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval() if naive else None
    return Loaded(directory, facts, backbone.model, backbone.info, causal_lm)


def measure_rounds(
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


def padding(table: pa.Table, options: ExtractionSettings) -> float:
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


def throughput(jobs: list[Job], name: str, samples: pa.Table, facts: dict) -> dict:
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


def noise(jobs: list[Job], quiet_cores: float) -> dict:
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


def storage_section(
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


def machine(threads: int, load_start) -> dict:
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
