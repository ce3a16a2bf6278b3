"""The benchmark's models and the samples they run on.

- ``qwen3.6-shaped``: the hybrid architecture of Qwen3.5/3.6 (three Gated DeltaNet linear-attention
  layers, then one full-attention layer) with Qwen3.6's vocabulary of 248,320 tokens;
- ``qwen3-dense``: a dense Qwen3 (full attention only) with Qwen3's vocabulary of 151,936 tokens;
- ``demo``: the embedded demo model (hybrid, demo vocabulary of 5,248 tokens).

All random weights, 8 decoder layers and a small hidden size, so that a 2-core CPU runs them. The
vocabularies are the real ones because the LM head is what the naive design pays for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from benchmarks import REPO
from hsx_dagster.core.extraction import plan_batches
from hsx_dagster.core.model import resolve_layers
from hsx_dagster.demo.build import MODEL_PATH, OPENAI_PATH, SHAREGPT_PATH, build_demo

DEMO = "demo"
QWEN36_VOCAB = 248_320
QWEN3_VOCAB = 151_936
LAYERS = "eagle3"  # the preset most drafters use: [1, N//2 - 1, N - 4]


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # an architecture of hsx_dagster.demo.model
    vocab_size: int
    seed: int
    about: str
    num_layers: int = 8


SPECS = {
    "qwen3.6-shaped": ModelSpec(
        "qwen3_5", QWEN36_VOCAB, 3, "hybrid Gated DeltaNet + full attention (3:1), vocab 248,320"
    ),
    "qwen3-dense": ModelSpec("qwen3", QWEN3_VOCAB, 4, "dense Qwen3 (full attention), vocab 151,936"),
}
MODEL_NAMES = (*SPECS, DEMO)


def demo_root() -> Path:
    data = REPO / "data"
    build_demo(data)  # a no-op when `make data` already built it
    return data


def demo_inputs() -> list[Path]:
    data = demo_root()
    return [data / SHAREGPT_PATH, data / OPENAI_PATH]


def demo_model() -> Path:
    return demo_root() / MODEL_PATH


def build_model(name: str, work: Path, hidden_size: int) -> Path:
    """The model's directory (built under ``work``, except the demo model, which exists already)."""
    if name == DEMO:
        return demo_model()
    from hsx_dagster.demo.model import build_tiny_model

    spec = SPECS[name]
    out = work / "models" / name
    build_tiny_model(
        out,
        demo_model(),
        arch=spec.arch,
        num_layers=spec.num_layers,
        hidden_size=hidden_size,
        seed=spec.seed,
        vocab_size=spec.vocab_size,
    )
    return out


def describe(name: str, model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or ["full_attention"] * layers
    return {
        "about": SPECS[name].about if name in SPECS else "the embedded demo model (hybrid), demo vocabulary",
        "model_type": config["model_type"],
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "num_layers": layers,
        "layer_kinds": {kind: kinds.count(kind) for kind in sorted(set(kinds))},
        "layer_ids": resolve_layers(LAYERS, layers),
    }


def pick_samples(table: pa.Table, count: int, batch_size: int, max_batch_tokens: int) -> pa.Table:
    """About ``count`` samples: whole batches of the plan a run over all of ``table`` would make,
    the middle batch of each of ``count / batch`` equal strata of the length order, in their original order.

    A random subset of a few hundred samples would pad far more than a real shard of 10^5 samples
    (its neighbours in length are further apart); whole batches of the full plan keep the real
    run's padding and still span the whole length distribution.
    """
    plan = plan_batches(table.column("num_tokens").to_numpy(), batch_size, max_batch_tokens)
    wanted = max(1, round(count * len(plan) / table.num_rows))
    strata = min(wanted, len(plan))
    chosen = np.unique(
        ((np.arange(strata) + 0.5) * len(plan) / strata).astype(np.int64)
    )  # the middle batch of each stratum
    rows = np.sort(np.fromiter((row for k in chosen for row in plan[k].rows), dtype=np.int64))
    return table.take(pa.array(rows))


def repeat_samples(table: pa.Table, times: int) -> pa.Table:
    """The same samples ``times`` over, each copy with its own sample ids: more work, same lengths."""
    copies = []
    for k in range(times):
        ids = pa.array(np.arange(table.num_rows, dtype=np.int64) + k * table.num_rows)
        copies.append(table.set_column(table.schema.get_field_index("sample_id"), "sample_id", ids))
    return pa.concat_tables(copies)
