"""The three contestants, on the same samples and the same model.

  naive     one sample per forward through AutoModelForCausalLM (LM head included),
            output_hidden_states=True, one .cpu() per layer per sample, one safetensors file per sample:
            what extraction scripts written in an afternoon do (the floor)
  bare      the truncated backbone over our length-sorted batches: no capture, no gathering, no
            copies, no I/O (the ceiling: the pipeline cannot be faster than its own forward passes)
  pipeline  hsx-dagster's engine end to end: hooks, gather, one host copy per batch, chunk writer

The runners are device-agnostic: the GPU benchmark (benchmarks/gpu/) runs the same ones on CUDA.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import save_file

from hsx_dagster.core.extraction import Backbone, BackboneInfo, extract_shard, plan_batches
from hsx_dagster.core.settings import ExtractionSettings
from hsx_dagster.core.storage import ShardProvenance, ShardStore

CONTESTANTS = ("naive", "bare", "pipeline")


def _rows(samples: pa.Table, column: str) -> list[np.ndarray]:
    values = samples.column(column).combine_chunks()
    return [values[k].values.to_numpy(zero_copy_only=False) for k in range(len(values))]


def run_naive(
    model: torch.nn.Module, samples: pa.Table, layer_ids: list[int], out: Path, storage_dtype: torch.dtype
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    sample_ids = samples.column("sample_id").to_pylist()
    with torch.inference_mode():
        for sample_id, ids, mask in zip(sample_ids, _rows(samples, "input_ids"), _rows(samples, "loss_mask")):
            input_ids = torch.from_numpy(ids.astype(np.int64))[None].to(device)
            outputs = model(input_ids=input_ids, output_hidden_states=True)
            tensors = {f"layer_{i}": outputs.hidden_states[i + 1][0].cpu().to(storage_dtype) for i in layer_ids}
            tensors["input_ids"] = torch.from_numpy(ids.astype(np.int32))
            tensors["loss_mask"] = torch.from_numpy(mask.astype(np.uint8))
            save_file(tensors, str(out / f"{sample_id}.safetensors"))


def run_bare(model: torch.nn.Module, samples: pa.Table, options: ExtractionSettings) -> None:
    """Forward passes over the pipeline's batches (same plan, same padding); nothing is kept."""
    device = next(model.parameters()).device
    rows = _rows(samples, "input_ids")
    with torch.inference_mode():
        for batch in plan_batches(
            samples.column("num_tokens").to_numpy(), options.batch_size, options.max_batch_tokens
        ):
            padded = np.zeros((len(batch.rows), batch.longest), dtype=np.int64)  # padding as the pipeline pads
            mask = np.zeros_like(padded)
            for k, row in enumerate(batch.rows):
                padded[k, : len(rows[row])] = rows[row]
                mask[k, : len(rows[row])] = 1
            model(
                input_ids=torch.from_numpy(padded).to(device),
                attention_mask=torch.from_numpy(mask).to(device),
                use_cache=False,
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pipeline(
    model: torch.nn.Module, info: BackboneInfo, samples: pa.Table, options: ExtractionSettings, out: Path
) -> dict:
    backbone = Backbone(model, info)  # hooks on for this run only, so `run_bare` on the same model captures nothing
    try:
        with ShardStore(out, benchmark_provenance(info, options.storage_dtype)) as store:
            report = extract_shard("bench", samples, backbone, store, options, {"format": "benchmark"})
    finally:
        backbone.close()
    return report.to_dict()


def benchmark_provenance(info: BackboneInfo, storage_dtype: str) -> ShardProvenance:
    """What a benchmark's shard folder records: the backbone's layers and dtypes (no model directory, no inputs)."""
    return ShardProvenance(
        shard="bench",
        model_path=info.model_type,
        config_sha256="benchmark",
        weights_index_sha256="benchmark",
        layer_ids=info.layer_ids,
        include_final=info.include_final,
        storage_dtype=storage_dtype,
        compute_dtype=info.compute_dtype,
        tokenized_sha256="benchmark",
    )
