"""Shard and drafter checks against a plain ``sha256sum`` of the same files, cold and warm page cache.

    .venv/bin/python -m benchmarks.cpu.check_speed                 # ~1.1 GB shard, hidden 2,048, 2 rounds
    .venv/bin/python -m benchmarks.cpu.check_speed --tokens 8000   # quicker, a smaller shard

A random-weight Llama of hidden size 2,048 (4 layers; a narrow MLP so that the CPU extracts it in minutes) is
built next to the demo tokenizer; the demo conversations are tokenized into one shard and extracted (layers
0-2 and the final state, bfloat16: 16 KiB per token) until ``--tokens`` tokens. Then, interleaved per round:
``sha256sum`` of the shard's chunk files, the three shard checks (`check_shard`, one read of every chunk), and
the drafter dataset's checks (coverage, integrity, numerics) after assembly; each with a cold page cache and a
warm one. Cold: ``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every
chunk file (said in the report as ``cold_method``). The machine's load is recorded with every timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import REPO

HIDDEN = 2048


def build_model(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hsx_dagster.demo.build import MODEL_PATH

    tokenizer = AutoTokenizer.from_pretrained(REPO / "data" / MODEL_PATH)
    config = LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def extract(root: Path, model: Path, tokens: int) -> tuple[Path, float]:
    """Tokenize the demo into one shard, keep the first samples up to ``tokens`` tokens, extract: (shard, seconds)."""
    import pyarrow.parquet as pq

    from hsx_dagster.core.extraction import run_shard
    from hsx_dagster.core.storage import tokenized_shard_file
    from hsx_dagster.demo.build import OPENAI_PATH, SHAREGPT_PATH
    from hsx_dagster_tests.support.helpers import shard_job, tokenize

    tokenized = root / "tokenized"
    tokenize([REPO / "data" / SHAREGPT_PATH, REPO / "data" / OPENAI_PATH], model, tokenized, shards=1, max_length=2048)
    file = tokenized_shard_file(tokenized, "shard-00")
    table = pq.read_table(file)
    keep = int((table.column("num_tokens").to_numpy().cumsum() <= tokens).sum())
    pq.write_table(table.slice(0, keep), file)  # the first samples up to the wanted size
    job = shard_job(tokenized_dir=tokenized, output_dir=root / "hidden_states" / "shard-00", model_path=model,
                    layer_ids=(0, 1, 2), include_final=True, storage_dtype="bfloat16", batch_size=8,
                    max_batch_tokens=8192)  # fmt: skip
    started = time.perf_counter()
    run_shard(job)
    return root / "hidden_states" / "shard-00", time.perf_counter() - started


def drop_cache(files: list[Path]) -> str:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return "drop_caches"
    except OSError:
        for file in files:
            with open(file, "rb") as handle:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return "posix_fadvise(DONTNEED)"


def timed(run) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (this process and its children: user + system) and the load before."""
    load, started, before = os.getloadavg()[0], time.perf_counter(), os.times()
    run()
    after = os.times()
    cpu = sum(getattr(after, f) - getattr(before, f) for f in ("user", "system", "children_user", "children_system"))
    return time.perf_counter() - started, cpu, load


def contestants(root: Path, shard: Path, chunks: list[Path]) -> dict:
    from hsx_dagster.core.dataset import check_coverage, check_integrity, check_numerics, check_shard

    def shard_checks():
        outcomes = check_shard(shard, root / "tokenized", "shard-00")
        assert all(o.passed for o in outcomes.values()), {k: o.description for k, o in outcomes.items()}

    def drafter_checks():
        for check in (check_integrity(root / "drafter"), check_numerics(root / "drafter")):
            assert check.passed, check.description
        assert check_coverage(root / "drafter", root / "tokenized").passed

    return {
        "sha256sum": lambda: subprocess.run(["sha256sum", *map(str, chunks)], check=True, capture_output=True),
        # the same hash with OpenSSL's SHA-NI code, which Python's hashlib uses too (coreutils 9.1's does not)
        "openssl_sha256": lambda: subprocess.run(
            ["openssl", "dgst", "-sha256", *map(str, chunks)], check=True, capture_output=True
        ),
        "shard_checks": shard_checks,
        "drafter_checks": drafter_checks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=68_000, help="tokens in the shard (16 KiB each)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from hsx_dagster.core.dataset import assemble

    with tempfile.TemporaryDirectory(prefix="hsx-check-speed-", dir=REPO / "data") as scratch:
        root = Path(scratch)
        model = build_model(root / "model")
        shard, extraction_s = extract(root, model, args.tokens)
        chunks = sorted(shard.glob("chunk-*.safetensors"))
        size = sum(p.stat().st_size for p in chunks)
        assemble(root / "tokenized", root / "hidden_states", ["shard-00"], root / "drafter", val_fraction=0.1,
                 settings={})  # fmt: skip
        runs: list[dict] = []
        for round_ in range(args.rounds):
            for name, run in contestants(root, shard, chunks).items():  # interleaved
                for cache in ("cold", "warm"):
                    method = drop_cache(chunks) if cache == "cold" else "none"
                    seconds, cpu, load = timed(run)
                    runs.append({"round": round_, "contestant": name, "cache": cache, "seconds": round(seconds, 3),
                                 "cpu_s": round(cpu, 3),
                                 "mb_per_s": round(size / 2**20 / seconds, 1), "load_1min": load,
                                 "cold_method": method})  # fmt: skip
                    print(json.dumps(runs[-1]), flush=True)
    report = {"shard_bytes": size, "chunks": len(chunks), "hidden_size": HIDDEN, "tokens": args.tokens,
              "extraction_s": round(extraction_s, 1), "cpus": os.cpu_count(), "runs": runs}  # fmt: skip
    out = args.out or REPO / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}-check-speed.json"
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    print(f"written {out}")


if __name__ == "__main__":
    main()
