"""Shard runs sharing one host: N shards of the demo launched at once, each with PyTorch's default pool (a thread per
core, as before `extraction.host_threads`) and with `host_threads: auto` (each run's share of the cores).

    python -m benchmarks.cpu.host_share                 # 8 shards at once, and one alone, 2 rounds
    python -m benchmarks.cpu.host_share --shards 4 --rounds 1

Each shard run is a process of its own (`run_shard`, as a shard run of the pipeline is), started together; the
figure is the tokens of every shard over the time from the first start to the last end. The runs are interleaved
by round (default pool, auto, alone), and the machine's load is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import REPO
from benchmarks.cpu.models import demo_inputs, demo_root
from benchmarks.shared.measure import busy_cpu_seconds
from benchmarks.shared.report import table, write_results

MODES = ("default pool", "auto", "alone")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=400, help="of the demo's OpenAI file, in all shards")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--child", nargs=4, metavar=("TOKENIZED", "OUT", "SHARD", "THREADS"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(args: argparse.Namespace) -> None:
    """One shard run, as the pipeline runs it; prints its tokens and when it started and ended."""
    import torch

    from hsx_dagster.core.extraction import ShardJob, run_shard
    from hsx_dagster.core.settings import ExtractionSettings, ModelSettings

    tokenized, out, shard, threads = args.child
    if threads == "default":
        threads = str(torch.get_num_threads())  # PyTorch's pool: one thread per core, whatever else runs
    extraction = ExtractionSettings(
        devices=["cpu"], batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens, host_threads=threads,
        device_lock_dir=Path(out) / "locks",
    )  # fmt: skip
    model = ModelSettings(path=demo_root() / "models" / "tiny-qwen3_5", layers="eagle3")
    layers = (1, 3, 4)
    job = ShardJob(shard, int(shard.split("-")[1]), Path(tokenized), Path(out) / shard, model, layers, extraction)
    started = time.time()
    result = run_shard(job, log_line=lambda message: None)
    print(json.dumps({"started": started, "ended": time.time(), "tokens": result.report.tokens}))


def tokenize(folder: Path, shards: int, conversations: int) -> Path:
    """The first ``conversations`` of the demo's OpenAI file, tokenized into ``shards`` shards."""
    from hsx_dagster.core.inputs import tokenize_dataset
    from hsx_dagster.core.settings import DatasetSettings, ModelSettings

    source = next(path for path in demo_inputs() if path.suffix == ".jsonl")
    subset = folder / "conversations.jsonl"
    subset.write_text("".join(source.read_text(encoding="utf-8").splitlines(keepends=True)[:conversations]))
    out = folder / "tokenized"
    model = ModelSettings(path=demo_root() / "models" / "tiny-qwen3_5")
    tokenize_dataset(DatasetSettings(paths=[subset], max_length=1024), model, out, shards=shards)
    return out


def launch(args: argparse.Namespace, tokenized: Path, folder: Path, shards: list[str], threads: str) -> dict:
    busy, started = busy_cpu_seconds(), time.perf_counter()
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.cpu.host_share", "--batch-size", str(args.batch_size),
             "--max-batch-tokens", str(args.max_batch_tokens), "--child", str(tokenized), str(folder), shard, threads],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for shard in shards
    ]  # fmt: skip
    outputs = []
    for process in children:
        stdout, stderr = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"a shard run failed:\n{stderr[-3000:]}")
        outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    wall = max(o["ended"] for o in outputs) - min(o["started"] for o in outputs)
    tokens = sum(o["tokens"] for o in outputs)
    load = busy_cpu_seconds()
    return {
        "tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "machine_busy_cores": round((load - busy) / (time.perf_counter() - started), 2) if busy and load else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    shard_names = [f"shard-{k:02d}" for k in range(args.shards)]
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    scratch_root = REPO / "data" / "out"  # git-ignored, on the repository's disk
    scratch_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch_root, prefix="host-share-") as scratch:
        tokenized = tokenize(Path(scratch), args.shards, args.conversations)
        for round_number in range(args.rounds):
            for mode in MODES if round_number % 2 == 0 else reversed(MODES):
                folder = Path(scratch) / f"{mode.replace(' ', '-')}-{round_number}"
                names = shard_names[:1] if mode == "alone" else shard_names
                runs[mode].append(
                    launch(args, tokenized, folder, names, "auto" if mode != "default pool" else "default")
                )
    median = {mode: sorted(r["tokens_per_s"] for r in runs[mode])[len(runs[mode]) // 2] for mode in MODES}
    results = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.cpu.host_share", *(argv if argv is not None else sys.argv[1:])]),
        "shards": args.shards,
        "runs": runs,
        "median_tokens_per_s": median,
    }
    rows = [[mode, median[mode], max(r["machine_busy_cores"] or 0 for r in runs[mode])] for mode in MODES]
    markdown = "\n".join([
        f"# Shard runs sharing a host ({results['date']})",
        "",
        f"`{results['command']}`: {args.shards} shards of the demo at once (one alone for reference), batches of "
        f"{args.max_batch_tokens:,} tokens x {args.batch_size} rows; tokens of all shards over the time from the first "
        "start to the last end, median of rounds.",
        "",
        table(["shard runs' threads", "tokens/s together", "busy cores"], rows, digits=[0, 0, 2]),
        "",
    ])  # fmt: skip
    write_results(args.results / f"{results['date']}-host-share", results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
