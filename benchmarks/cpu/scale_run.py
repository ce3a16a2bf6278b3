"""The whole pipeline at scale, each step run as a user runs it, its wall time and peak memory measured.

    .venv/bin/python -m benchmarks.cpu.scale_run                        # 2 x 10^4 and 2 x 10^5 conversations
    .venv/bin/python -m benchmarks.cpu.scale_run --sizes 20000 --steps shards,recheck
    .venv/bin/python -m benchmarks.cpu.scale_run --report-only          # the tables from what was measured

For each size: generated conversations (the demo's chats and 1% agentic records with tools, mean about 340 tokens) in
``--files`` JSON Lines files; a tiny random-weight dense Llama (8 layers, hidden ``--hidden``) beside the demo
tokenizer; ``--shards`` shards; layers ``speculators`` with the final state (5 slots, bfloat16), so that both
exports have what they need. The steps, each a child process of this script with its own settings file and
Dagster instance under ``--work``/<size>/:

    observe       dagster job execute -j observe_inputs
    tokenize      dagster asset materialize --select tokenized_dataset
    shard-NN      python -m hsx_dagster.launch shard-NN (one run per shard, one after another: extraction step,
                  then the shard checks step)
    recheck       python -m hsx_dagster.launch shard-00 ... (every shard again, complete: nothing to extract, the
                  checks and the shard table; what the retry sensor or a re-run costs)
    drafter       dagster asset materialize --select drafter_dataset (assembly step, then the drafter checks)
    speculators   dagster asset materialize --select speculators_dataset
    specforge     dagster asset materialize --select specforge_dataset
    report        python -m hsx_dagster.report

Each step's record (wall and CPU seconds of the whole tree, the largest process's peak RSS, every Dagster step's
duration and peak RSS, bytes added under the output folder, the load average before and after, cores other
processes kept busy) is kept in ``<size>/steps.json`` as soon as it ends: a run that stops resumes at the first
step not recorded (``--redo`` measures the selected steps again). The report (scale_report.py) goes to
``benchmarks/results/<date>-scale.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import REPO
from benchmarks.cpu.scale_measure import Measured, peak_of, plain_write_rate, run_measured
from benchmarks.shared.measure import tree_bytes

BIN = Path(sys.executable).parent
DEFAULT_WORK = REPO / "data" / "out" / "scale"  # git-ignored
STEPS = ("observe", "tokenize", "shards", "recheck", "drafter", "speculators", "specforge", "report")
AGENTIC_SHARE = 0.01  # the demo generator's chats average ~330 tokens, its agentic records ~1,100: mean ~340
MODULE = ["-m", "hsx_dagster.definitions"]
WRITING_STEPS = ("drafter", "speculators", "specforge")  # steps under the goal whose bytes written count


def write_inputs(folder: Path, conversations: int, files: int) -> list[Path]:
    """``conversations`` records over ``files`` JSON Lines files (OpenAI messages; tools in the agentic ones)."""
    from hsx_dagster.demo.agentic import generate_agentic_conversations
    from hsx_dagster.demo.conversations import generate_conversations

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(files):
        count = conversations // files + (k < conversations % files)
        agentic = int(count * AGENTIC_SHARE)
        path = folder / f"part-{k:02d}.jsonl"
        paths.append(path)
        if path.is_file():
            continue
        records = [{"messages": c} for c in generate_conversations(count - agentic, 1000 + k)]
        records += [
            {"tools": r["tools"], "messages": r["messages"]} for r in generate_agentic_conversations(agentic, 2000 + k)
        ]
        temporary = path.with_suffix(".tmp")
        with temporary.open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        temporary.replace(path)
    return paths


def build_target(folder: Path, hidden: int) -> Path:
    """A tiny dense Llama with the demo tokenizer (its forward costs little: the steps after it count); Llama's heads
    are hidden / 4 wide, where the demo's Qwen3 heads are 32 wide whatever the hidden size (2x slower here)."""
    if (folder / "config.json").is_file():
        return folder
    from benchmarks.cpu.models import demo_model
    from hsx_dagster.demo.model import build_tiny_model

    build_tiny_model(folder, demo_model(), arch="llama", num_layers=8, hidden_size=hidden, seed=11)
    return folder


