"""Extraction throughput against the naive design (the floor) and a bare forward pass (the ceiling).

Three contestants on the same samples and the same model, interleaved round by round in one
process so that machine noise hits them alike:

  naive     one sample per forward through AutoModelForCausalLM (LM head included),
            output_hidden_states=True, one .cpu() per layer per sample, one safetensors file per sample
  bare      the truncated backbone over our length-sorted batches: no capture, no gathering, no I/O
  pipeline  hsx-dagster's engine end to end (hooks, gather, one host copy per batch, chunk writer)

Two models: the demo model (hybrid Qwen3.5, vocabulary 5,248) and a Qwen3.6-shaped hybrid with
Qwen3.6's vocabulary of 248,320 tokens (the LM head is what the naive design pays for).

    .venv/bin/python benchmarks/extraction_throughput.py            # both models, about 8 minutes on 2 cores
    .venv/bin/python benchmarks/extraction_throughput.py --samples 32 --rounds 1 --models demo
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsx_dagster.core.backbone import load_backbone  # noqa: E402
from hsx_dagster.core.batching import padding_efficiency, plan_batches  # noqa: E402
from hsx_dagster.core.extract import ExtractOptions, extract_shard  # noqa: E402
from hsx_dagster.core.layers import resolve_layers  # noqa: E402
from hsx_dagster.core.store import ShardStore  # noqa: E402
from hsx_dagster.core.tokenization import TokenizeOptions, read_tokenized_shard, tokenize_dataset  # noqa: E402
from hsx_dagster.demo.build import MODEL_PATH, OPENAI_PATH, SHAREGPT_PATH, build_demo  # noqa: E402

QWEN36_VOCAB = 248_320


def prepare_models(work: Path, hidden_size: int) -> dict[str, Path]:
    from hsx_dagster.demo.model import build_tiny_model

    data = REPO / "data"
    build_demo(data)
    qwen36 = work / "qwen3_6-shaped"
    build_tiny_model(qwen36, data / MODEL_PATH, arch="qwen3_5", num_layers=8, hidden_size=hidden_size, seed=3, vocab_size=QWEN36_VOCAB)
    return {"demo": data / MODEL_PATH, "qwen3_6-shaped": qwen36}


def pick_samples(work: Path, count: int, seed: int) -> pa.Table:
    data = REPO / "data"
    tokenized = work / "tokenized"
    tokenize_dataset([data / SHAREGPT_PATH, data / OPENAI_PATH], data / MODEL_PATH, tokenized, TokenizeOptions(shards=1))
    table = read_tokenized_shard(tokenized, "shard-00", columns=["sample_id", "input_ids", "loss_mask", "num_tokens"])
    rows = np.random.default_rng(seed).choice(table.num_rows, size=min(count, table.num_rows), replace=False)
    return table.take(pa.array(np.sort(rows)))


def run_naive(model, samples: pa.Table, layer_ids: list[int], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for row in samples.select(["sample_id", "input_ids"]).to_pylist():
            outputs = model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True)
            layers = [outputs.hidden_states[i + 1][0].cpu() for i in layer_ids]  # one copy per layer
            tensors = {f"layer_{i}": t.to(torch.bfloat16).contiguous() for i, t in zip(layer_ids, layers)}
            save_file(tensors, str(out / f"{row['sample_id']}.safetensors"))  # one file per sample


def run_bare(backbone, samples: pa.Table, options: ExtractOptions) -> None:
    backbone.close()  # no hooks: nothing is captured
    ids = samples.column("input_ids").to_pylist()
    with torch.inference_mode():
        for batch in plan_batches(samples.column("num_tokens").to_numpy(), options.batch_size, options.max_batch_tokens):
            padded = torch.zeros((len(batch.rows), batch.longest), dtype=torch.long)
            mask = torch.zeros_like(padded)
            for k, row in enumerate(batch.rows):
                padded[k, : len(ids[row])] = torch.tensor(ids[row])
                mask[k, : len(ids[row])] = 1
            backbone.model(input_ids=padded, attention_mask=mask, use_cache=False)


def run_pipeline(backbone, samples: pa.Table, options: ExtractOptions, out: Path) -> dict:
    with ShardStore(out, {"benchmark": True}) as store:
        report = extract_shard("bench", samples, backbone, store, options, {"format": "benchmark"})
    backbone.close()
    return report.to_dict()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["demo", "qwen3_6-shaped"])
    parser.add_argument("--batch-size", type=int, default=16)  # the CPU sweet spot; GPUs want more
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size of the Qwen3.6-shaped model")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    results = {"machine": platform.platform(), "threads": args.threads, "torch": torch.__version__, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = prepare_models(work, args.hidden_size)
        samples = pick_samples(work, args.samples, seed=0)
        tokens = int(np.sum(samples.column("num_tokens").to_numpy()))
        options = ExtractOptions(batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens, storage_dtype="bfloat16")
        efficiency = padding_efficiency(plan_batches(samples.column("num_tokens").to_numpy(), args.batch_size, args.max_batch_tokens))
        for name in args.models:
            model_dir = models[name]
            num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
            layer_ids = resolve_layers("eagle3", num_layers)
            times: dict[str, list[float]] = {"naive": [], "bare": [], "pipeline": []}
            for round_number in range(args.rounds):
                for contestant in times:  # interleaved: each round runs all three
                    out = work / f"{name}-{contestant}-{round_number}"
                    # Model loading is outside the timed region for every contestant.
                    if contestant == "naive":
                        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
                        started = time.perf_counter()
                        run_naive(model, samples, layer_ids, out)
                    else:
                        backbone = load_backbone(model_dir, layer_ids)
                        started = time.perf_counter()
                        if contestant == "bare":
                            run_bare(backbone, samples, options)
                        else:
                            run_pipeline(backbone, samples, options, out)
                    times[contestant].append(time.perf_counter() - started)
            median = {k: statistics.median(v) for k, v in times.items()}
            results["models"][name] = {
                "layers": layer_ids,
                "samples": samples.num_rows,
                "tokens": tokens,
                "padding_efficiency": round(efficiency, 4),
                "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
                "samples_per_s": {k: round(samples.num_rows / t, 2) for k, t in median.items()},
                "tokens_per_s": {k: round(tokens / t, 1) for k, t in median.items()},
                "pipeline_over_naive": round(median["naive"] / median["pipeline"], 2),
                "pipeline_over_bare": round(median["bare"] / median["pipeline"], 3),
            }

    print(f"\n{args.samples} samples, {args.rounds} rounds, {args.threads} threads, torch {torch.__version__}")
    print("| model | naive samples/s | bare samples/s | pipeline samples/s | pipeline/naive | pipeline/bare | padding eff. |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results["models"].items():
        s = r["samples_per_s"]
        print(f"| {name} | {s['naive']} | {s['bare']} | {s['pipeline']} | {r['pipeline_over_naive']}x | {r['pipeline_over_bare']}x | {r['padding_efficiency']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
