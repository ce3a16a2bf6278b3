"""What `DrafterDataset`'s index costs per process at 10^6 samples, in the parent and in forked DataLoader workers.

    .venv/bin/python -m benchmarks.cpu.reader_memory                       # 10^6 samples, 4 workers, 2 rounds each
    .venv/bin/python -m benchmarks.cpu.reader_memory --samples 100000 --rounds 1   # quicker

A small drafter dataset is extracted from the demo (CPU, a minute), then its index is tiled to ``--samples`` rows
(every row a real sample of a demo chunk, so a pass reads real tensors). Each round is a fresh child process:
it opens the dataset (parent cost: Private_Dirty of /proc/self/smaps_rollup after opening minus before, with
Parquet's first allocations made beforehand on the small dataset and Arrow's pool trimmed; and the bytes of the
index objects themselves), then iterates it once through a DataLoader with ``--workers`` forked workers kept
alive, and reads each worker's Private_Dirty (pages it copied from the parent or allocated itself) at its start
and after the pass. Two contestants, interleaved: ``arrays`` (the reader as it is) and ``lists`` (the same index
turned into Python lists, as the reader kept it before: every worker copies the pages whose reference counts
it touches). The machine's load is recorded beside each round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import REPO


def private_bytes(pid: int | str = "self", fields: tuple[str, ...] = ("Private_Dirty", "Private_Clean")) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in fields:
            total += int(rest.split()[0]) * 1024
    return total


def build_small_dataset(root: Path) -> Path:
    """Tokenize 200 demo conversations, extract them on the CPU in one shard, assemble: the drafter folder."""
    from hsx_dagster.core.dataset import assemble
    from hsx_dagster.core.extraction import run_shard
    from hsx_dagster.demo.build import MODEL_PATH, OPENAI_PATH
    from hsx_dagster_tests.support.helpers import shard_job, tokenize

    few = root / "few.jsonl"
    few.write_text("".join((REPO / "data" / OPENAI_PATH).read_text().splitlines(keepends=True)[:200]))
    model = REPO / "data" / MODEL_PATH
    tokenize([few], model, root / "tokenized", shards=1, max_length=256)
    job = shard_job(tokenized_dir=root / "tokenized", output_dir=root / "hidden_states" / "shard-00",
                    model_path=model, layer_ids=(1, 3), batch_size=16)  # fmt: skip
    run_shard(job)
    assemble(root / "tokenized", root / "hidden_states", ["shard-00"], root / "drafter", val_fraction=0.1, settings={})
    return root / "drafter"


def tile_index(small: Path, out: Path, samples: int) -> Path:
    """A dataset folder whose index repeats ``small``'s rows to ``samples`` rows, reading ``small``'s chunks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    index = pq.read_table(small / "index.parquet")
    repeats = -(-samples // index.num_rows)
    tiled = pa.concat_tables([index] * repeats).slice(0, samples)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(tiled, out / "index.parquet")
    manifest = json.loads((small / "manifest.json").read_text())
    manifest["chunks_root"] = str((small / manifest.get("chunks_root", "..")).resolve())
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


class Pass(torch.utils.data.Dataset):
    """A pass over the dataset that touches every sample's index entry exactly as ``ds[i]`` does (`locate`) and
    reads the tensors of every ``read_every``-th sample (reading all of them takes hours on 2 cores)."""

    def __init__(self, ds, read_every: int) -> None:
        self.ds, self.read_every = ds, read_every

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> dict:
        if index % self.read_every == 0:
            return self.ds[index]
        _, _, sample_id = self.ds.locate(index)
        return {"sample_id": sample_id}


def collate(samples: list[dict]) -> dict:
    return {"sample_id": torch.tensor([s["sample_id"] for s in samples]), "read": sum(len(s) > 1 for s in samples)}


def child(dataset: Path, contestant: str, workers: int, batch_size: int, read_every: int = 100) -> dict:
    import psutil
    import pyarrow

    from hsx_dagster.core.dataset import DrafterDataset

    DrafterDataset(dataset.parent / "drafter")  # warm up: Parquet's and Arrow's own first allocations
    before = private_bytes(fields=("Private_Dirty",))
    started = time.perf_counter()
    ds = DrafterDataset(dataset)
    pyarrow.default_memory_pool().release_unused()  # what Arrow keeps for reuse after reading the Parquet file
    if contestant == "lists":  # the index as the reader kept it before: Python lists of Python objects
        ds._sample_ids = ds._sample_ids.tolist()
        ds._chunk_codes = ds._chunk_codes.tolist()
        ds._positions = ds._positions.tolist()
        ds._num_tokens = ds._num_tokens.tolist()
    open_s = time.perf_counter() - started
    parent = private_bytes(fields=("Private_Dirty",)) - before
    arrays = (ds._sample_ids, ds._chunk_codes, ds._positions, ds._num_tokens)
    held = sum(a.nbytes if hasattr(a, "nbytes") else sys.getsizeof(a) + 28 * len(a) for a in arrays)
    at_start = {}

    def remember(worker_id: int) -> None:
        dirty = private_bytes(fields=("Private_Dirty",))
        Path(f"{dataset}/.w{worker_id}-{contestant}").write_text(f"{os.getpid()} {dirty}")

    loader = torch.utils.data.DataLoader(
        Pass(ds, read_every), batch_size=batch_size, num_workers=workers, collate_fn=collate,
        persistent_workers=True, worker_init_fn=remember, multiprocessing_context="fork",
    )  # fmt: skip
    started, samples, read = time.perf_counter(), 0, 0
    for batch in loader:
        samples, read = samples + len(batch["sample_id"]), read + batch["read"]
    pass_s = time.perf_counter() - started
    alive = {process.pid for process in psutil.Process().children()}  # the persistent workers
    for k in range(workers):
        pid, dirty = Path(f"{dataset}/.w{k}-{contestant}").read_text().split()
        at_start[int(pid)] = int(dirty)
    growth = [private_bytes(pid, ("Private_Dirty",)) - start for pid, start in at_start.items() if pid in alive]
    return {
        "contestant": contestant, "samples": len(ds), "samples_located": samples, "samples_read": read,
        "open_s": round(open_s, 3), "parent_index_bytes": parent, "index_object_bytes": held,
        "worker_growth_bytes": growth,
        "pass_s": round(pass_s, 1),
    }  # fmt: skip


def load_average() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("DATASET", "CONTESTANT"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1], args.workers, args.batch_size)))
        return
    with tempfile.TemporaryDirectory(prefix="hsx-reader-memory-") as scratch:
        small = build_small_dataset(Path(scratch))
        dataset = tile_index(small, Path(scratch) / "tiled", args.samples)
        rounds = []
        for _ in range(args.rounds):
            for contestant in ("arrays", "lists"):  # interleaved: machine noise hits both alike
                load = load_average()
                command = [sys.executable, "-m", "benchmarks.cpu.reader_memory", "--child", str(dataset), contestant,
                           "--workers", str(args.workers), "--batch-size", str(args.batch_size)]  # fmt: skip
                done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
                if done.returncode:
                    raise RuntimeError(f"{contestant} round failed:\n{done.stderr[-3000:]}")
                result = {**json.loads(done.stdout.strip().splitlines()[-1]), "load_1min_before": load}
                print(json.dumps(result), flush=True)
                rounds.append(result)
    out = args.out or REPO / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}-reader-memory.json"
    out.write_text(json.dumps({"samples": args.samples, "workers": args.workers, "rounds": rounds}, indent=1))
    print(f"written {out}")


if __name__ == "__main__":
    main()
