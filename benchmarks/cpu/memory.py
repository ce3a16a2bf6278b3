"""Memory scaling: the pipeline's peak RSS extracting N samples and the same N samples K times over.

Each run is a fresh child process (``python -m benchmarks.cpu.memory ...``) so that nothing another run
allocated counts. The child reports two peaks: the whole process (``ru_maxrss``: imports and model
loading included) and the extraction alone (the kernel's high-water mark, reset once the model is
loaded). Streaming means the second stays flat when the work grows K-fold. The K copies have the
same lengths as the N samples, so batch shapes, and with them activation memory, are the same: only
the amount of work differs.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.cpu.models import LAYERS, REPO, pick_samples, repeat_samples
from benchmarks.shared.contestants import benchmark_provenance
from benchmarks.shared.measure import peak_rss_bytes, reset_peak_rss, rss_bytes
from hsx_dagster.core.extraction import extract_shard, load_backbone
from hsx_dagster.core.inputs import read_tokenized_shard
from hsx_dagster.core.model import check_model_dir, resolve_layers
from hsx_dagster.core.settings import ExtractionSettings
from hsx_dagster.core.storage import ShardStore


def measure_memory(model_dir: Path, tokenized: Path, samples: int, factor: int, options: ExtractionSettings) -> dict:
    runs = {}
    for times in (1, factor):
        command = [
            sys.executable, "-m", "benchmarks.cpu.memory", "--model", str(model_dir), "--tokenized", str(tokenized),
            "--samples", str(samples), "--times", str(times), "--batch-size", str(options.batch_size),
            "--max-batch-tokens", str(options.max_batch_tokens), "--chunk-bytes", str(options.chunk_bytes),
        ]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"memory run {times}x failed:\n{done.stderr[-4000:]}")
        runs[f"{times}x"] = json.loads(done.stdout.strip().splitlines()[-1])
    one, many = runs["1x"], runs[f"{factor}x"]
    # The extraction's own peak where the kernel lets us reset it, else the whole process's.
    key = "extraction_peak_rss_bytes" if one["extraction_peak_rss_bytes"] else "process_peak_rss_bytes"
    return {
        "samples_1x": samples,
        "factor": factor,
        "chunk_bytes": options.chunk_bytes,
        "runs": runs,
        "compared": key,
        "peak_ratio": round(many[key] / one[key], 4),
        "process_peak_ratio": round(many["process_peak_rss_bytes"] / one["process_peak_rss_bytes"], 4),
    }


def _child(args: argparse.Namespace) -> dict:
    table = read_tokenized_shard(
        args.tokenized, "shard-00", columns=["sample_id", "input_ids", "loss_mask", "num_tokens"]
    )
    samples = repeat_samples(pick_samples(table, args.samples, args.batch_size, args.max_batch_tokens), args.times)
    model = check_model_dir(args.model)
    backbone = load_backbone(model, resolve_layers(LAYERS, model.num_hidden_layers))
    options = ExtractionSettings(
        batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens, chunk_mb=args.chunk_bytes / 2**20
    )
    loaded = rss_bytes()
    resettable = reset_peak_rss()
    provenance = benchmark_provenance(backbone.info, options.storage_dtype)
    with tempfile.TemporaryDirectory() as out, ShardStore(Path(out), provenance) as store:
        report = extract_shard("memory", samples, backbone, store, options, {"format": "benchmark"})
    return {
        "samples": report.samples,
        "tokens": report.tokens,
        "chunks": len(report.chunks),
        "seconds": round(report.elapsed_s, 2),
        "rss_after_load_bytes": loaded,
        "extraction_peak_rss_bytes": peak_rss_bytes() if resettable else None,
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="one memory-scaling run (started by benchmarks.cpu)")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tokenized", type=Path, required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--times", type=int, default=1)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--max-batch-tokens", type=int, required=True)
    parser.add_argument("--chunk-bytes", type=int, required=True)
    print(json.dumps(_child(parser.parse_args())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
