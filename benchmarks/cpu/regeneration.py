"""Regeneration throughput against a real OpenAI-compatible server, by `regenerate.concurrency`.

Starts `transformers serve --continuous-batching` on 127.0.0.1 (or uses the server you name with
``--endpoint``, e.g. a vLLM or SGLang server), then regenerates the same demo conversations once per
concurrency level through the `openai` backend (turns: last, greedy, a fixed max_tokens), each into
a fresh folder, and reports conversations/s, generated tokens/s and the machine's load.

The default model is a tiny random-weight Llama built from the demo tokenizer (`--model demo-llama`):
transformers' continuous batching, which lets one server batch concurrent requests, has no cache for
the demo's hybrid linear-attention layers; `--model demo` serves the hybrid demo model without it.

    .venv/bin/python -m benchmarks.cpu.regeneration                       # tiny Llama, continuous batching
    .venv/bin/python -m benchmarks.cpu.regeneration --levels 1 2 4 8 16 32 --conversations 96
    .venv/bin/python -m benchmarks.cpu.regeneration --endpoint http://127.0.0.1:8000/v1 --model /models/Qwen3-8B

Writes benchmarks/results/<date>-regeneration.{json,md} (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import REPO
from hsx_dagster.core.regenerate import OpenAIBackend, regenerate
from hsx_dagster.core.settings import RegenerateSettings

DEMO_MODEL = REPO / "data" / "models" / "tiny-qwen3_5"
DEMO_INPUTS = [REPO / "data" / "conversations" / "demo_openai.jsonl"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [str(Path(sys.executable).parent / "transformers"), "serve", "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", "--dtype", "float32", *extra, str(model)]  # fmt: skip
    with open(log, "ab") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=handle, start_new_session=True,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"transformers serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(process)
    raise RuntimeError("transformers serve did not come up in 300 s")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def resolve_model(name: str, work: Path) -> Path:
    if name == "demo":
        return DEMO_MODEL
    if name == "demo-llama":
        from hsx_dagster.demo.model import build_tiny_model

        out = work / "tiny-llama"
        build_tiny_model(out, DEMO_MODEL, arch="llama", num_layers=6, hidden_size=64, seed=1)
        return out
    return Path(name).resolve()


def conversations_file(count: int, folder: Path) -> Path:
    """The first ``count`` demo conversations (OpenAI form), the same for every level."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "inputs.jsonl"
    lines = []
    with open(DEMO_INPUTS[0], encoding="utf-8") as handle:
        for line in handle:
            if len(lines) == count:
                break
            lines.append(line)
    out.write_text("".join(lines), encoding="utf-8")
    return out


def cpu_busy_share(seconds: float = 1.0) -> float:
    """Share of all CPUs busy over ``seconds`` (from /proc/stat), the machine's load when we start."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return round(1 - (idle1 - idle0) / max(total1 - total0, 1), 3)


def run_level(url: str, model: Path, inputs: Path, level: int, max_tokens: int, work: Path) -> dict:
    options = RegenerateSettings(
        endpoints=[url],
        concurrency=level,
        request_timeout_s=600,
        turns="last",
        max_tokens=max_tokens,
        temperature=0.0,
        top_p=1.0,
        seed=0,
        chunk_conversations=64,
    )
    backend = OpenAIBackend(options, model)
    out = work / f"{inputs.parent.name}-c{level}"
    shutil.rmtree(out, ignore_errors=True)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    summary = regenerate([inputs], model, out, options, backend, progress=lambda line: None)
    wall = time.perf_counter() - started
    run = summary["run"]
    return {
        "concurrency": level,
        "conversations": summary["conversations"],
        "failed": summary["failed"],
        "wall_s": round(wall, 2),
        "generation_s": run["elapsed_s"],
        "conversations_per_s": run["conversations_per_s"],
        "generated_tokens_per_s": run["generated_tokens_per_s"],
        "mean_response_tokens": run["mean_response_tokens"],
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }


def markdown(result: dict) -> str:
    rows = [
        f"# Regeneration throughput by concurrency ({result['date']})",
        "",
        f"Server: {result['server']}; model: `{result['model']}`; {result['conversations']} conversations, "
        f"turns: last, max_tokens {result['max_tokens']}, temperature 0.",
        f"Machine: {result['machine']['cpus']} CPUs ({result['machine']['processor'] or 'unknown'}), "
        f"CPU busy before the run {result['machine']['cpu_busy_share_before']:.0%}, "
        f"load average (1 min) {result['machine']['loadavg_before']}.",
        "",
        "| concurrency | conversations/s | generated tokens/s | speed-up | wall s | load before -> after |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    base = result["levels"][0]["conversations_per_s"] or 1
    for level in result["levels"]:
        rows.append(
            f"| {level['concurrency']} | {level['conversations_per_s']:.2f} | {level['generated_tokens_per_s']:.1f} | "
            f"{level['conversations_per_s'] / base:.2f}x | {level['wall_s']:.1f} | "
            f"{level['loadavg_1m_before']} -> {level['loadavg_1m_after']} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--model", default="demo-llama", help="demo-llama, demo, or a model directory (its tokenizer renders prompts)"
    )
    parser.add_argument("--endpoint", help="an OpenAI-compatible server already running (default: start one)")
    parser.add_argument(
        "--no-continuous-batching", action="store_true", help="start transformers serve without continuous batching"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="hsx-regen-bench-"))
    process = None
    try:
        inputs = conversations_file(args.conversations, work)
        model = resolve_model(args.model, work)
        continuous = not args.no_continuous_batching and args.model != "demo"
        busy = cpu_busy_share()
        load = round(os.getloadavg()[0], 2)
        if args.endpoint:
            url, server = args.endpoint.rstrip("/"), args.endpoint
        else:
            extra = ["--continuous-batching"] if continuous else []
            process, url = start_server(model, work / "server.log", extra)
            server = "transformers serve " + " ".join(["--device cpu --dtype float32", *extra]) + " on 127.0.0.1"
        warm_up = conversations_file(2, work / "warm-up")
        run_level(url, model, warm_up, 2, 4, work)  # the model loaded, the first requests paid
        levels = []
        for level in args.levels:
            levels.append(run_level(url, model, inputs, level, args.max_tokens, work))
            print(json.dumps(levels[-1]), flush=True)
    finally:
        if process is not None:
            stop_server(process)
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "server": server,
        "model": str(args.model),
        "conversations": args.conversations,
        "max_tokens": args.max_tokens,
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
            "cpu_busy_share_before": busy,
            "loadavg_before": load,
        },
        "levels": levels,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{result['date']}-regeneration"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
