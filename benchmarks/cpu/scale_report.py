"""The scale run's tables (scale_run.py): every step's wall time and peak RSS at each size, how each grew, the
10^6 figure extrapolated, and the goals of #33 for the steps after the forward.

Rows: the command of each step, and the Dagster steps inside it that matter (a shard run's extraction and its
checks; the drafter run's assembly and its checks). Growth is the larger size's figure over the smaller's, beside
the ratio of the sizes (at most linear: growth <= that ratio). The extrapolation to 10^6 conversations is the
straight line through the two sizes. The time goal at the larger size: 2 minutes plus the time a plain write of the
bytes the step added under the output folder would take at the rate measured on the same disk in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.shared.report import table, write_results

TARGET_N = 1_000_000
GOAL_EXTRA_S = 120.0
GOAL_RSS = 2 * 10**9
EXEMPT = ("tokenize", "shard runs", "shard extraction")  # tokenization and extraction are not under the goal
MB = 1e6


def load_sizes(work: Path, sizes: list[int]) -> dict[int, dict]:
    found = {}
    for size in sizes:
        path = work / str(size) / "steps.json"
        if path.is_file():
            found[size] = json.loads(path.read_text(encoding="utf-8"))
    return found


def _dagster(state: dict, label: str, predicate: Callable[[str], bool]) -> list[dict]:
    record = state["steps"].get(label)
    return [s for s in record["dagster_steps"] if predicate(s["step"])] if record else []


def _command_row(state: dict, label: str) -> dict | None:
    record = state["steps"].get(label)
    if record is None:
        return None
    return {
        "seconds": record["wall_s"],
        "cpu_s": record["cpu_s"],
        "rss": record["peak_rss_bytes"],
        "bytes": record["bytes_added"],
        "load": record["load_before"][0],
        "others": record["others_cores"],
        "rate": record.get("plain_write_bytes_per_s"),
    }


def _sum_rows(rows: list[dict]) -> dict | None:
    if not rows:
        return None
    return {
        "seconds": round(sum(r["seconds"] for r in rows), 3),
        "cpu_s": round(sum(r.get("cpu_s") or 0.0 for r in rows), 2),
        "rss": max(r.get("rss") or 0 for r in rows),
        "bytes": sum(r.get("bytes") or 0 for r in rows),
        "load": max(r.get("load") or 0.0 for r in rows),
        "others": max((r.get("others") or 0.0 for r in rows), default=None),
    }


def _steps_as_rows(steps: list[dict]) -> list[dict]:
    return [{"seconds": s["seconds"], "rss": s["peak_rss_bytes"]} for s in steps]


def figures(state: dict) -> dict[str, dict | None]:
    """One size's rows: name -> seconds, CPU seconds, peak RSS, bytes added, load."""
    shard_labels = sorted(label for label in state["steps"] if label.startswith("shard-"))
    shard_runs = [r for r in (_command_row(state, label) for label in shard_labels) if r]

    def inside(label_or_labels, predicate) -> list[dict]:
        labels = label_or_labels if isinstance(label_or_labels, list) else [label_or_labels]
        return [s for label in labels for s in _dagster(state, label, predicate)]

    extraction = inside(shard_labels, lambda key: key.startswith("extract_"))
    checks = inside(shard_labels, lambda key: key.startswith("check_"))
    rows = {
        "observe": _command_row(state, "observe"),
        "tokenize": _command_row(state, "tokenize"),
        "shard runs": _sum_rows(shard_runs),
        "shard extraction": _sum_rows(_steps_as_rows(extraction)),
        "shard checks": _sum_rows(_steps_as_rows(checks)),
        "recheck (complete shards)": _command_row(state, "recheck"),
        "recheck: shard checks": _sum_rows(_steps_as_rows(inside("recheck", lambda k: k.startswith("check_")))),
        "drafter run": _command_row(state, "drafter"),
        "assembly": _sum_rows(_steps_as_rows(inside("drafter", lambda key: key == "drafter_dataset"))),
        "drafter checks": _sum_rows(_steps_as_rows(inside("drafter", lambda key: key != "drafter_dataset"))),
        "speculators export": _command_row(state, "speculators"),
        "specforge export": _command_row(state, "specforge"),
        "report": _command_row(state, "report"),
    }
    if rows["shard runs"] is not None and shard_runs:
        rows["shard runs"]["per_shard_max_s"] = max(r["seconds"] for r in shard_runs)
    return rows


def _line(n1: int, v1: float | None, n2: int, v2: float | None, n: int) -> float | None:
    if v1 is None or v2 is None or n2 == n1:
        return None
    return v2 + (v2 - v1) / (n2 - n1) * (n - n2)


