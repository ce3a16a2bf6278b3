"""`make bench-acceptance`: the acceptance benchmark from scratch to its table, every step cached.

    .venv/bin/python -m benchmarks.acceptance.bench [--size bench|ci] [--seeds 0,1,2] [--jobs 2]
        -> benchmarks/results/<date>-acceptance.{json,md}

1. the target (``target.py``; ``data/acceptance/<size>/``), unless its stamp matches;
2. the drafters' data through the Dagster definitions (``data.py``): bf16, fp8, shifted_layers, all_tokens_mask and
   original_responses, each unless its stamp matches;
3. per algorithm (EAGLE-3, DFlash), variant and seed, a drafter trained by speculators' own code at one budget
   (``train.py``, in the trainer environment), kept when its stamp matches. ``shuffled`` is the control (bf16 data,
   auxiliary states shuffled between samples), ``untrained`` the initialised drafter (the floor);
4. every drafter decoded on the target's held-out prompts (``measure.py``): EAGLE-3 at k = 5 (and 3 and 7 for ours,
   bf16), DFlash at its block; kept when the drafter, the prompts, the decode settings and code are unchanged;
5. the results: a ``summary`` per algorithm and variant (tau at the headline draft length, mean over seeds, its spread,
   ``lossless``), the figures behind it, and the goals of issue #40 judged against them.

Trainings and decodes run ``--jobs`` at a time, one CPU thread each (at these widths one thread per process does more
than two threads on one). The wall times in the results are this machine's at its load (recorded beside them);
tau does not depend on them. One run per root at a time (a lock in it): a second waits, then reuses what the first made.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import fcntl
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import REPO
from benchmarks.acceptance.data import make_variant
from benchmarks.acceptance.stamps import stamp_digest
from benchmarks.acceptance.target import DEFAULT_OUT, HELD_OUT_FILE, build_target
from benchmarks.acceptance.train import STAMP as TRAINING_STAMP
from hsx_dagster_tests.end_to_end.trainers.env import run_trainer_python

HERE = Path(__file__).resolve()
ALGORITHMS = ("eagle3", "dflash")
# the rows of the table: what each shows is in docs/benchmarks.md
VARIANTS = ("bf16", "fp8", "shuffled", "shifted_layers", "all_tokens_mask", "original_responses", "untrained")
DATA_OF = {"shuffled": "bf16", "untrained": "bf16"}  # variants that train on another variant's data
HEADLINE_EAGLE3_K = 5
SWEPT = ("bf16",)  # EAGLE-3's draft lengths (the budget's eagle3_ks) swept for the reference; every row at the headline
DATA_FACTS = ("seconds", "samples", "tokens", "supervised_tokens", "export_rows", "storage_dtype", "layers_stored",
              "layers_claimed", "speculators_data_path")  # fmt: skip
MEASURE_VERSION = 1  # bump when a change to the decode's settings here changes what a measurement means


@dataclass(frozen=True)
class Budget:
    """One budget for every row: what the drafters train on and for how long, and how they are measured."""

    conversations: int  # training conversations whose answers the target regenerates (the drafters' data)
    eagle3_steps: int  # optimizer steps per drafter (a DFlash step costs a fraction of an EAGLE-3 step's 3 unrolled)
    dflash_steps: int
    batch_tokens: int
    eagle3_lr: float
    dflash_lr: float
    ttt_steps: int  # EAGLE-3: draft steps unrolled in training
    block_size: int  # DFlash: block - 1 drafts per pass
    dflash_layers: int  # DFlash's draft decoder layers (speculators' recipe: 5; EAGLE-3 has one)
    prompts: int | None  # held-out prompts decoded (None: all of them)
    max_new_tokens: int
    eagle3_ks: tuple[int, ...]  # EAGLE-3's draft lengths for the reference (SWEPT), the headline among them


BUDGETS = {
    "bench": Budget(conversations=1200, eagle3_steps=200, dflash_steps=400, batch_tokens=512, eagle3_lr=3e-3,
                    dflash_lr=1e-3, ttt_steps=3, block_size=6, dflash_layers=5, prompts=100, max_new_tokens=32,
                    eagle3_ks=(3, 5, 7)),
    "ci": Budget(conversations=240, eagle3_steps=120, dflash_steps=600, batch_tokens=512, eagle3_lr=3e-3,
                 dflash_lr=1e-3, ttt_steps=3, block_size=4, dflash_layers=5, prompts=24, max_new_tokens=32,
                 eagle3_ks=(5,)),
}  # fmt: skip


def _code_digest(*modules: str) -> str:
    return stamp_digest(*((HERE.parent / name).read_text() for name in modules))


def _trainer(*args: object, timeout: float, tolerated: str | None = None) -> str:
    """``python *args`` in the trainer environment; its stdout, or an error with both streams' tails unless it
    failed with ``tolerated`` in its stderr."""
    done = run_trainer_python(*args, timeout=timeout)
    if done.returncode != 0 and (tolerated is None or tolerated not in done.stderr):
        raise RuntimeError(f"{' '.join(map(str, args[:2]))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done.stdout


def training_arguments(algorithm: str, budget: Budget) -> list[object]:
    """``train.py``'s budget for the algorithm: the same for every variant and seed."""
    if algorithm == "eagle3":
        return ["--steps", budget.eagle3_steps, "--lr", budget.eagle3_lr, "--ttt-steps", budget.ttt_steps,
                "--batch-tokens", budget.batch_tokens]  # fmt: skip
    return ["--steps", budget.dflash_steps, "--lr", budget.dflash_lr, "--block-size", budget.block_size,
            "--layers", budget.dflash_layers, "--batch-tokens", budget.batch_tokens]  # fmt: skip