def prepare(root: Path, conversations: int, args: argparse.Namespace) -> dict[str, str]:
    """Inputs, settings file and Dagster instance of one size; the environment its steps run in. The inputs and the
    model are made by a child process: this one stays small (scale_measure.py)."""
    model = Path(args.work) / f"model-h{args.hidden}"
    code = (
        "from pathlib import Path; from benchmarks.cpu.scale_run import write_inputs, build_target; "
        f"write_inputs(Path({str(root / 'inputs')!r}), {conversations}, {args.files}); "
        f"build_target(Path({str(model)!r}), {args.hidden})"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    inputs = [root / "inputs" / f"part-{k:02d}.jsonl" for k in range(args.files)]
    settings = {
        "dataset": {"paths": [str(p) for p in inputs], "max_length": 4096},
        "model": {"path": str(model), "layers": "speculators", "include_final": True},
        "shards": args.shards,
        "output_dir": str(root / "out"),
        "extraction": {"storage_dtype": "bfloat16"},
        "drafter": {"parity_samples": 8},
        "export": {"speculators": True, "specforge": True},
    }
    (root / "hsx.yaml").write_text(json.dumps(settings, indent=2), encoding="utf-8")  # JSON is YAML
    home = root / ".dagster_home"
    home.mkdir(exist_ok=True)
    shutil.copy(REPO / "deploy" / "local" / "dagster.yaml", home / "dagster.yaml")
    return {**os.environ, "HSX_CONFIG": str(root / "hsx.yaml"), "DAGSTER_HOME": str(home)}


def commands(shards: int) -> dict[str, list[list[str]]]:
    """Each step's command lines (``shards``: one per shard)."""
    dagster, python = str(BIN / "dagster"), str(BIN / "python")
    keys = [f"shard-{k:02d}" for k in range(shards)]
    materialize = [dagster, "asset", "materialize", *MODULE, "--select"]
    return {
        "observe": [[dagster, "job", "execute", *MODULE, "-j", "observe_inputs"]],
        "tokenize": [[*materialize, "tokenized_dataset"]],
        "shards": [[python, "-m", "hsx_dagster.launch", key] for key in keys],
        "recheck": [[python, "-m", "hsx_dagster.launch", *keys]],
        "drafter": [[*materialize, "drafter_dataset"]],
        "speculators": [[*materialize, "speculators_dataset"]],
        "specforge": [[*materialize, "specforge_dataset"]],
        "report": [[python, "-m", "hsx_dagster.report"]],
    }


def dagster_steps(home: Path, since: float, measured: Measured) -> list[dict]:
    """Every Dagster step of the runs created since ``since``: its run, key, seconds and its process's peak RSS (read
    by a child process: this one stays small, see scale_measure.py)."""
    code = f"from benchmarks.cpu.scale_run import step_events; step_events({str(home)!r}, {since!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    steps = json.loads(done.stdout.strip().splitlines()[-1])
    for step in steps:
        step["peak_rss_bytes"] = peak_of(measured, step.pop("pid")) if step.get("pid") else None
    return steps


def step_events(home: str, since: float) -> None:
    """Prints, as JSON, the steps of the runs created since ``since`` with the pid their STEP_START names."""
    from dagster import DagsterEventType, DagsterInstance, RunsFilter

    os.environ["DAGSTER_HOME"] = home
    steps = []
    with DagsterInstance.get() as instance:
        for record in instance.get_run_records(filters=RunsFilter(created_after=_utc(since)), ascending=True):
            run = record.dagster_run
            starts = {}
            for entry in instance.all_logs(run.run_id):
                event = entry.dagster_event
                if event is None or event.step_key is None:
                    continue
                if event.event_type == DagsterEventType.STEP_START:
                    starts[event.step_key] = (entry.timestamp, event.pid)
                elif event.event_type in (DagsterEventType.STEP_SUCCESS, DagsterEventType.STEP_FAILURE):
                    begun, pid = starts.get(event.step_key, (entry.timestamp, None))
                    steps.append(
                        {
                            "run": run.run_id[:8],
                            "partition": run.tags.get("dagster/partition"),
                            "step": event.step_key,
                            "ok": event.event_type == DagsterEventType.STEP_SUCCESS,
                            "seconds": round(entry.timestamp - begun, 3),
                            "pid": pid,
                        }
                    )
    print(json.dumps(steps))


def _utc(timestamp: float):
    import datetime

    return datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc)


