"""The shard-run floor benchmark's figures and report (shard_run_floor.py): per round, the host's CPU-seconds per GB
stored by subtraction and by the run's own account, over the floor of the same bytes; their medians and Markdown."""

from __future__ import annotations

import argparse
import datetime
import re

from benchmarks.shared.measure import median
from benchmarks.shared.report import table

GOAL_RATIO, GOAL_RSS_GB = 1.5, 1.5
SETTINGS = ("gb", "rounds", "hidden", "decoder_layers", "layers", "batch_size", "max_batch_tokens", "chunk_mb")


DEVICE_PARTS = ("inputs", "forward", "gather_and_copy", "other_threads")  # a GPU's work; on a CPU, PyTorch's pool


def account_parts(metadata: dict) -> dict[str, float]:
    """The rows of the run's ``host CPU per GB`` table (CPU-s per GB by part)."""
    rows = re.finditer(r"^\| (\w+) \| (-?[\d.]+) \|", str(metadata.get("host CPU per GB", "")), re.MULTILINE)
    return {row[1]: float(row[2]) for row in rows}


def summarise(done: dict) -> dict:
    gb = done["shard run"]["bytes_stored"] / 1e9
    bare = done["bare"]["load_cpu_s"] + done["bare"]["forward_cpu_s"]
    host = done["shard run"]["cpu_s"] - done["nothing left"]["cpu_s"] - bare
    floor = done["floor"]["inner_cpu_s"] / (done["floor"]["bytes"] / 1e9)
    whole_bare = done["shard run"]["cpu_s"] - done["nothing left"]["cpu_s"] - done["bare"]["cpu_s"]
    return {
        "gb_stored": round(gb, 3),
        "host_cpu_s_per_gb": round(host / gb, 3),
        "floor_cpu_s_per_gb": round(floor, 3),
        "over_floor": round(host / gb / floor, 3),
        # the bare contestant's whole process subtracted (its start-up and imports too, which the shard run's
        # start-up already left in "nothing left"): the lower bound
        "host_cpu_s_per_gb_whole_bare": round(whole_bare / gb, 3),
        "rss_over_bare_gb": round((done["shard run"]["peak_rss_bytes"] - done["bare"]["peak_rss_bytes"]) / 1e9, 3),
        "run_reported_cpu_s_per_gb": done["shard run"]["metadata"].get("host_cpu_s_per_gb"),
        **account_host(done, gb, floor),
    }


def account_host(done: dict, gb: float, floor: float) -> dict:
    """The host's parts by the run's own account: every part but the device's and the process start-up (which a
    run with nothing to do pays too), the model load taken out of ``run_setup`` (the bare contestant's), plus the
    checks' step. On a CPU, ``gather_and_copy`` is the device's part the CPU does itself: reported beside."""
    parts = account_parts(done["shard run"]["metadata"])
    if not parts:
        return {}
    checks = done["shard run"]["metadata"].get("checks", {})
    checks_s = max((value.get("checks_cpu_s_per_gb") or 0.0 for value in checks.values()), default=0.0)
    skipped = (*DEVICE_PARTS, "startup_and_dagster")
    host = sum(value for part, value in parts.items() if part not in skipped) + checks_s
    host -= done["bare"]["load_cpu_s"] / gb
    with_gather = host + parts.get("gather_and_copy", 0.0)
    return {
        "account_host_cpu_s_per_gb": round(host, 3),
        "account_over_floor": round(host / floor, 3),
        "account_with_gather_cpu_s_per_gb": round(with_gather, 3),
        "account_with_gather_over_floor": round(with_gather / floor, 3),
    }


