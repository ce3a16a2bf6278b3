"""A whole Dagster shard run on a wide target that costs nearly nothing to run, against the floor of its bytes (#42).

    .venv/bin/python -m benchmarks.cpu.shard_run_floor                  # 2 GB of bfloat16 states, 1 round
    .venv/bin/python -m benchmarks.cpu.shard_run_floor --gb 4 --rounds 2
    .venv/bin/python -m benchmarks.cpu.shard_run_floor --smoke          # seconds: checks the code

The target is as wide as an 8B model and nearly free to run: a random-weight Llama made from a config (hidden 4,096,
4 decoder layers, one attention head of 64 and one key-value head, MLP of 64) with the demo tokenizer, saved with
save_pretrained under ``--work``; layers [0, 1, 2] and the final norm's output stored in bfloat16, batches of 8,192
tokens x 64 rows, chunks of 256 MiB. The inputs are the demo's OpenAI conversations, as many as make about ``--gb``
GB of states (from the demo's mean length; the GB stored is what the run reports). Each round has a fresh output
folder and Dagster instance whose tokenized_dataset is materialised first (not counted). Contestants, each a child
process measured by the kernel with every process it starts (scale_measure.py: CPU seconds, peak RSS), their order
reversed every other round:

- ``shard run``: ``dagster asset materialize --select hidden_states --partition shard-00``, as a user runs it: the
  extraction step, then the shard checks' step;
- ``nothing left``: the same command again: the shard complete, the model not loaded (process start-up, Dagster,
  the checks of a complete shard);
- ``bare``: an independent forward of the same batches through the same backbone (`run_bare` of
  benchmarks/shared/contestants.py): the process measured whole, and inside it the model load and the forward;
- ``floor``: the bytes the run stores as 256 MiB files written from memory with fsync plus one sha256 of each
  (the host-path benchmark's floor contestant).

Figures per round and their medians: (shard run - nothing left - bare's model load and forward) CPU-s per GB stored,
the floor's CPU-s per GB and their ratio (the goal: within 1.5x), the shard run's peak RSS (its largest process)
over the bare forward's (goal: within 1.5 GB), the run's own ``host CPU per GB`` parts read back from the Dagster
instance (the extraction step's materialization and the checks' ``checks_cpu_s_per_gb``), and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import REPO
from benchmarks.cpu.scale_measure import Measured, run_measured
from benchmarks.cpu.shard_run_floor_report import report, summarise
from benchmarks.shared.host_path_runs import CHILD_FLAG, Config
from benchmarks.shared.report import write_results

BIN = Path(sys.executable).parent
MODULE = ["-m", "hsx_dagster.definitions"]
SHARD = "shard-00"
MEAN_TOKENS = 335  # the demo conversations' mean length in tokens (docs/benchmarks.md): sizes the input to --gb
CONTESTANTS = ("shard run", "bare", "floor")  # "nothing left" runs right after "shard run": it needs its output


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="about this many GB of bfloat16 states stored per run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--decoder-layers", type=int, default=4)
    parser.add_argument("--layers", default="0,1,2", help="stored decoder layers (the final norm's output too)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--chunk-mb", type=float, default=256.0)
    parser.add_argument("--smoke", action="store_true", help="hidden 256, a few conversations: checks the code")
    parser.add_argument("--work", type=Path, default=REPO / "data" / "out" / "shard-run-floor")  # git-ignored
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--report-only", type=Path, help="the report again from a results JSON (its rounds)")
    parser.add_argument("--bare-child", type=Path, help=argparse.SUPPRESS)  # a settings file: the bare contestant
    parser.add_argument("--metadata-child", type=Path, help=argparse.SUPPRESS)  # a Dagster home: read back the run
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden, args.gb, args.chunk_mb, args.rounds = 256, 0.01, 4.0, 1
    return args


def build_target(folder: Path, hidden: int, decoder_layers: int) -> Path:
    """A Llama as wide as ``hidden`` whose forward costs little: one attention head of 64, one key-value head, an
    MLP of 64; the demo tokenizer (vocabulary rounded up to 64, as checkpoints pad it) and its special tokens."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from benchmarks.cpu.models import demo_model

    tokenizer = AutoTokenizer.from_pretrained(demo_model())
    config = LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden, num_hidden_layers=decoder_layers,
        num_attention_heads=1, num_key_value_heads=1, head_dim=64, intermediate_size=64, max_position_embeddings=8192,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)  # type: ignore[arg-type]
    tokenizer.save_pretrained(folder)
    return folder