def train_drafter(target: Path, export: Path, algorithm: str, variant: str, seed: int, budget: Budget,
                  out: Path) -> str:  # fmt: skip
    """A drafter of the variant, by speculators' own code (``train.py`` keeps one whose stamp matches); returns
    ``train.py``'s last line (what it did)."""
    extra = {"shuffled": ["--control"], "untrained": ["--untrained"]}.get(variant, [])
    stdout = _trainer("-m", "benchmarks.acceptance.train", "--export", export, "--target", target / "model",
                      "--algorithm", algorithm, "--out", out, "--seed", seed, *training_arguments(algorithm, budget),
                      "--threads", 1, *extra, timeout=7200)  # fmt: skip
    return stdout.strip().splitlines()[-1]


def measure_drafter(target: Path, checkpoint: Path, prompts: Path, budget: Budget, ks: Sequence[int],
                    out: Path) -> dict[str, Any]:  # fmt: skip
    """``measure.py`` on the held-out prompts; a measurement of the same drafter (its training stamp), prompts and
    settings is read back instead of decoded again. A decode that differs from greedy is recorded, not fatal: the
    ``lossless`` counts carry it into the summary."""
    settings = {"k": ",".join(map(str, ks)), "max_new_tokens": budget.max_new_tokens, "limit": budget.prompts}
    drafter = json.loads((checkpoint / TRAINING_STAMP).read_text())["stamp"]
    made = stamp_digest(MEASURE_VERSION, drafter, hashlib.sha256(prompts.read_bytes()).hexdigest(), settings,
                   _code_digest("decode.py", "measure.py"))  # fmt: skip
    stamp, result = out / ".measure-stamp.json", out / "acceptance.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("stamp") == made and result.is_file():
        return {**json.loads(result.read_text()), "kept": True}
    stamp.unlink(missing_ok=True)
    limit = ["--limit", budget.prompts] if budget.prompts else []
    _trainer("-m", "benchmarks.acceptance.measure", "--target", target / "model", "--drafter", checkpoint,
             "--prompts", prompts, "--k", settings["k"], "--max-new-tokens", budget.max_new_tokens, "--threads", 1,
             "--out", out, *limit, timeout=7200, tolerated="NOT LOSSLESS")  # fmt: skip
    stamp.write_text(json.dumps({"stamp": made}) + "\n")
    return dict(json.loads(result.read_text()))


