"""Batch shape: the pipeline with its defaults (``batch_size`` and ``max_batch_tokens`` auto) against
the bare forward pass at each shape of a sweep of fixed shapes, same model, same samples, same
process, interleaved in rounds (the order rotated from round to round).

The figure: auto pipeline / the best bare shape of the sweep, per round (bare seconds of the fastest
shape that round / auto pipeline seconds), median over rounds (target 0.90) and the lowest round
(0.80). The auto runs pay for everything a shard run's extraction step pays for (probe, hooks, copies,
chunk writer, commits); bare pays for nothing but forward passes, at a shape someone chose knowing
the answer.

    .venv/bin/python -m benchmarks.cpu --batch-shape-only              # this section alone
    .venv/bin/python -m benchmarks.cpu --batch-shape-only --shape-samples 2400 --rounds 3
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow as pa

from benchmarks.shared.contestants import run_bare, run_pipeline
from benchmarks.shared.measure import Run, median, timed
from benchmarks.shared.report import table
from hsx_dagster.core.settings import ExtractionSettings

# (rows, tokens): the sweep of the issue that made auto the default, on a 2-core CPU.
CPU_SWEEP = ((64, 2048), (16, 8192), (32, 32768))
# The pipeline at the sweep's fastest shape on the CPUs measured: what the host path costs at a fixed shape, so that
# auto / this is the batch shaper's own figure and this / bare at the same shape the rest of the pipeline's.
PIPELINE_FIXED = (16, 8192)
AUTO = "pipeline auto"
TARGET = 0.90
LOWEST_ROUND = 0.80  # no round below this


@dataclass
class ShapeJob:
    name: str  # "bare 2,048 x 64" or "pipeline auto"
    options: ExtractionSettings
    runs: list[Run] = field(default_factory=list)
    repeats: int = 0

    @property
    def bare(self) -> bool:
        return self.name.startswith("bare")


def shape_samples(table: pa.Table, count: int) -> pa.Table:
    """About ``count`` samples spread evenly over the set (every k-th in sample order): a smaller shard
    of the same length distribution, neutral to any batch shape."""
    step = max(1, table.num_rows // max(1, count))
    return table.take(pa.array(np.arange(0, table.num_rows, step)[:count]))


def measure_batch_shape(
    model,
    info,
    samples: pa.Table,
    chunk_bytes: int,
    work: Path,
    rounds: int,
    sweep=CPU_SWEEP,
    quiet_cores: float = 0.25,
    max_repeats: int = 0,
    deadline: float | None = None,
    execute: Callable | None = None,
    pipeline_fixed: tuple[int, int] | None = PIPELINE_FIXED,
) -> dict:
    """Interleaved rounds of bare at every sweep shape, the pipeline with default options and the pipeline at
    ``pipeline_fixed`` (rows, tokens; None: left out)."""
    jobs = [
        ShapeJob(f"bare {tokens:,} x {rows}", ExtractionSettings(batch_size=rows, max_batch_tokens=tokens))
        for rows, tokens in sweep
    ]
    # no batch settings at all: both auto
    jobs.append(ShapeJob(AUTO, ExtractionSettings(chunk_mb=chunk_bytes / 2**20)))
    if pipeline_fixed is not None:
        rows, tokens = pipeline_fixed
        fixed = ExtractionSettings(batch_size=rows, max_batch_tokens=tokens, chunk_mb=chunk_bytes / 2**20)
        jobs.append(ShapeJob(f"pipeline {tokens:,} x {rows}", fixed))

    def run(job: ShapeJob, table: pa.Table, out: Path):
        if execute is not None:
            return execute(job, table, out)
        if job.bare:
            return run_bare(model, table, job.options)
        return run_pipeline(model, info, table, job.options, out)

    print(f"batch shape: warming up {len(jobs)} runs ...", file=sys.stderr)
    for job in jobs:
        run(job, samples.slice(0, 4), work / "shape-warm-up")
        shutil.rmtree(work / "shape-warm-up", ignore_errors=True)
    for round_number in range(rounds):
        shift = round_number % len(jobs)
        for job in jobs[shift:] + jobs[:shift]:
            out = work / "shape" / f"{job.name.replace(' ', '-')}-{round_number}"
            while True:
                shutil.rmtree(out, ignore_errors=True)
                measured = timed(partial(run, job, samples, out))
                noisy = measured.others_cores is not None and measured.others_cores > quiet_cores
                late = deadline is not None and time.perf_counter() + measured.seconds > deadline
                if not noisy or job.repeats >= max_repeats or late:
                    break
                job.repeats += 1
            job.runs.append(measured)
            shutil.rmtree(out, ignore_errors=True)
        print(f"batch shape: round {round_number + 1}/{rounds} done", file=sys.stderr)
    return summarise(jobs, samples)


def summarise(jobs: list[ShapeJob], samples: pa.Table) -> dict:
    tokens = int(np.sum(samples.column("num_tokens").to_numpy()))
    bare = [job for job in jobs if job.bare]
    auto = next(job for job in jobs if job.name == AUTO)
    fixed = next((job for job in jobs if not job.bare and job.name != AUTO), None)
    rounds = len(auto.runs)
    per_round_best = [min(job.runs[k].seconds for job in bare) for k in range(rounds)]
    ratios = [best / auto.runs[k].seconds for k, best in enumerate(per_round_best)]
    contestants = {}
    for job in jobs:
        seconds = median([r.seconds for r in job.runs])
        entry = {
            "seconds": [round(r.seconds, 3) for r in job.runs],
            "median_s": round(seconds, 3),
            "samples_per_s": round(samples.num_rows / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1),
            "cpu_busy": round(median([r.cpu_seconds / r.seconds for r in job.runs]), 2),
            "others_cores": [None if r.others_cores is None else round(r.others_cores, 3) for r in job.runs],
            "repeats": job.repeats,
        }
        if job is auto:
            reports = [cast(dict, r.result) for r in job.runs]
            entry |= {
                "chosen": [f"{rep['final_max_batch_tokens']:,} x {rep['final_batch_size']}" for rep in reports],
                "probe_s": [rep["batch_shape"]["probe_s"] for rep in reports],
                "probe_overhead_s": [rep["batch_shape"]["probe_overhead_s"] for rep in reports],
                "probe_share": [rep["probe_share"] for rep in reports],
                "probes": [len(rep["batch_shape"]["probes"]) for rep in reports],
                "probe_table_first_round": reports[0]["batch_shape"]["probe_table"],
                # every round's probes: why each began, what it compared, what it chose and why it stopped
                "probes_per_round": [rep["batch_shape"]["probes"] for rep in reports],
                "padding_efficiency": median([rep["padding_efficiency"] for rep in reports]),
            }
        contestants[job.name] = entry
    best_bare = max(bare, key=lambda job: samples.num_rows / median([r.seconds for r in job.runs]))
    others = [r.others_cores for job in jobs for r in job.runs if r.others_cores is not None]
    return {
        "samples": samples.num_rows,
        "tokens": tokens,
        "rounds": rounds,
        "contestants": contestants,
        "best_bare": best_bare.name,
        "auto_over_best_bare": {
            "per_round": [round(r, 3) for r in ratios],
            "median": round(median(ratios), 3),
            "lowest": round(min(ratios), 3),
        },
        "auto_over_each_bare": {
            job.name: round(median([job.runs[k].seconds / auto.runs[k].seconds for k in range(rounds)]), 3)
            for job in bare
        },
        **(_host_path_figures(auto, fixed, bare, rounds) if fixed is not None else {}),
        "target": TARGET,
        "lowest_round_target": LOWEST_ROUND,
        "met": median(ratios) >= TARGET and min(ratios) >= LOWEST_ROUND,
        "others_cores_median": round(median(others), 3) if others else None,
        "others_cores_max": round(max(others), 3) if others else None,
    }


def _paired(numerator: list[float], denominator: list[float]) -> dict:
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return {
        "per_round": [round(r, 3) for r in ratios],
        "median": round(median(ratios), 3),
        "lowest": round(min(ratios), 3),
    }


def _host_path_figures(auto: ShapeJob, fixed: ShapeJob, bare: list[ShapeJob], rounds: int) -> dict:
    """Auto against the pipeline at a fixed shape (the shaper's own figure: probe and choice), and that pipeline
    against bare at the same shape (what the rest of the pipeline costs: hooks, copies, writer, commits)."""
    same = next((job for job in bare if job.options.batch_size == fixed.options.batch_size
                 and job.options.max_batch_tokens == fixed.options.max_batch_tokens), None)  # fmt: skip
    seconds = {job.name: [job.runs[k].seconds for k in range(rounds)] for job in (auto, fixed, *bare)}
    figures = {"pipeline_fixed": fixed.name, "auto_over_pipeline_fixed": _paired(seconds[fixed.name], seconds[AUTO])}
    if same is not None:
        figures["pipeline_fixed_over_bare"] = _paired(seconds[same.name], seconds[fixed.name])
    return figures


def _host_path_lines(section: dict) -> list[str]:
    if "auto_over_pipeline_fixed" not in section:
        return []
    shaper, host = section["auto_over_pipeline_fixed"], section.get("pipeline_fixed_over_bare")
    line = (
        f"Auto / {section['pipeline_fixed']} (the shaper's own figure) per round {shaper['per_round']}, median "
        f"{shaper['median']}"
    )
    if host:
        line += (
            f"; {section['pipeline_fixed']} / bare at the same shape (the rest of the pipeline) per round "
            f"{host['per_round']}, median {host['median']}"
        )
    return [line + ".", ""]


def render_batch_shape(section: dict) -> list[str]:
    rows = []
    for name, f in section["contestants"].items():
        ratio = section["auto_over_best_bare"]["median"] if name == "pipeline auto" else None
        rows.append([name, f["samples_per_s"], f["tokens_per_s"], ratio, f["cpu_busy"], max(f["others_cores"] or [0])])
    auto = section["contestants"]["pipeline auto"]
    lines = [
        "## Batch shape: defaults (auto) against a sweep of fixed shapes",
        "",
        f"{section['samples']:,} demo samples ({section['tokens']:,} tokens), {section['rounds']} interleaved "
        f"rounds, medians; bare = forward passes only at each fixed shape; pipeline auto = extract_shard with no "
        "batch settings (probe included).",
        "",
        table(
            ["contestant", "samples/s", "tokens/s", "x best bare", "cores busy", "others' cores (max)"],
            rows,
            [0, 2, 0, 3, 2, 3],
        ),
        "",
        f"Auto / best bare ({section['best_bare']}) per round: {section['auto_over_best_bare']['per_round']}, "
        f"median **{section['auto_over_best_bare']['median']}**, lowest {section['auto_over_best_bare'].get('lowest')} "
        f"(targets {section['target']} and {section.get('lowest_round_target')}: "
        f"{'met' if section['met'] else 'not met'}); against each shape: {section['auto_over_each_bare']}. "
        f"Other processes kept a median {section['others_cores_median']} cores busy, max "
        f"{section['others_cores_max']}.",
        "",
        *_host_path_lines(section),
        f"Auto chose {', '.join(auto['chosen'])} (per round); probes per run {auto['probes']}, probe time "
        f"{auto['probe_s']} s, lost to slower shapes {auto['probe_overhead_s']} s "
        f"(share of the run {auto['probe_share']}).",
        "",
        "Probe table of the first round (shape -> tokens/s of the forward passes):",
        "",
        table(
            ["probe", "max_batch_tokens", "batch_size", "batches", "tokens/s", "x chosen", "chosen"],
            [
                [
                    r["probe"],
                    r["max_batch_tokens"],
                    r["batch_size"],
                    r["batches"],
                    r["tokens_per_s"],
                    r["vs_chosen"],
                    "yes" if r["chosen"] else "",
                ]
                for r in auto["probe_table_first_round"]
            ],
            [0, 0, 0, 0, 0, 3, 0],
        ),
        "",
    ]
    return lines