def conversations_for(gb: float, hidden: int, slots: int) -> int:
    return max(4, round(gb * 1e9 / (slots * hidden * 2) / MEAN_TOKENS))


def prepare_round(root: Path, model: Path, args: argparse.Namespace) -> dict[str, str]:
    """A fresh output folder and Dagster instance, the inputs and the settings file; tokenized_dataset materialised
    (not measured). The environment the round's commands run in."""
    from benchmarks.cpu.models import demo_root

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    layers = [int(k) for k in args.layers.split(",")]
    count = conversations_for(args.gb, args.hidden, len(layers) + 1)
    lines = (demo_root() / "conversations" / "demo_openai.jsonl").read_text(encoding="utf-8").splitlines(True)
    if count > len(lines):
        raise SystemExit(f"--gb {args.gb}: {count} conversations wanted, the demo's OpenAI file has {len(lines)}")
    (root / "conversations.jsonl").write_text("".join(lines[:count]), encoding="utf-8")
    settings = {
        "dataset": {"paths": [str(root / "conversations.jsonl")], "max_length": 4096},
        "model": {"path": str(model), "layers": layers, "include_final": True},
        "shards": 1,
        "output_dir": str(root / "out"),
        "extraction": {
            "devices": ["cpu"], "storage_dtype": "bfloat16", "batch_size": args.batch_size,
            "max_batch_tokens": args.max_batch_tokens, "chunk_mb": args.chunk_mb,
        },
    }  # fmt: skip
    (root / "hsx.yaml").write_text(json.dumps(settings, indent=2), encoding="utf-8")  # JSON is YAML
    home = root / ".dagster_home"
    home.mkdir()
    shutil.copy(REPO / "deploy" / "local" / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "HSX_CONFIG": str(root / "hsx.yaml"), "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO)}
    tokenize = [str(BIN / "dagster"), "asset", "materialize", *MODULE, "--select", "tokenized_dataset"]
    done = subprocess.run(tokenize, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{root}: tokenized_dataset failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return env


def shard_command() -> list[str]:
    return [str(BIN / "dagster"), "asset", "materialize", *MODULE, "--select", "hidden_states", "--partition", SHARD]


def bare_child(settings_file: Path) -> None:
    """The bare contestant, in its own process: the backbone loaded as the shard run loads it, then `run_bare` over
    the tokenized shard's batches. Prints the CPU and wall seconds of the load and of the forward."""
    import resource

    import torch

    from benchmarks.shared.contestants import run_bare
    from hsx_dagster.core.extraction import load_backbone, resolve_compute_dtype
    from hsx_dagster.core.inputs import read_tokenized_shard
    from hsx_dagster.core.model import check_model_dir
    from hsx_dagster.core.settings import load_settings

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    loaded = load_settings(settings_file)
    table = read_tokenized_shard(loaded.tokenized_dir, SHARD, columns=["sample_id", "input_ids", "num_tokens"])
    device = torch.device("cpu")
    started_cpu, started = cpu(), time.perf_counter()
    backbone = load_backbone(
        check_model_dir(loaded.model.path), loaded.layer_ids, include_final=loaded.model.include_final, device=device,
        compute_dtype=resolve_compute_dtype(loaded.extraction.compute_dtype, device),
    )  # fmt: skip
    load_cpu, load_s = cpu() - started_cpu, time.perf_counter() - started
    started_cpu, started = cpu(), time.perf_counter()
    run_bare(backbone.model, table, loaded.extraction)
    forward_cpu, forward_s = cpu() - started_cpu, time.perf_counter() - started
    print(json.dumps({
        "load_cpu_s": round(load_cpu, 3), "load_s": round(load_s, 3), "forward_cpu_s": round(forward_cpu, 3),
        "forward_s": round(forward_s, 3), "tokens": int(table.column("num_tokens").to_numpy().sum()),
        "torch_threads": torch.get_num_threads(),
    }))  # fmt: skip


def metadata_child(home: Path) -> None:
    """What the Dagster instance at ``home`` recorded of the latest shard run: its materialization's host CPU
    metadata and the shard checks' CPU-seconds per GB. Printed as JSON."""
    os.environ["DAGSTER_HOME"] = str(home)
    from dagster import AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance

    instance = DagsterInstance.get()
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey("hidden_states"), asset_partitions=[SHARD]), limit=1
    ).records
    if not records:
        raise SystemExit(f"{home}: no materialization of hidden_states {SHARD}")
    metadata = records[0].asset_materialization.metadata  # type: ignore[union-attr]
    keep = ("host CPU per GB", "host_cpu_s_per_gb", "extraction_cpu_s_per_gb", "chunk writes")
    found = {key: getattr(metadata[key], "value", None) for key in keep if key in metadata}
    checks = {}
    for event in instance.get_records_for_run(
        records[0].run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION
    ).records:
        evaluation: Any = event.event_log_entry.dagster_event.event_specific_data  # type: ignore[union-attr]
        values = {key: getattr(value, "value", None) for key, value in evaluation.metadata.items()}
        checks[evaluation.check_name] = {
            "passed": evaluation.passed,
            **{key: values[key] for key in ("checks_cpu_s_per_gb", "checks_cpu_s", "bytes_hashed") if key in values},
        }
    found["checks"] = checks
    print(json.dumps(found, default=str))


