"""Throughput of the tokenized_dataset step: read, render with the chat template, tokenise, build loss
masks, balance into shards and write Parquet (tokenizer load included).

`measure_tokenization`: the demo conversations, in-process (one worker), for the CPU benchmark's table.

`measure_workers`: ``dataset.tokenize_workers`` 1 against N (default 2) on a generated corpus of about
20,000 conversations (chat and agentic, in the demo's forms). The contestants run interleaved in
rounds, in an order that alternates from round to round; each run records how many cores other
processes kept busy meanwhile, and the speed-up is the median of the per-round ratios (paired, so a
busy round slows both sides). Every run's Parquet output must be byte-identical to the first one's.
``--threaded-baseline`` adds a third contestant, for reference: one worker with the fast tokenizer's
own thread pool left on, as the in-process pass ran before a worker meant one core (it is not a
setting: the benchmark turns the pipeline's switch off for that run). Runs on its own:

    .venv/bin/python -m benchmarks.cpu.tokenization                 # 20,000 conversations, 3 rounds, 1 vs 2
    .venv/bin/python -m benchmarks.cpu.tokenization --conversations 4000 --rounds 1 --workers 2
    .venv/bin/python -m benchmarks.cpu.tokenization --threaded-baseline
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

from benchmarks import REPO
from benchmarks.cpu.models import demo_inputs, demo_model
from benchmarks.shared.measure import median, timed
from hsx_dagster.core.inputs import tokenization, tokenize_dataset
from hsx_dagster.core.settings import DatasetSettings, ModelSettings

THREADED = "1, tokenizer threads on"  # the reference contestant's label
COLUMNS = ["sample_id", "input_ids", "loss_mask", "num_tokens"]
AGENTIC_SHARE = 0.2  # of the generated corpus


def measure_tokenization(out_dir: Path, repetitions: int) -> dict:
    """Tokenise the demo ``repetitions`` times into ``out_dir`` (one shard), the last run stays there."""
    runs = [
        tokenize_dataset(
            DatasetSettings(paths=demo_inputs(), tokenize_workers=1),
            ModelSettings(path=demo_model()),
            out_dir,
            shards=1,
        )
        for _ in range(repetitions)
    ]
    last = runs[-1]
    records = sum(item.records for item in last.inputs)
    seconds = [run.elapsed_s for run in runs]
    return {
        "conversations": records,
        "samples": last.samples,
        "tokens": last.tokens,
        "seconds": seconds,
        "conversations_per_s": round(records / median(seconds), 1),
        "tokens_per_s": round(last.tokens / median(seconds), 1),
    }


def write_corpus(path: Path, conversations: int, seed: int = 7) -> int:
    """About ``conversations`` records as OpenAI JSON Lines: demo chats and agentic records (tools, tool
    calls, reasoning in both forms). Deterministic."""
    from hsx_dagster.demo.agentic import generate_agentic_conversations
    from hsx_dagster.demo.conversations import generate_conversations

    agentic = int(conversations * AGENTIC_SHARE)
    chats = generate_conversations(conversations - agentic, seed)
    records = [{"messages": c} for c in chats] + [
        {"tools": r["tools"], "messages": r["messages"]} for r in generate_agentic_conversations(agentic, seed + 1)
    ]
    with path.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return len(records)


def _output_digest(out_dir: Path) -> str:
    digest = hashlib.sha256()
    for file in [*sorted((out_dir / "samples").glob("*.parquet")), out_dir / "rejects.parquet"]:
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


def _children_cpu() -> float:
    times = os.times()
    return times.children_user + times.children_system


def measure_workers(
    work: Path, conversations: int = 20_000, rounds: int = 3, workers: int = 2, threaded_baseline: bool = False
) -> dict:
    """Workers 1 against ``workers``, interleaved; conversations/s of each, the paired speed-up, the load.
    Every run is a fresh process, as every Dagster run is: a run in a process that already tokenised
    in-process would fork its workers off a heap grown by the earlier run, which costs the workers CPU
    (docs/benchmarks.md)."""
    corpus = work / "corpus.jsonl"
    records = write_corpus(corpus, conversations)
    contestants: tuple[str, ...] = ("1", str(workers), *((THREADED,) if threaded_baseline else ()))
    runs: dict[str, list[dict]] = {label: [] for label in contestants}
    digests = set()
    for round_number in range(rounds):
        order = contestants if round_number % 2 == 0 else contestants[::-1]
        for label in order:
            out = work / f"out-{contestants.index(label)}"
            print(f"  round {round_number + 1}/{rounds}: {label} worker(s) ...", file=sys.stderr)
            runs[label].append(_run_in_fresh_process(corpus, out, label))
            digests.add(_output_digest(out))
    many = str(workers)
    ratios = [one["seconds"] / other["seconds"] for one, other in zip(runs["1"], runs[many])]
    samples = runs["1"][0]["samples"]

    def figures(label: str) -> dict:
        seconds = [run["seconds"] for run in runs[label]]
        return {
            "seconds": [round(s, 2) for s in seconds],
            "conversations_per_s": round(records / median(seconds), 1),
            "cpu_seconds": [round(r["cpu_seconds"], 2) for r in runs[label]],
            "others_cores": [None if r["others_cores"] is None else round(r["others_cores"], 2) for r in runs[label]],
        }

    others = [r["others_cores"] for label in contestants for r in runs[label] if r["others_cores"] is not None]
    result = {
        "conversations": records,
        "samples": samples,
        "rounds": rounds,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "workers": {label: figures(label) for label in contestants},
        "speedup": {"median": round(median(ratios), 3), "per_round": [round(r, 3) for r in ratios]},
        "target_speedup": 1.6,
        "identical_output": len(digests) == 1,
        "others_cores_median": round(median(others), 2) if others else None,
        "others_cores_max": round(max(others), 2) if others else None,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    if threaded_baseline:
        against = [threaded["seconds"] / other["seconds"] for threaded, other in zip(runs[THREADED], runs[many])]
        result["speedup_over_threaded"] = {
            "median": round(median(against), 3),
            "per_round": [round(r, 3) for r in against],
        }
    return result


def _run_in_fresh_process(corpus: Path, out: Path, label: str) -> dict:
    command = [sys.executable, "-m", "benchmarks.cpu.tokenization", "--one-run", label, "--corpus", str(corpus)]
    done = subprocess.run([*command, "--out", str(out)], cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_run(corpus: Path, out: Path, label: str) -> dict:
    """Tokenise ``corpus`` once in this process as contestant ``label``: its seconds, CPU seconds (its
    worker processes included) and the cores other processes kept busy meanwhile."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    model = demo_model()
    count = 1 if label == THREADED else int(label)
    threads = (
        mock.patch.object(tokenization, "tokenizer_threads_off", contextlib.nullcontext)
        if label == THREADED
        else contextlib.nullcontext()
    )
    children = _children_cpu()
    with threads:
        dataset = DatasetSettings(paths=[corpus], tokenize_workers=count)
        run = timed(lambda: tokenize_dataset(dataset, ModelSettings(path=model), out, shards=1))
    # The workers are this run's, not other processes: their CPU (reaped at the pool's shutdown) moves over.
    workers_cpu = _children_cpu() - children
    others = None if run.others_cores is None else max(0.0, run.others_cores - workers_cpu / run.seconds)
    return {
        "seconds": run.seconds,
        "cpu_seconds": run.cpu_seconds + workers_cpu,
        "others_cores": others,
        "samples": getattr(run.result, "samples", 0),
    }