def run_step(root: Path, env: dict[str, str], name: str, argv: list[str], label: str) -> dict:
    out = root / "out"
    out.mkdir(exist_ok=True)
    # the disk's pace for a plain write of this step's bytes, taken now: on a shared machine it moves with the load
    rate = round(plain_write_rate(root, 256 * 2**20)) if name in WRITING_STEPS else None
    before = tree_bytes(out)
    since = time.time() - 1.0
    print(f"[{root.name}] {label}: {' '.join(Path(a).name if a.startswith('/') else a for a in argv)}", flush=True)
    measured = run_measured(argv, env=env, cwd=REPO, log=root / "logs" / f"{label}.log")
    record = {
        "step": name,
        "label": label,
        **{k: v for k, v in asdict(measured).items() if k not in ("processes", "output_tail")},
        "bytes_added": tree_bytes(out) - before,
        "plain_write_bytes_per_s": rate,
        "dagster_steps": dagster_steps(Path(env["DAGSTER_HOME"]), since, measured) if "dagster" in argv[0] or
        "hsx_dagster.launch" in argv else [],
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip
    print(
        f"    {measured.wall_s:.1f} s, {measured.cpu_s:.1f} CPU s, peak RSS {measured.peak_rss_bytes / 1e6:,.0f} MB, "
        f"rc {measured.returncode}, load {measured.load_before[0]:.2f} -> {measured.load_after[0]:.2f}",
        flush=True,
    )
    if measured.returncode != 0:
        print(measured.output_tail, file=sys.stderr)
        raise SystemExit(f"{label} failed (rc {measured.returncode}); log: {root / 'logs' / (label + '.log')}")
    return record


def measure_size(conversations: int, args: argparse.Namespace, selected: list[str]) -> None:
    root = Path(args.work) / str(conversations)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    env = prepare(root, conversations, args)
    state_file = root / "steps.json"
    state: dict[str, Any] = {"conversations": conversations}
    if state_file.is_file():
        state = json.loads(state_file.read_text(encoding="utf-8"))
    settings = {"hidden": args.hidden, "shards": args.shards, "files": args.files}
    if state.setdefault("settings", settings) != settings:
        raise SystemExit(f"{root} was measured with {state['settings']}, not {settings}: another --work, or delete it")
    if "plain_write_bytes_per_s" not in state:
        state["plain_write_bytes_per_s"] = round(plain_write_rate(root))
    records: dict[str, dict] = state.setdefault("steps", {})
    for name, argvs in commands(args.shards).items():
        if name not in selected:
            continue
        for k, argv in enumerate(argvs):
            label = f"shard-{k:02d}" if name == "shards" else name
            if label in records and not args.redo:
                continue
            records[label] = run_step(root, env, name, argv, label)
            state_file.write_text(json.dumps(state, indent=1), encoding="utf-8")
    state_file.write_text(json.dumps(state, indent=1), encoding="utf-8")
    if args.clean_after:
        shutil.rmtree(root / "out", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu.scale_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="20000,200000", help="conversations per size, comma-separated")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"which steps, comma-separated: {','.join(STEPS)}")
    parser.add_argument("--work", default=str(DEFAULT_WORK), help="where inputs, outputs and instances go")
    parser.add_argument("--hidden", type=int, default=16, help="hidden size of the target (16 to 64)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--files", type=int, default=4, help="input files per size")
    parser.add_argument("--redo", action="store_true", help="measure the selected steps again")
    parser.add_argument("--clean-after", action="store_true", help="delete a size's outputs once measured")
    parser.add_argument("--report-only", action="store_true", help="only write the report from steps.json files")
    parser.add_argument("--label", default="", help="a suffix of the report's file name (e.g. before)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="folder of the results")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    selected = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(selected) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {unknown}; choose among {', '.join(STEPS)}")
    if not args.report_only:
        for size in sizes:
            measure_size(size, args, selected)
    from benchmarks.cpu.scale_report import write_report

    write_report(Path(args.work), sizes, args.out, args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