def compare(states: dict[int, dict]) -> list[dict]:
    """One entry per row: the figures at each size, growth, 10^6 extrapolated, the goal at the larger size."""
    sizes = sorted(states)
    per_size = {size: figures(states[size]) for size in sizes}
    entries = []
    for name in per_size[sizes[0]]:
        entry: dict = {"step": name, "sizes": {str(n): per_size[n][name] for n in sizes}}
        if len(sizes) >= 2:
            n1, n2 = sizes[0], sizes[-1]
            a, b = per_size[n1][name], per_size[n2][name]
            if a and b:
                rate = b.get("rate") or states[n2]["plain_write_bytes_per_s"]
                budget = GOAL_EXTRA_S + (b.get("bytes") or 0) / rate
                entry |= {
                    "size_ratio": round(n2 / n1, 2),
                    "time_growth": round(b["seconds"] / a["seconds"], 2) if a["seconds"] else None,
                    "rss_growth": round(b["rss"] / a["rss"], 2) if a.get("rss") else None,
                    "seconds_1e6": _round(_line(n1, a["seconds"], n2, b["seconds"], TARGET_N), 1),
                    "rss_1e6": _round(_line(n1, a.get("rss"), n2, b.get("rss"), TARGET_N), 0),
                    "budget_s": round(budget, 1),
                    "within_time": None if name in EXEMPT else b["seconds"] <= budget,
                    "within_rss": None if name in EXEMPT else (b.get("rss") or 0) <= GOAL_RSS,
                }
        entries.append(entry)
    return entries


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def markdown(states: dict[int, dict], entries: list[dict]) -> str:
    sizes = sorted(states)
    head = ["step"]
    for n in sizes:
        head += [f"s @ {n:,}", f"MB @ {n:,}"]
    multi = len(sizes) >= 2
    if multi:
        head += ["time x", "RSS x", "s @ 10^6", "MB @ 10^6", "budget s", "goal met"]
    rows = []
    for entry in entries:
        row: list = [entry["step"]]
        for n in sizes:
            value = entry["sizes"][str(n)]
            row += [value["seconds"] if value else None, round(value["rss"] / MB) if value and value["rss"] else None]
        if multi:
            met = [entry.get("within_time"), entry.get("within_rss")]
            row += [
                entry.get("time_growth"),
                entry.get("rss_growth"),
                entry.get("seconds_1e6"),
                round(entry["rss_1e6"] / MB) if entry.get("rss_1e6") else None,
                entry.get("budget_s"),
                "n/a" if met[0] is None else ("yes" if all(met) else "**no**"),
            ]
        rows.append(row)
    lines = [f"# Scale run, {time.strftime('%Y-%m-%d')}", "", table(head, rows, 1), ""]
    for n in sizes:
        lines += [f"## {n:,} conversations", "", _detail_table(states[n]), ""]
    for n in sizes:
        state = states[n]
        loads = [r["load_before"][0] for r in state["steps"].values()]
        lines.append(
            f"- {n:,} conversations: plain write with fsync {state['plain_write_bytes_per_s'] / MB:,.0f} MB/s; "
            f"load average (1 min) before the steps {min(loads):.2f} to {max(loads):.2f}; settings "
            f"{json.dumps(state.get('settings', {}))}"
        )
    return "\n".join(lines) + "\n"


def _detail_table(state: dict) -> str:
    """Every command of one size: wall and CPU seconds, peak RSS, bytes added, load before, others' cores."""
    head = ["command", "s", "CPU s", "peak RSS MB", "tree RSS MB", "MB written", "load before", "others' cores"]
    rows = [
        [
            label,
            record["wall_s"],
            record["cpu_s"],
            round(record["peak_rss_bytes"] / MB),
            round(record["peak_tree_rss_bytes"] / MB),
            round(record["bytes_added"] / MB, 1),
            record["load_before"][0],
            record["others_cores"],
        ]
        for label, record in state["steps"].items()
    ]
    return table(head, rows, [0, 1, 1, 0, 0, 1, 2, 2])


def write_report(work: Path, sizes: list[int], out: Path, label: str = "") -> None:
    states = load_sizes(work, sizes)
    if not states:
        print(f"nothing measured under {work} for sizes {sizes}")
        return
    entries = compare(states)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "sizes": {str(n): states[n] for n in sorted(states)},
        "rows": entries,
    }
    stem = out / f"{time.strftime('%Y-%m-%d')}-scale{('-' + label) if label else ''}"
    write_results(stem, results, markdown(states, entries))