def headline_k(algorithm: str, budget: Budget) -> int:
    return HEADLINE_EAGLE3_K if algorithm == "eagle3" else budget.block_size - 1


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def aggregate(measured: dict[tuple[str, str, int], dict[str, Any]], budget: Budget) -> dict[str, Any]:
    """The summary (headline tau per algorithm and variant over seeds) and the full figures per k."""
    summary: dict[str, Any] = {}
    figures: dict[str, Any] = {}
    for algorithm in dict.fromkeys(a for a, _, _ in measured):
        summary[algorithm], figures[algorithm] = {}, {}
        for variant in VARIANTS:
            seeds = sorted(seed for a, v, seed in measured if (a, v) == (algorithm, variant))
            if not seeds:
                continue
            runs = [measured[(algorithm, variant, seed)]["summary"] for seed in seeds]
            per_k: dict[str, Any] = {}
            for k in runs[0]:
                lines = [run[k] for run in runs]
                positions = [statistics.fmean(line["acceptance_per_position"][j] for line in lines)
                             for j in range(int(k))]  # fmt: skip
                per_k[k] = {
                    "tau": _spread([line["tau_micro"] for line in lines]),
                    "tau_per_seed": {str(s): line["tau_micro"] for s, line in zip(seeds, lines)},
                    "tau_macro": statistics.fmean(line["tau_macro"] for line in lines),
                    "acceptance_per_position": positions,
                    "draft_cost_per_token": statistics.fmean(line["draft_cost_per_token"] for line in lines),
                    "implied_speedup": statistics.fmean(line["implied_speedup"] for line in lines),
                    "wall_speedup": statistics.fmean(line["wall_speedup"] for line in lines),
                    "lossless": [sum(line["lossless"][i] for line in lines) for i in (0, 1)],
                }
            k = str(headline_k(algorithm, budget))
            head = per_k[k]
            every_k = [line["lossless"] for line in per_k.values()]
            summary[algorithm][variant] = {
                "tau": head["tau"]["mean"],
                "tau_min": head["tau"]["min"],
                "tau_max": head["tau"]["max"],
                "k": int(k),
                "lossless": [sum(c[0] for c in every_k), sum(c[1] for c in every_k)],  # every k's decodes
                "seeds": seeds,
            }
            figures[algorithm][variant] = per_k
    return {"summary": summary, "figures": figures}


