"""How true a running shard's time left is: every progress update of the latest run of each shard against the
time that shard really had left until its materialization, read from a Dagster instance after the runs.

    make demo && .venv/bin/python -m benchmarks.cpu.progress_eta            # the demo's instance (.dagster_home)
    .venv/bin/python -m benchmarks.cpu.progress_eta --home path/to/dagster_home

Each update is an observation of the shard's `hidden_states` partition recorded by its run (the asset's
Events tab); its `time left` is compared with the seconds from that observation to the run's
materialization of the shard. #25 asks the first update to be within 2x. How busy the machine was is
recorded as the load averages when read (1, 5 and 15 minutes: read right after the demo, the last covers
its shard runs); the other work on a shared machine moves the ratio more than the estimate does.
Writes benchmarks/results/<date>-progress-eta.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from benchmarks import REPO
from hsx_dagster.core.units import format_duration, parse_duration


def shard_updates(home: Path) -> list[dict]:
    """Per shard: its latest materialization's run, and each progress update of that run."""
    from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

    key = AssetKey("hidden_states")
    rows = []
    with DagsterInstance.from_config(str(home)) as instance:
        materializations = instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=1000).records
        observations = instance.fetch_observations(AssetRecordsFilter(asset_key=key), limit=10_000).records
        latest: dict[str, object] = {}
        for record in materializations:  # newest first
            latest.setdefault(record.partition_key, record)
        for shard, done in sorted(latest.items()):
            updates = sorted(
                (r for r in observations if r.run_id == done.run_id and "time left" in r.asset_observation.metadata),
                key=lambda r: r.timestamp,
            )
            if not updates:
                continue  # a re-run that had nothing to extract, or a shard shorter than one update
            samples = done.asset_materialization.metadata.get("samples_this_run")
            points = []
            for update in updates:
                eta = parse_duration(update.asset_observation.metadata["time left"].value)
                real = done.timestamp - update.timestamp
                ratio = round(eta / real, 2) if real > 0 else None  # an update in the shard's last instant
                points.append({"eta_s": eta, "real_s": round(real, 1), "ratio": ratio})
            rows.append(
                {
                    "shard": shard,
                    "run_id": done.run_id,
                    "samples_this_run": samples.value if samples is not None else None,
                    "first_update_after_s": round(updates[0].timestamp - _run_start(instance, done.run_id), 1),
                    "updates": points,
                }
            )
    return rows


def _run_start(instance, run_id: str) -> float:
    record = instance.get_run_record_by_id(run_id)  # the run that materialized the shard: it exists
    return record.start_time or record.create_timestamp.timestamp()


def render(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Progress time left against the real time left ({meta['date']})",
        "",
        f"Instance: `{meta['home']}`; load average when read: {meta['load_average']} on {meta['cores']} cores.",
        "",
        "| shard | samples | first update after run start | first time left | real time left | ratio | later ratios |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        first = row["updates"][0]
        later = ", ".join(_ratio(p["ratio"]) for p in row["updates"][1:]) or "-"
        lines.append(
            f"| {row['shard']} | {row['samples_this_run']} | {format_duration(row['first_update_after_s'])} | "
            f"{format_duration(first['eta_s'])} | {format_duration(first['real_s'])} | {_ratio(first['ratio'])} | "
            f"{later} |"
        )
    return "\n".join(lines) + "\n"


def _ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=REPO / ".dagster_home", help="the instance's DAGSTER_HOME")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    rows = shard_updates(args.home)
    if not rows:
        raise SystemExit(f"{args.home}: no shard run with progress updates (run `make demo` first)")
    meta = {
        "date": datetime.date.today().isoformat(),
        "home": str(args.home),
        "load_average": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "cores": os.cpu_count(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{meta['date']}-progress-eta"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "shards": rows}, indent=2) + "\n")
    report = render(rows, meta)
    stem.with_suffix(".md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
