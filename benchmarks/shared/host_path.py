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
- ``pipeline``: `extract_shard` into a shard folder: the device's part and the host path (write, hash, index), then
  the shard checks' scan as the run that wrote it (the writer's digests taken: one hash per byte); chunk files
  written as ``extraction.direct_io: auto`` says for the disk (O_DIRECT on ext4 and xfs);
- ``pipeline buffered``: the same with ``direct_io: off``: buffered writes on the same disk, in the same rounds;
- ``floor``: the same number of bytes as files of ``chunk_mb`` each, written from memory and fsynced, and one sha256
  of each from the same memory: the floor the host path is judged against (one write with fsync, one hash per byte);
- ``plain write``: the same files without the hash;
- ``sha256sum``: the coreutils command over the pipeline's chunk files (just written, so read from the page cache);
- ``previous`` (with ``--previous DIR``, a checkout of an earlier commit): that version's `extract_shard`.

Figures per configuration (medians over rounds): host CPU-seconds per GB stored (pipeline minus device) and that over
the floor's, the same for buffered writes, GB/s stored (bytes over the pipeline's wall time) against the plain
write's, peak RSS of the pipeline beyond the device's, the pipeline's own account of its CPU time by part
(cpu_account.py: thread CPU clocks; the device's parts included), and the cores other processes kept busy meanwhile
(noise from outside the run).
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
from benchmarks.shared.measure import median  # noqa: E402
from benchmarks.shared.report import table, write_results  # noqa: E402


def parts_order() -> tuple[str, ...]:
    """The pipeline's parts in order; imported here, not at the top: a ``previous`` child imports this module before
    it puts the earlier checkout first on sys.path, and must not have imported this checkout's package by then."""
    from hsx_dagster.core.storage import PARTS

    return (*PARTS, "checks", "outside_the_account")


CONTESTANTS = ("device", "pipeline", "pipeline buffered", "floor", "plain write", "sha256sum")
DEVICE_PARTS = ("inputs", "forward", "gather_and_copy", "other_threads")  # what the device contestant also does
INTERLEAVED = 4  # the first four change places every other round; sha256sum reads the pipeline's chunks


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
        order = (
            contestants if round_number % 2 == 0 else [*reversed(contestants[:INTERLEAVED]), *contestants[INTERLEAVED:]]
        )
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
    floor_gb = med("floor", "bytes") / 1e9
    summary["floor_cpu_s_per_gb"] = round(med("floor", "cpu_s") / floor_gb, 3)
    summary["host_over_floor"] = round(summary["host_cpu_s_per_gb"] / summary["floor_cpu_s_per_gb"], 3)
    buffered_gb = med("pipeline buffered", "bytes") / 1e9
    summary["buffered_host_cpu_s_per_gb"] = round(
        (med("pipeline buffered", "cpu_s") - med("device", "cpu_s")) / buffered_gb, 3
    )
    summary["buffered_over_floor"] = round(summary["buffered_host_cpu_s_per_gb"] / summary["floor_cpu_s_per_gb"], 3)
    summary["buffered_gb_per_s"] = round(buffered_gb / med("pipeline buffered", "wall_s"), 4)
    summary["direct_io"] = runs["pipeline"][0].get("direct_io", "")
    summary["checks_bytes_hashed"] = max(run.get("checks_bytes_hashed", 0) for run in runs["pipeline"])
    for name, key in (("pipeline", "parts_per_gb"), ("pipeline buffered", "buffered_parts_per_gb")):
        parts = sorted({part for run in runs[name] for part in run.get("parts_s", {})}, key=list(parts_order()).index)
        gb = med(name, "bytes") / 1e9
        summary[key] = {part: round(median([run["parts_s"].get(part, 0.0) for run in runs[name]]) / gb, 3)
                        for part in parts}  # fmt: skip
        if parts:  # the contestant's CPU time the run's account does not see: the store opened, the rows planned
            outside = median([run["cpu_s"] - sum(run["parts_s"].values()) for run in runs[name]])
            summary[key]["outside_the_account"] = round(outside / gb, 3)
            # the host's own parts, the device's left out: steadier than pipeline minus device on a loaded machine,
            # where the device part's CPU time (PyTorch's pool spinning for cores) moves by several CPU-s/GB
            host = median([run["cpu_s"] - sum(run["parts_s"].get(part, 0.0) for part in DEVICE_PARTS)
                           for run in runs[name]])  # fmt: skip
            prefix = "" if name == "pipeline" else "buffered_"
            summary[f"{prefix}host_parts_cpu_s_per_gb"] = round(host / gb, 3)
            summary[f"{prefix}host_parts_over_floor"] = round(host / gb / summary["floor_cpu_s_per_gb"], 3)
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
        "stored_gb", "host_cpu_s_per_gb", "floor_cpu_s_per_gb", "host_over_floor", "host_parts_cpu_s_per_gb",
        "host_parts_over_floor", "buffered_host_cpu_s_per_gb", "buffered_over_floor",
        "buffered_host_parts_cpu_s_per_gb", "buffered_host_parts_over_floor",
        "previous_host_cpu_s_per_gb", "plain_write_cpu_s_per_gb",
        "pipeline_gb_per_s", "buffered_gb_per_s", "plain_write_gb_per_s", "vs_plain_write", "sha256sum_gb_per_s",
        "previous_gb_per_s", "rss_beyond_device_mb", "previous_rss_beyond_device_mb", "others_cores",
    ]  # fmt: skip
    rows = [
        [f"{entry['config']['hidden']:,} x {entry['config']['slots']} {entry['config']['dtype']}"]
        + [entry["summary"].get(key) for key in keys]
        for entry in results["configs"]
    ]
    headers = [
        "states", "GB", "host CPU-s/GB", "floor CPU-s/GB", "x floor", "host parts CPU-s/GB", "x floor",
        "buffered host CPU-s/GB", "x floor", "buffered host parts", "x floor", "previous", "plain write CPU-s/GB",
        "GB/s", "buffered GB/s", "plain write GB/s", "x plain write", "sha256sum GB/s", "previous GB/s",
        "RSS beyond device (MB)", "previous", "others' cores",
    ]  # fmt: skip
    machine = results["machine"]
    return "\n".join([
        f"# Host path ({results['date']}, {machine['device']}, {machine['cores']} cores)",
        "",
        f"`{results['command']}`: {results['rounds']} rounds, batches of {results['shape']}, chunks of "
        f"{results['chunk_mb']:g} MiB. Host CPU-s/GB: the pipeline's CPU time minus the device's part alone, per "
        "GB stored; host parts: the pipeline's CPU time minus its own account of the device's parts (inputs, "
        "forward, gather_and_copy, other_threads); floor: one write with fsync plus one sha256 of the same bytes, "
        "in the same rounds; x floor: the figure before it over the floor. RSS beyond device: the pipeline's peak "
        "minus the device part's. Medians over rounds; others' cores: the most other processes kept busy during "
        "any run.",
        "",
        table(headers, rows, digits=[0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 2]),
        "",
        "Host CPU-s/GB by part (the pipeline's own account, medians over rounds; the device's parts included: "
        "inputs, forward, gather_and_copy and, on a CPU, other_threads), direct / buffered writes:",
        "",
        parts_table(results),
        "",
    ])  # fmt: skip


def parts_table(results: dict) -> str:
    entries = results["configs"]
    parts = [part for part in parts_order() if any(part in e["summary"].get("parts_per_gb", {}) for e in entries)]
    headers = ["part", *(f"{e['config']['hidden']:,} x {e['config']['slots']} {e['config']['dtype']}" for e in entries)]
    rows = [
        [part, *(f"{e['summary']['parts_per_gb'].get(part, 0):.3f} / "
                 f"{e['summary'].get('buffered_parts_per_gb', {}).get(part, 0):.3f}" for e in entries)]
        for part in parts
    ]  # fmt: skip
    return table(headers, rows)


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
