"""Storage dtypes compared: bytes on disk per token, and how far the stored states are from the
float32 pipeline output on the same samples (relative error per token and layer, ||x - ref|| / ||ref||).
Every dtype of hsx_dagster.core.storage.format.STORAGE_DTYPES takes part."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hsx_dagster.core.storage import STORAGE_DTYPES, iter_shard_samples

REFERENCE = "float32"
BASELINE = "bfloat16"


def storage_dtypes() -> list[str]:
    return list(STORAGE_DTYPES)


def itemsize(dtype_name: str) -> int:
    return torch.empty((), dtype=STORAGE_DTYPES[dtype_name]).element_size()


def payload_bytes(tokens: int, layers: int, hidden: int, dtype_name: str) -> int:
    """What the states themselves take: tokens x layers x hidden x dtype size (no ids, scales or headers)."""
    return tokens * layers * hidden * itemsize(dtype_name)


def read_states(directory: Path) -> dict[int, torch.Tensor]:
    """sample id -> float32 hidden states [T, L, H], de-quantised where stored as fp8."""
    try:
        samples = iter_shard_samples(directory, dtype=torch.float32)
    except TypeError:  # a store without the dtype keyword: cast here
        samples = iter_shard_samples(directory)
    return {int(s["sample_id"]): s["hidden_states"].float() for s in samples}


def relative_errors(directory: Path, reference: dict[int, torch.Tensor]) -> np.ndarray:
    """||x - ref|| / ||ref|| of every (token, layer) vector of every sample."""
    errors = []
    for sample_id, states in read_states(directory).items():
        ref = reference[sample_id]
        errors.append(((states - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).flatten())
    return torch.cat(errors).numpy()


def error_summary(errors: np.ndarray) -> dict:
    return {"median": float(np.median(errors)), "p99": float(np.percentile(errors, 99)), "max": float(errors.max())}
