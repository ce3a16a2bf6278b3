"""Which workers write SpecForge's ``.ckpt`` files fastest here: in-process, threads or processes (file_pool.py).

    .venv/bin/python -m benchmarks.cpu.export_pool --drafter data/out/scale/20000/out/drafter --rows 8000

The first ``--rows`` rows of a SpecForge EAGLE-3 export of an assembled drafter dataset, written by each kind of
pool in turn (``--rounds`` interleaved rounds, the order rotated), each run a fresh child process (as a Dagster step
is: the process pool's start-up counts) into a fresh folder on the same disk, each batch of files synced as the
export syncs them. Reported: seconds, files/s and MB/s per kind (median of the rounds), the load average.
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

from benchmarks import REPO
from benchmarks.shared.measure import median
from benchmarks.shared.report import table, write_results

KINDS = ("inline", "thread", "process")


def one_run(drafter: Path, out: Path, rows: int, kind: str, workers: int) -> dict:
    """In this process: the first ``rows`` rows written by ``kind``; seconds and bytes."""
    from hsx_dagster.core.dataset import DrafterDataset
    from hsx_dagster.core.export import SpecForgeRows, dataset_indices, row_order, specforge_mapping, write_rows
    from hsx_dagster.core.storage import folder_bytes

    dataset = DrafterDataset(drafter)
    mapping = specforge_mapping(dataset.layer_ids, dataset.num_hidden_layers, True, "eagle3")
    order, _ = row_order(drafter)
    indices = dataset_indices(dataset, order[:rows])
    started = time.perf_counter()
    result = write_rows(SpecForgeRows(drafter, out, mapping, "eagle3"), indices, workers=workers, kind=kind)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "files": result.written, "bytes": folder_bytes(out), "workers": result.workers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu.export_pool", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--drafter", type=Path, required=True, help="an assembled drafter dataset (with the final state)"
    )
    parser.add_argument("--rows", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path, default=REPO / "data" / "out" / "export-pool")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, folder = args.child
        print(json.dumps(one_run(args.drafter, Path(folder), args.rows, kind, args.workers)))
        return 0
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for round_number in range(args.rounds):
        order = KINDS[round_number % len(KINDS) :] + KINDS[: round_number % len(KINDS)]
        for kind in order:
            folder = args.out / kind
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            load = os.getloadavg()[0]
            command = [sys.executable, "-m", "benchmarks.cpu.export_pool", "--drafter", str(args.drafter), "--rows",
                       str(args.rows), "--workers", str(args.workers), "--child", kind, str(folder)]  # fmt: skip
            done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
            run = {**json.loads(done.stdout.strip().splitlines()[-1]), "load": load}
            runs[kind].append(run)
            print(f"round {round_number + 1}: {kind}: {run['seconds']:.1f} s (load {load:.2f})", file=sys.stderr)
            shutil.rmtree(folder, ignore_errors=True)
    rows = []
    for kind in KINDS:
        seconds = median([r["seconds"] for r in runs[kind]])
        size = runs[kind][0]["bytes"]
        rows.append(
            [
                kind,
                runs[kind][0]["workers"],
                round(seconds, 2),
                round(args.rows / seconds),
                round(size / seconds / 1e6, 1),
            ]
        )
    results = {"rows": args.rows, "workers": args.workers, "drafter": str(args.drafter), "runs": runs}
    markdown = table(["pool", "workers", "seconds (median)", "files/s", "MB/s"], rows) + "\n"
    write_results(REPO / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}-export-pool", results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