def render_workers(result: dict) -> str:
    """The Markdown lines of the worker comparison."""
    rows = [
        "| workers | conversations/s | seconds per run | CPU seconds per run | others' cores per run |",
        "|---:|---:|---|---|---|",
    ]
    for count, f in result["workers"].items():
        rows.append(
            f"| {count} | {f['conversations_per_s']:,} | {f['seconds']} | {f['cpu_seconds']} | {f['others_cores']} |"
        )
    speedup = result["speedup"]
    threaded = result.get("speedup_over_threaded")
    reference = (
        [
            "",
            f"For reference, {list(result['workers'])[1]} workers against one worker with the tokenizer's thread pool "
            f"on: {threaded['median']}x (per round {threaded['per_round']}).",
        ]
        if threaded
        else []
    )
    return "\n".join(
        [
            f"{result['conversations']:,} generated conversations (chat and agentic; {result['samples']:,} samples), "
            f"{result['rounds']} interleaved rounds on {result['cores']} cores:",
            "",
            *rows,
            "",
            f"Speed-up {speedup['median']}x (median of per-round ratios {speedup['per_round']}; target >= "
            f"{result['target_speedup']}x); output byte-identical across runs: {result['identical_output']}. "
            f"Other processes kept a median {result['others_cores_median']} cores busy (max "
            f"{result['others_cores_max']}); load average at the end {result['load_average']}.",
            *reference,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="dataset.tokenize_workers: 1 against N, interleaved")
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--threaded-baseline",
        action="store_true",
        help="also run one worker with the tokenizer's own thread pool on, for reference",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    # One contestant's run, in the fresh process measure_workers starts for it.
    parser.add_argument("--one-run", metavar="LABEL", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_run:
        print(json.dumps(one_run(args.corpus, args.out, args.one_run)))
        return 0
    import transformers

    transformers.utils.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="hsx-bench-tokenize-") as tmp:
        result = measure_workers(Path(tmp), args.conversations, args.rounds, args.workers, args.threaded_baseline)
    print(render_workers(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0 if result["identical_output"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
