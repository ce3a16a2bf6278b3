"""The drafter training proof (issue #22): speculators' own EAGLE-3 and DFlash draft models, trained on an hsx export
of the demo in a plain CPU loop, learn from it. Per algorithm and storage dtype: the loss curve, and the top-1
agreement with the target's next token on held-out rows, against the same training on auxiliary states shuffled
between samples (the control).

    .venv/bin/python -m benchmarks.trainers [--conversations 160] [--epochs 3]
    -> benchmarks/results/<date>-trainers.{json,md}; figures in docs/benchmarks.md

Runs in the isolated trainer environment (hsx_dagster_tests/trainers/env.py builds it once). Training uses a seeded
loop, so the figures vary only with the machine's floating-point scheduling; the wall times printed vary with its load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hsx_dagster.core.dataset.assembly import assemble
from hsx_dagster.core.export.speculators import export_speculators
from hsx_dagster.core.extraction.shard_run import ShardJob, run_shard
from hsx_dagster.core.inputs.conversations import Conversation, iter_records
from hsx_dagster.core.inputs.tokenization import tokenize_dataset
from hsx_dagster.core.settings import DatasetSettings, ExtractionSettings, ModelSettings
from hsx_dagster_tests.trainers.env import run_script

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data"
LAYERS = (1, 3, 4, 7)  # model.layers: speculators for the demo model


def demo_inputs(out: Path, count: int, max_chars: int = 2400) -> Path:
    """``count`` demo conversations of a few hundred tokens at most, spread over the corpus, as JSONL."""
    records = [r for p in sorted((DEMO / "conversations").glob("demo_*")) for r in iter_records(p)]
    usable = [c for c in records if isinstance(c, Conversation) and sum(len(m.content) for m in c.messages) < max_chars]
    picked = [usable[int(i * (len(usable) - 1) / max(count - 1, 1))] for i in range(count)]
    path = out / "inputs.jsonl"
    path.write_text("".join(json.dumps({"messages": c.as_chat()}) + "\n" for c in picked))
    return path


def build_export(inputs: Path, out: Path, storage_dtype: str) -> Path:
    """Tokenize, extract (one shard, the CPU), assemble and export for speculators: the export folder."""
    model_dir = DEMO / "models" / "tiny-qwen3_5"
    model = ModelSettings(path=model_dir, layers=list(LAYERS), include_final=False)
    tokenize_dataset(DatasetSettings(paths=[inputs], max_length=512), model, out / "tokenized", shards=1)
    extraction = ExtractionSettings(devices=["cpu"], storage_dtype=storage_dtype, batch_size=8, max_batch_tokens=4096)
    run_shard(ShardJob("shard-00", 0, out / "tokenized", out / "hidden_states" / "shard-00", model, LAYERS, extraction))
    assemble(out / "tokenized", out / "hidden_states", ["shard-00"], out / "drafter", val_fraction=0.2, settings={})
    return export_speculators(out / "drafter", out / "tokenized", out / "speculators").path


def train(export: Path, algorithm: str, out: Path, epochs: int, control: bool = False) -> dict[str, Any]:
    result = out / f"{algorithm}-{'control' if control else 'real'}.json"
    args = [export, DEMO / "models" / "tiny-qwen3_5", algorithm, result, "--epochs", epochs, "--max-len", 512]
    run_script("train_drafter.py", *args, *(["--control"] if control else []), timeout=3600)
    return json.loads(result.read_text())


def run_proof(work: Path, conversations: int, epochs: int, algorithms=("eagle3", "dflash")) -> dict[str, Any]:
    """Every algorithm on bf16 (with its control) and on fp8 storage of the same conversations."""
    inputs = demo_inputs(work, conversations)
    exports = {dtype: build_export(inputs, work / dtype, dtype) for dtype in ("bfloat16", "float8_e4m3")}
    runs: dict[str, Any] = {}
    for algorithm in algorithms:
        runs[algorithm] = {
            "bf16": train(exports["bfloat16"], algorithm, work / "bfloat16", epochs),
            "control": train(exports["bfloat16"], algorithm, work / "bfloat16", epochs, control=True),
            "fp8": train(exports["float8_e4m3"], algorithm, work / "float8_e4m3", epochs),
        }
    return {"conversations": conversations, "epochs": epochs, "runs": runs}


def _curve(losses: list[float], points: int = 6) -> str:
    picks = [losses[round(i * (len(losses) - 1) / (points - 1))] for i in range(points)]
    return " -> ".join(f"{x:.3f}" for x in picks)


def markdown(result: dict[str, Any], command: str) -> str:
    lines = [
        f"Command: `{command}` ({result['conversations']} demo conversations, {result['epochs']} epochs, machine "
        f"load {result['load']})",
        "",
        "| drafter | storage | training loss (start -> end) | held-out top-1 agreement | control | ratio | "
        "positions | seconds |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for algorithm, runs in result["runs"].items():
        control = runs["control"]["agreement"]
        for storage in ("bf16", "fp8", "control"):
            run = runs[storage]
            ratio = f"{run['agreement'] / control:.1f}x" if control and storage != "control" else ""
            lines.append(
                f"| {algorithm} | {storage} | {_curve(run['losses'])} | {100 * run['agreement']:.2f}% | "
                f"{100 * control:.2f}% | {ratio} | {run['val_positions']:,.0f} | {run['seconds']:.0f} |"
            )
    later = {a: r["bf16"]["accuracy"] for a, r in result["runs"].items() if "position_2_acc" in r["bf16"]["accuracy"]}
    for algorithm, accuracy in later.items():
        per_position = ", ".join(
            f"{name.removesuffix('_acc').replace('_', ' ')} {100 * value:.2f}%"
            for name, value in sorted(accuracy.items())
            if name.startswith("position_")
        )
        lines += ["", f"{algorithm} bf16 per block position (held out): {per_position}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=160)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        result = run_proof(Path(work), args.conversations, args.epochs)
    result["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    command = f"python -m benchmarks.trainers --conversations {args.conversations} --epochs {args.epochs}"
    stem = args.out / f"{datetime.date.today().isoformat()}-trainers"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    stem.with_suffix(".md").write_text(markdown(result, command))
    print(markdown(result, command))


if __name__ == "__main__":
    main()