def judge(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue #40's goals, each with the figures it was judged on."""
    goals = []
    for algorithm, rows in summary.items():
        if "bf16" not in rows:
            continue
        ours = rows["bf16"]
        if "shuffled" in rows:
            control = rows["shuffled"]
            goals.append({"goal": f"{algorithm}: tau >= 2.0 and >= 1.5x the shuffled control's",
                          "met": ours["tau"] >= 2.0 and ours["tau"] >= 1.5 * control["tau"],
                          "figures": {"tau": ours["tau"], "control": control["tau"],
                                      "ratio": ours["tau"] / control["tau"]}})  # fmt: skip
        if "fp8" in rows:
            fp8 = rows["fp8"]["tau"]
            gap = abs(fp8 - ours["tau"]) / ours["tau"]
            goals.append({"goal": f"{algorithm}: fp8 within 2% of bf16", "met": gap <= 0.02,
                          "figures": {"fp8": fp8, "bf16": ours["tau"], "relative_gap": gap}})  # fmt: skip
        if "shifted_layers" in rows:
            shifted = rows["shifted_layers"]["tau"]
            spread = max(row["tau_max"] - row["tau_min"] for row in (ours, rows["shifted_layers"]))
            goals.append({"goal": f"{algorithm}: shifted layers below ours by more than the spread over seeds",
                          "met": ours["tau"] - shifted > spread,
                          "figures": {"bf16": ours["tau"], "shifted_layers": shifted, "spread": spread}})  # fmt: skip
    checked = [row["lossless"] for rows in summary.values() for row in rows.values()]
    equal, total = sum(c[0] for c in checked), sum(c[1] for c in checked)
    goals.append({"goal": "every held-out decode equals the target's greedy output", "met": equal == total,
                  "figures": {"equal": equal, "checked": total}})  # fmt: skip
    return goals


def run(size: str, seeds: Sequence[int], jobs: int, root: Path, variants: Sequence[str] = VARIANTS,
        until: str = "results", algorithms: Sequence[str] = ALGORITHMS,
        log: Any = print) -> dict[str, Any]:  # fmt: skip
    """The steps up to ``until`` (target, data or results) for ``variants``; returns the results (or {})."""
    budget = BUDGETS[size]
    started = time.perf_counter()
    timings: dict[str, float] = {}
    target_report = build_target(root, size, log=log)
    timings["target"] = round(time.perf_counter() - started, 1)
    if until == "target":
        return {}

    def make(variant: str) -> dict[str, Any]:
        return make_variant(root, variant, root / "data", budget.conversations, log=log)

    needed = list(dict.fromkeys(DATA_OF.get(v, v) for v in variants))
    data_reports = {needed[0]: make(needed[0])}  # first alone: the others start from its regenerated answers
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:  # each step is a CLI subprocess
        data_reports.update(zip(needed[1:], pool.map(make, needed[1:])))
    timings["data"] = round(time.perf_counter() - started - timings["target"], 1)
    if until == "data":
        return {}

    # one folder per algorithm's budget: another budget's drafters are neither overwritten nor taken for these
    drafters = {a: root / "drafters" / f"{a}-{stamp_digest(training_arguments(a, budget))[:12]}" for a in ALGORITHMS}
    prompts = root / HELD_OUT_FILE
    cases = [(a, v, s) for s in seeds for a in algorithms for v in variants]

    def one(case: tuple[str, str, int]) -> dict[str, Any]:
        algorithm, variant, seed = case
        export = Path(data_reports[DATA_OF.get(variant, variant)]["speculators_data_path"])
        name = f"{algorithm}-{variant}-seed{seed}"
        checkpoint = drafters[algorithm] / f"{variant}-seed{seed}"
        log(train_drafter(root, export, algorithm, variant, seed, budget, checkpoint))
        ks = budget.eagle3_ks if variant in SWEPT else (HEADLINE_EAGLE3_K,)  # DFlash: its block, whatever ks says
        measured_in = checkpoint.with_name(checkpoint.name + "-measure")
        result = measure_drafter(root, checkpoint, prompts, budget, ks, measured_in)
        line = result["summary"][str(headline_k(algorithm, budget))]
        kept = "measurement kept, " if result.get("kept") else ""
        log(f"{name}: {kept}tau {line['tau_micro']:.3f} at k={line['k']}, lossless {line['lossless']}")
        return result

    measured: dict[tuple[str, str, int], dict[str, Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:  # each case is two subprocesses
        for case, result in zip(cases, pool.map(one, cases)):
            measured[case] = result
    timings["drafters"] = round(time.perf_counter() - started - timings["target"] - timings["data"], 1)
    timings["total"] = round(time.perf_counter() - started, 1)

    results = aggregate(measured, budget)
    training = {f"{a}-{v}-seed{s}": _training_facts(drafters[a] / f"{v}-seed{s}") for a, v, s in cases}
    return {
        "summary": results["summary"],
        "goals": judge(results["summary"]),
        "figures": results["figures"],
        "size": size,
        "budget": asdict(budget),
        "seeds": list(seeds),
        "headline_k": {a: headline_k(a, budget) for a in algorithms},
        "target": {key: target_report[key] for key in ("recipe", "model", "corpus", "training", "held_out", "greedy")},
        "data": {variant: {key: report[key] for key in DATA_FACTS} for variant, report in data_reports.items()},
        "training": training,
        "prompts": {
            "file": str(prompts),
            "decoded": next(iter(measured.values()))["prompts"],
            "max_new_tokens": budget.max_new_tokens,
        },
        "seconds": timings,
        "machine": {"cpus": os.cpu_count(), "jobs": jobs, "load_average_at_end": os.getloadavg()},
    }


def _training_facts(checkpoint: Path) -> dict[str, Any]:
    record = json.loads((checkpoint / TRAINING_STAMP).read_text())
    losses = record.get("losses") or []
    return {"checkpoint": str(checkpoint), "steps": len(losses), "first_loss": losses[0] if losses else None,
            "last_loss": statistics.fmean(losses[-20:]) if losses else None, "seconds": round(record["seconds"], 1),
            "train_rows": record.get("train_rows")}  # fmt: skip


def markdown(result: dict[str, Any], command: str) -> str:
    ks = result["headline_k"]
    lines = [
        f"# Acceptance length of drafters trained on our data ({result['size']} target)",
        "",
        f"`{command}`; seeds {result['seeds']}; {result['prompts']['decoded']} held-out prompts, up to "
        f"{result['prompts']['max_new_tokens']} new tokens each; budget {json.dumps(result['budget'])}.",
        "",
        f"Target: {result['target']['model']['parameters']:,} parameters, held-out perplexity "
        f"{result['target']['held_out']['perplexity']} (unigram {result['target']['held_out']['unigram_perplexity']}), "
        f"{result['target']['greedy']['distinct_tokens_per_100']} distinct tokens per 100 generated.",
        "",
    ]
    for algorithm, rows in result["summary"].items():
        k = ks[algorithm]
        lines += [f"## {algorithm} (headline k = {k})", "",
                  "| data | tau (mean over seeds) | min-max | per seed | acceptance by position | draft cost / target "
                  "forward | implied speedup | lossless |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for variant, row in rows.items():
            line = result["figures"][algorithm][variant][str(k)]
            seeds = ", ".join(f"{tau:.2f}" for tau in line["tau_per_seed"].values())
            positions = " ".join(f"{p:.2f}" for p in line["acceptance_per_position"])
            lines.append(f"| {variant} | **{row['tau']:.3f}** | {row['tau_min']:.3f}-{row['tau_max']:.3f} | {seeds} | "
                         f"{positions} | {line['draft_cost_per_token']:.2f} | {line['implied_speedup']:.2f}x | "
                         f"{row['lossless'][0]}/{row['lossless'][1]} |")  # fmt: skip
        swept = result["budget"]["eagle3_ks"]
        if algorithm == "eagle3" and len(swept) > 1:
            lines += ["", "tau by draft length (mean over seeds):", "",
                      "| data | " + " | ".join(f"k = {k}" for k in swept) + " |",
                      "|---|" + "---|" * len(swept)]  # fmt: skip
            for variant in rows:
                per_k = result["figures"][algorithm][variant]
                cells = [f"{per_k[str(k)]['tau']['mean']:.3f}" if str(k) in per_k else "-" for k in swept]
                lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Goals", ""]
    for goal in result["goals"]:
        figures = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in goal["figures"].items())
        lines.append(f"- {'met' if goal['met'] else '**not met**'}: {goal['goal']} ({figures})")
    seconds = result["seconds"]
    load = ", ".join(f"{x:.1f}" for x in result["machine"]["load_average_at_end"])
    lines += ["", f"Wall time: {seconds['total'] / 60:.1f} min (target {seconds['target']:.0f} s, data "
              f"{seconds['data']:.0f} s, drafters {seconds['drafters']:.0f} s; a cached step counts its reading only); "
              f"load average at the end {load}.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acceptance.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(BUDGETS), default="bench")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the table's rows (default: all)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="eagle3, dflash or both (default)")
    parser.add_argument("--until", choices=("target", "data", "results"), default="results",
                        help="stop after building the target, or the data")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="trainings and decodes at a time (one thread each)")
    parser.add_argument("--root", type=Path, default=None, help=f"the target's folder (default {DEFAULT_OUT}/<size>)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = (args.root or DEFAULT_OUT / args.size).resolve()
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; expected some of {', '.join(VARIANTS)}")
    algorithms = [a for a in ALGORITHMS if a in args.algorithms.split(",")]
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".bench.lock").open("w") as lock:
        # one run per root at a time: a second (CI builds the target and data ahead of the test that reads them)
        # waits here, then finds every step it shares up to date
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = run(
            args.size, seeds, args.jobs, root, variants, args.until, algorithms, lambda s: print(s, flush=True)
        )
    if not result:
        return 0
    command = f"python -m benchmarks.acceptance.bench --size {args.size} --seeds {args.seeds}"
    if variants != list(VARIANTS):
        command += f" --variants {args.variants}"
    if algorithms != list(ALGORITHMS):
        command += f" --algorithms {args.algorithms}"
    stem = args.out / f"{datetime.date.today().isoformat()}-acceptance{'' if args.size == 'bench' else '-' + args.size}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({**result, "command": command}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(result, command))
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