def _child_json(measured: Measured) -> dict:
    """The last line a contestant printed: what it measured inside its own process."""
    return json.loads(measured.output_tail.strip().splitlines()[-1])


def _measured(command: list[str], env: dict[str, str], log: Path, what: str) -> Measured:
    measured = run_measured(command, env=env, cwd=REPO, log=log)
    if measured.returncode != 0:
        raise RuntimeError(f"{what} failed ({measured.returncode}):\n{measured.output_tail}")
    return measured


def last_run(root: Path) -> dict:
    """What the round's shard run recorded in complete.json: the bytes it stored and its extraction's own account
    of its CPU time by part (cpu_account.py)."""
    complete = json.loads((root / "out" / "hidden_states" / SHARD / "complete.json").read_text(encoding="utf-8"))
    run = complete["last_run"]
    if not run["bytes_written"]:
        raise RuntimeError(f"{root}: the shard run stored nothing (complete.json's last_run)")
    return {
        "bytes_stored": int(run["bytes_written"]),
        "bytes_on_disk": int(complete["bytes"]),
        "extraction_cpu_s_per_gb": run["host_cpu_s_per_gb"],
        "direct_io": run["direct_io"],
        "chunks_direct": run["chunks_direct"],
    }


def figures(measured: Measured) -> dict:
    return {
        "cpu_s": measured.cpu_s,
        "wall_s": measured.wall_s,
        "peak_rss_bytes": measured.peak_rss_bytes,
        "load_before": measured.load_before,
        "load_after": measured.load_after,
        "others_cores": measured.others_cores,
        "processes": [
            {"pid": p.pid, "command": p.command[:160], "cpu_s": round(p.cpu_s, 2), "peak_rss_bytes": p.peak_rss_bytes}
            for p in measured.processes
        ],
    }