def report(rounds: list[dict], args: argparse.Namespace, command: str) -> tuple[dict, str]:
    keys = ("gb_stored", "host_cpu_s_per_gb", "floor_cpu_s_per_gb", "over_floor", "host_cpu_s_per_gb_whole_bare",
            "rss_over_bare_gb", "account_host_cpu_s_per_gb", "account_over_floor",
            "account_with_gather_over_floor")  # fmt: skip
    medians = {key: round(median([r[key] for r in rounds]), 3) for key in keys if all(key in r for r in rounds)}
    results = {
        "date": datetime.date.today().isoformat(),
        "command": command,
        "settings": {key: getattr(args, key) for key in SETTINGS},
        "medians": medians,
        "goals": {"over_floor": GOAL_RATIO, "rss_over_bare_gb": GOAL_RSS_GB},
        "rounds": rounds,
    }
    rows = []
    for r in rounds:
        gb = r["gb_stored"]
        rows.append([
            r["round"], gb, r["shard run"]["cpu_s"], r["nothing left"]["cpu_s"], r["bare"]["load_cpu_s"],
            r["bare"]["forward_cpu_s"], r["bare"]["cpu_s"], r["host_cpu_s_per_gb"], r["floor_cpu_s_per_gb"],
            r["over_floor"], r["host_cpu_s_per_gb_whole_bare"], r["rss_over_bare_gb"], r["shard run"]["wall_s"],
            _others(r),
        ])  # fmt: skip
    last = rounds[-1]["shard run"]["metadata"]
    checks = {name: value.get("checks_cpu_s_per_gb") for name, value in last.get("checks", {}).items()}
    lines = [
        f"# A whole shard run against the floor of its bytes ({results['date']})",
        "",
        f"`{command}`: a Llama {args.hidden} wide ({args.decoder_layers} decoder layers, one head of 64, MLP of 64), "
        f"layers [{args.layers}] + final in bfloat16, batches of {args.max_batch_tokens:,} tokens x {args.batch_size} "
        f"rows, chunks of {args.chunk_mb:g} MiB; CPU seconds of each contestant's process tree (kernel). Host = shard "
        "run - nothing left - bare (model load + forward, measured in its process); floor = one write with fsync plus "
        "one sha256 of the same bytes, in the same round.",
        "",
        table(
            [
                "round",
                "GB stored",
                "shard run CPU-s",
                "nothing left CPU-s",
                "bare load CPU-s",
                "bare forward CPU-s",
                "bare process CPU-s",
                "host CPU-s/GB",
                "floor CPU-s/GB",
                "x floor",
                "host CPU-s/GB (whole bare)",
                "peak RSS over bare GB",
                "shard run wall s",
                "others' cores (min-max)",
            ],
            rows,
            digits=[0, 2, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 1, 0],
        ),
        "",
        f"Medians: host {medians['host_cpu_s_per_gb']} CPU-s/GB, floor {medians['floor_cpu_s_per_gb']}, "
        f"**{medians['over_floor']}x** the floor (goal {GOAL_RATIO}x); peak RSS over the bare forward "
        f"**{medians['rss_over_bare_gb']} GB** (goal {GOAL_RSS_GB}).",
        "",
        "By the run's own account (its parts but the device's and the start-up, less the bare model load, plus the "
        f"checks' step), per round: host {[r.get('account_host_cpu_s_per_gb') for r in rounds]} CPU-s/GB, "
        f"{[r.get('account_over_floor') for r in rounds]}x the floor; with `gather_and_copy` (the device's part a "
        f"CPU does itself) {[r.get('account_with_gather_over_floor') for r in rounds]}x.",
        "",
        "The last round's own account (`host CPU per GB` of its materialization; total "
        f"{last.get('host_cpu_s_per_gb')} "
        f"CPU-s/GB, extraction alone {last.get('extraction_cpu_s_per_gb')}; {last.get('chunk writes')}):",
        "",
        str(last.get("host CPU per GB", "(not recorded)")),
        "",
        f"Shard checks' step, CPU-s per GB the run stored: {checks}.",
        "",
    ]
    return results, "\n".join(lines)


def _others(r: dict) -> str:
    values = [r[k]["others_cores"] for k in ("shard run", "nothing left", "bare", "floor") if r[k]["others_cores"]]
    return f"{min(values):.2f}-{max(values):.2f}" if values else "n/a"
