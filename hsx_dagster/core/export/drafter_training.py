"""Training speculators' own EAGLE-3 and DFlash drafters on a speculators export in a plain CPU loop (speculators'
Trainer picks CUDA when no accelerator is present): the rows as its ``ArrowDataset`` reads them through our ``hsx``
backend, the drafter its ``from_training_args`` builds, batches its ``CollateFn`` packs, one step of its own loss.

Imported inside speculators' environment only (it needs speculators and hs_connectors); the training proof's script
and the acceptance benchmark's trainer share it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def load_rows(export: Path) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(train rows, held-out rows, the export's ``hsx_export.json``), split as the export's metadata records."""
    from speculators.train.data import ArrowDataset

    import hsx_dagster.core.export.hs_backend as hsx_backend

    meta = json.loads((export / "hsx_export.json").read_text())
    ratio = (meta["train_rows"] + 0.5) / meta["rows"]
    common = dict(max_len=4096, datapath=str(export), transfer=hsx_backend.HsxTransfer(export), on_missing="raise")
    train = ArrowDataset(train_ratio=ratio, split="train", **common)
    val = ArrowDataset(train_ratio=ratio, split="val", **common)
    return [train[i] for i in range(len(train))], [val[i] for i in range(len(val))], meta


def shuffled_states(rows: list[dict], seed: int) -> list[dict]:
    """The control: every row keeps its tokens and its targets (last slot) but takes the auxiliary states of
    another row (cut or repeated to its length), as if the states came from the wrong sample."""
    rng = random.Random(seed)
    donors = list(range(len(rows)))
    rng.shuffle(donors)
    out = []
    for row, donor in zip(rows, donors):
        states = rows[donor]["hidden_states"]
        length = row["hidden_states"].shape[0]
        repeats = -(-length // states.shape[0])
        out.append({**row, "hidden_states": states.repeat(repeats, 1)[:length]})
    return out


def model_vocab_size(model_dir: str | Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("vocab_size") or config["text_config"]["vocab_size"]


def build_drafter(
    algorithm: str,
    model_dir: str,
    aux_ids: list[int],
    *,
    ttt_steps: int = 1,
    block_size: int = 4,
    num_layers: int = 1,
    eagle3_norms: bool = False,
) -> torch.nn.Module:
    """speculators' EAGLE-3 or DFlash drafter for the target in ``model_dir``, initialised as its trainer does.
    ``eagle3_norms``: its CLI's EAGLE-3 defaults (``norm_before_fc``, ``norm_output``), off in from_training_args."""
    from speculators.models.utils import resolve_verifier_norm_class
    from speculators.train.cli import create_transformer_layer_config

    every_layer = list(range(num_layers))  # full attention: the drafts here are far shorter than any window
    layer = create_transformer_layer_config(model_dir, num_layers=num_layers, draft_arch="llama", hidden_act=None,
                                            sliding_window=0, full_attention_indices=every_layer)  # fmt: skip
    kwargs = dict(verifier_name_or_path=model_dir, draft_vocab_size=model_vocab_size(model_dir), ttt_steps=ttt_steps,
                  target_layer_ids=aux_ids, draft_attn_impl="eager", norm_before_residual=True)  # fmt: skip
    if algorithm == "eagle3":
        from speculators.models.eagle3.core import Eagle3DraftModel

        norms = dict(norm_before_fc=True, norm_output=True) if eagle3_norms else {}
        model = Eagle3DraftModel.from_training_args(verifier_config=layer, **kwargs, **norms)
        # speculators 0.9's EAGLE-3 norms the last slot with the draft's RMSNorm (x * w) whatever the verifier; a
        # Qwen3.5 verifier's final norm is x * (1 + w) (its DFlash model picks that via resolve_verifier_norm_class).
        norm = resolve_verifier_norm_class(model.config)(layer.hidden_size, eps=layer.rms_norm_eps)
        norm.load_state_dict(model.verifier_norm.state_dict())
        model.verifier_norm = norm.requires_grad_(False)
        return model
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.train.utils import resolve_mask_token_id

    mask = resolve_mask_token_id(model_dir, layer.vocab_size)  # as its CLI resolves it
    return DFlashDraftModel.from_training_args(verifier_config=layer, block_size=block_size, mask_token_id=mask,
                                               **kwargs)  # fmt: skip


def packed_batches(rows: list[dict], algorithm: str, max_len: int, hidden: int, layers: int) -> Iterator[dict]:
    """Rows packed into batches of at most ``max_len`` tokens by speculators' ``CollateFn`` (EAGLE-3: after its
    ``shift_batch``, which pairs token x(i+1) with the states of position i)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    collate = CollateFn(max_len, hidden, layers, dtype=torch.float32,
                        preprocess=shift_batch if algorithm == "eagle3" else None)  # fmt: skip
    batch: list[dict] = []
    used = 0
    for row in rows:
        if batch and used + len(row["input_ids"]) > max_len:
            yield collate(batch)
            batch, used = [], 0
        batch.append(row)
        used += len(row["input_ids"])
    if batch:
        yield collate(batch)


def drafter_step(
    model: torch.nn.Module, batch: dict, algorithm: str, anchors: int, ttt_steps: int = 1
) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Loss and speculators' accuracy counts (``name -> (correct, total)``) of one batch."""
    from speculators.losses.utils import resolve_loss_config

    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if algorithm == "eagle3":  # speculators' default losses (kl_div; ce for DFlash), eager: the fused need Triton
        _, loss, metrics = model(**inputs, ttt_steps=ttt_steps, loss_config=resolve_loss_config("kl_div", "eager"))
    else:
        _, loss, metrics = model(**inputs, max_anchors=anchors, loss_config=resolve_loss_config("ce", "eager"))
    counts = {
        name.removesuffix("_sum"): (float(value), float(metrics[name.removesuffix("_sum") + "_total"]))
        for name, value in metrics.items()
        if name.endswith("_sum") and "acc" in name
    }
    return loss, counts
