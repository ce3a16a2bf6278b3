"""Host-path benchmark: what the host does with every byte of hidden states after the forward pass, at a real width.

    python -m benchmarks.shared.host_path                # CPU (make bench): hidden 4,096, 5,120; 4, 6 slots; bf16, fp8
    python -m benchmarks.shared.host_path --device cuda  # on a GPU (make bench-gpu): the device's part on the GPU
    python -m benchmarks.shared.host_path --smoke        # seconds, small widths: checks the code (the tests run it)

A backbone whose forward costs nothing (`FreeBackbone`: views of one random tensor of the real width) feeds
`extract_shard` a shard of generated samples (mean 335 tokens) in a pinned shape (8,192 tokens x 64 rows). On a GPU
the forward of a real model is the expensive part, so what is measured here is exactly what it leaves: whether the
host keeps pace. Contestants, each in a child process of its own (its CPU time and peak RSS are its own), in rounds,
their order reversed every other round:

- ``device``: the same batches through the device's part alone (forward, gather, per-token reductions, fp8, the
  copy into the staging rows), nothing written: what a GPU does, the baseline of the host's own work;
- ``pipeline``: `extract_shard` into a shard folder: the device's part and the host path (write, hash, index);
- ``plain write``: the same number of bytes as files of ``chunk_mb`` each, written from memory and fsynced;
- ``sha256sum``: the coreutils command over the pipeline's chunk files (just written, so read from the page cache);
- ``previous`` (with ``--previous DIR``, a checkout of an earlier commit): that version's `extract_shard`.

Figures per configuration (medians over rounds): host CPU-seconds per GB stored (pipeline minus device), GB/s stored
(bytes over the pipeline's wall time) against the plain write's, peak RSS of the pipeline beyond the device's, and
the cores other processes kept busy meanwhile (noise from outside the run).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script from a checkout (its contestants' children), installed or not

from benchmarks.shared.host_path_runs import CHILD_FLAG, Config, run_child  # noqa: E402
from benchmarks.shared.report import table, write_results  # noqa: E402

CONTESTANTS = ("device", "pipeline", "plain write", "sha256sum")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the device's part of the work runs there)")
    parser.add_argument("--smoke", action="store_true", help="small widths and a few samples: checks the code")
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120])
    parser.add_argument("--slots", type=int, nargs="+", default=[4, 6], help="stored vectors per token, final included")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float8_e4m3"])
    parser.add_argument("--gb", type=float, default=2.0, help="GB of bfloat16 states per run (fp8 stores half)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk-mb", type=float, default=256.0)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--previous", type=Path, default=None, help="a checkout of an earlier commit to compare with")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="where the runs write (default: data/out/ of the repo)"
    )
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    return parser.parse_args(argv)


def configs(args: argparse.Namespace) -> list[Config]:
    if args.smoke:
        return [Config(hidden=256, slots=4, dtype=dtype, gb=0.02, chunk_mb=4.0, max_batch_tokens=1024, batch_size=16,
                       device=args.device) for dtype in ("bfloat16", "float8_e4m3")]  # fmt: skip
    return [
        Config(hidden, slots, dtype, args.gb, args.chunk_mb, args.max_batch_tokens, args.batch_size, args.device)
        for hidden, slots, dtype in itertools.product(args.hidden, args.slots, args.dtypes)
    ]


def measure(config: Config, rounds: int, out_dir: Path, previous: Path | None) -> dict:
    contestants = [*CONTESTANTS, *(["previous"] if previous else [])]
    runs: dict[str, list[dict]] = {name: [] for name in contestants}
    for round_number in range(rounds):
        order = contestants if round_number % 2 == 0 else [*reversed(contestants[:2]), *contestants[2:]]
        with tempfile.TemporaryDirectory(dir=out_dir, prefix="host-path-") as scratch:
            for name in order:
                runs[name].append(run_child(name, config, Path(scratch), previous))
    return {"config": config.to_dict(), "runs": runs, "summary": summarise(runs)}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Medians over rounds of what the report shows."""

    def med(name: str, key: str) -> float:
        values = sorted(run[key] for run in runs[name])
        middle = len(values) // 2
        return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2

    stored_gb = med("pipeline", "bytes") / 1e9
    summary = {
        "stored_gb": round(stored_gb, 3),  # rounded for the report only: the figures below use the bytes
        "host_cpu_s_per_gb": round((med("pipeline", "cpu_s") - med("device", "cpu_s")) / stored_gb, 3),
        "pipeline_gb_per_s": round(stored_gb / med("pipeline", "wall_s"), 4),
        "device_gb_per_s": round(stored_gb / med("device", "wall_s"), 4),
        "plain_write_gb_per_s": round(med("plain write", "bytes") / 1e9 / med("plain write", "wall_s"), 4),
        "plain_write_cpu_s_per_gb": round(med("plain write", "cpu_s") / (med("plain write", "bytes") / 1e9), 3),
        "sha256sum_gb_per_s": round(med("sha256sum", "bytes") / 1e9 / med("sha256sum", "wall_s"), 3),
        "pipeline_peak_rss_mb": round(med("pipeline", "peak_rss") / 2**20),
        "rss_beyond_device_mb": round((med("pipeline", "peak_rss") - med("device", "peak_rss")) / 2**20),
        "others_cores": round(max(run["others_cores"] for name in runs for run in runs[name]), 2),
    }
    summary["vs_plain_write"] = round(
        stored_gb / med("pipeline", "wall_s") / (med("plain write", "bytes") / 1e9 / med("plain write", "wall_s")), 3
    )
    if runs.get("previous"):
        summary["previous_host_cpu_s_per_gb"] = round(
            (med("previous", "cpu_s") - med("device", "cpu_s")) / (med("previous", "bytes") / 1e9), 3
        )
        summary["previous_gb_per_s"] = round(med("previous", "bytes") / 1e9 / med("previous", "wall_s"), 3)
        summary["previous_rss_beyond_device_mb"] = round(
            (med("previous", "peak_rss") - med("device", "peak_rss")) / 2**20
        )
    return summary