def run_round(number: int, model: Path, args: argparse.Namespace) -> dict:
    root = args.work / f"round-{number}"
    env = prepare_round(root, model, args)
    python = str(BIN / "python")
    layers = args.layers.split(",")
    tokens = None
    done: dict[str, dict] = {}
    order = CONTESTANTS if number % 2 == 0 else tuple(reversed(CONTESTANTS))
    for name in order:
        log = root / f"{name.replace(' ', '-')}.log"
        print(f"round {number}: {name}", file=sys.stderr, flush=True)
        if name == "shard run":
            # the run's own records are read between the two: the second run writes its own (nothing stored)
            done["shard run"] = figures(_measured(shard_command(), env, root / "shard-run.log", "shard run"))
            done["shard run"].update(last_run(root))
            metadata = subprocess.run(
                [python, "-m", "benchmarks.cpu.shard_run_floor", "--metadata-child", env["DAGSTER_HOME"]],
                env=env, cwd=REPO, capture_output=True, text=True, check=True,
            )  # fmt: skip
            done["shard run"]["metadata"] = json.loads(metadata.stdout.strip().splitlines()[-1])
            done["nothing left"] = figures(_measured(shard_command(), env, root / "nothing-left.log", "nothing left"))
        elif name == "bare":
            command = [python, "-m", "benchmarks.cpu.shard_run_floor", "--bare-child", env["HSX_CONFIG"]]
            measured = _measured(command, env, log, "bare")
            done["bare"] = {**figures(measured), **_child_json(measured)}
            tokens = done["bare"]["tokens"]
        else:
            # the bytes the run stores: every stored vector of every token in bfloat16 (the floor may run first)
            if tokens is None:
                tokens = _tokenized_tokens(env)
            payload = tokens * (len(layers) + 1) * args.hidden * 2
            config = Config(args.hidden, len(layers) + 1, "bfloat16", payload / 1e9, args.chunk_mb,
                            args.max_batch_tokens, args.batch_size)  # fmt: skip
            request = {
                "contestant": "floor",
                "config": config.to_dict(),
                "scratch": str(root / "floor"),
                "previous": "",
            }
            command = [python, str(REPO / "benchmarks" / "shared" / "host_path.py"), CHILD_FLAG, json.dumps(request)]
            measured = _measured(command, env, log, "floor")
            inner = _child_json(measured)
            done["floor"] = {**figures(measured), "inner_cpu_s": inner["cpu_s"], "inner_wall_s": inner["wall_s"],
                             "bytes": inner["bytes"]}  # fmt: skip
            shutil.rmtree(root / "floor", ignore_errors=True)
    shutil.rmtree(root / "out" / "hidden_states", ignore_errors=True)  # GBs: the figures are taken
    return {"round": number, "order": list(order), **done, **summarise(done)}


def _tokenized_tokens(env: dict[str, str]) -> int:
    code = (
        "import sys; from hsx_dagster.core.settings import load_settings; "
        "from hsx_dagster.core.inputs import read_tokenized_shard; "
        "s = load_settings(sys.argv[1]); "
        f"t = read_tokenized_shard(s.tokenized_dir, {SHARD!r}, columns=['num_tokens']); "
        "print(int(t.column('num_tokens').to_numpy().sum()))"
    )
    done = subprocess.run([str(BIN / "python"), "-c", code, env["HSX_CONFIG"]], env=env, cwd=REPO, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return int(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bare_child:
        bare_child(args.bare_child)
        return 0
    if args.metadata_child:
        metadata_child(args.metadata_child)
        return 0
    if args.report_only:
        recorded = json.loads(args.report_only.read_text(encoding="utf-8"))
        rounds = [{**r, **summarise(r)} for r in recorded["rounds"]]
        args.__dict__.update(recorded["settings"])
        results, markdown = report(rounds, args, recorded["command"])
        results["date"] = recorded["date"]
        write_results(args.report_only.with_suffix(""), results, markdown)
        return 0
    command = " ".join(["python -m benchmarks.cpu.shard_run_floor", *(argv if argv is not None else sys.argv[1:])])
    model = args.work / f"target-h{args.hidden}-l{args.decoder_layers}"
    code = (
        "from pathlib import Path; from benchmarks.cpu.shard_run_floor import build_target; "
        f"build_target(Path({str(model)!r}), {args.hidden}, {args.decoder_layers})"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)  # in a child: this process stays small
    rounds = [run_round(number, model, args) for number in range(args.rounds)]
    results, markdown = report(rounds, args, command)
    stem = f"{results['date']}-shard-run-floor" + ("-smoke" if args.smoke else "")
    write_results((args.work if args.smoke else args.results) / stem, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