def render(results: dict) -> str:
    keys = [
        "stored_gb", "host_cpu_s_per_gb", "previous_host_cpu_s_per_gb", "plain_write_cpu_s_per_gb",
        "pipeline_gb_per_s", "plain_write_gb_per_s", "vs_plain_write", "sha256sum_gb_per_s", "previous_gb_per_s",
        "rss_beyond_device_mb", "previous_rss_beyond_device_mb", "others_cores",
    ]  # fmt: skip
    rows = [
        [f"{entry['config']['hidden']:,} x {entry['config']['slots']} {entry['config']['dtype']}"]
        + [entry["summary"].get(key) for key in keys]
        for entry in results["configs"]
    ]
    headers = [
        "states", "GB", "host CPU-s/GB", "previous", "plain write CPU-s/GB", "GB/s", "plain write GB/s",
        "x plain write", "sha256sum GB/s", "previous GB/s", "RSS beyond device (MB)", "previous", "others' cores",
    ]  # fmt: skip
    machine = results["machine"]
    return "\n".join([
        f"# Host path ({results['date']}, {machine['device']}, {machine['cores']} cores)",
        "",
        f"`{results['command']}`: {results['rounds']} rounds, batches of {results['shape']}, chunks of "
        f"{results['chunk_mb']:g} MiB. Host CPU-s/GB: the pipeline's CPU time minus the device's part alone, per "
        "GB stored. RSS beyond device: the pipeline's peak minus the device part's. Medians over rounds; others' "
        "cores: the most other processes kept busy during any run.",
        "",
        table(headers, rows, digits=[0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 2]),
        "",
    ])  # fmt: skip


def machine(device: str) -> dict:
    import os

    import torch

    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")  # fmt: skip
    return {"device": f"{name} ({model})" if device == "cuda" else model, "cores": len(os.sched_getaffinity(0))}


def main(argv: list[str] | None = None) -> int:
    if argv is None and CHILD_FLAG in sys.argv:
        return run_child_main()
    args = parse_args(argv)
    out_dir = args.out_dir or REPO / "data" / "out"  # git-ignored, on the repository's disk
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.shared.host_path", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(args.device),
        "rounds": args.rounds,
        "shape": f"{args.max_batch_tokens:,} tokens x {args.batch_size} rows",
        "chunk_mb": args.chunk_mb,
        "configs": [
            measure(config, 1 if args.smoke else args.rounds, out_dir, args.previous) for config in configs(args)
        ],
    }
    results["seconds"] = round(time.perf_counter() - started, 1)
    suffix = "host-path-gpu" if args.device == "cuda" else "host-path"
    stem = args.results / f"{results['date']}-{suffix}{'-smoke' if args.smoke else ''}"
    write_results(stem, results, render(results))
    return 0


def run_child_main() -> int:
    """In a child: run one contestant (arguments after the flag, as JSON) and print what it measured."""
    from benchmarks.shared.host_path_runs import contestant_main

    request = json.loads(sys.argv[sys.argv.index(CHILD_FLAG) + 1])
    print(json.dumps(contestant_main(request)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
