"""Inside the trainer environment: train a tiny drafter with speculators' own EAGLE-3 or DFlash model code on an
hsx export, in a plain CPU loop (speculators' Trainer picks CUDA when no accelerator is present), and measure its
top-1 agreement with the target's next token on the held-out rows, against the same training on states shuffled
between samples (the control).

    python train_drafter.py EXPORT_DIR MODEL_DIR ALGORITHM OUT_JSON [--epochs N] [--control] [--lr LR]

Rows come through speculators' `ArrowDataset` with the `hsx` backend; speculators' `CollateFn` packs each batch
(EAGLE-3: after its `shift_batch`). Agreement is speculators' own metric: draft argmax equals the target's argmax
over loss-masked positions, for the target's next token (EAGLE-3's first speculative step, `full_acc_0`; DFlash's
first drafted block position, `position_1_acc`, whose context and anchor token are those EAGLE-3's first step
sees). DFlash's later block positions are recorded too; on a random-weight target they are near chance by
construction (the target's prediction there depends on tokens the drafter does not see). Held-out rows are
scored at every position (as many anchors as tokens), training samples `--anchors` per batch as speculators does.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import warnings
from pathlib import Path

import torch

import hsx_dagster.core.export.hs_backend as hsx_backend

warnings.filterwarnings("ignore")


def load_rows(export: Path):
    from speculators.train.data import ArrowDataset

    meta = json.loads((export / "hsx_export.json").read_text())
    ratio = (meta["train_rows"] + 0.5) / meta["rows"]
    common = dict(max_len=4096, datapath=str(export), transfer=hsx_backend.HsxTransfer(export), on_missing="raise")
    train = ArrowDataset(train_ratio=ratio, split="train", **common)
    val = ArrowDataset(train_ratio=ratio, split="val", **common)
    return [train[i] for i in range(len(train))], [val[i] for i in range(len(val))], meta


def shuffled(rows: list[dict], seed: int) -> list[dict]:
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


def build_model(algorithm: str, model_dir: str, aux_ids: list[int], vocab: int):
    from speculators.models.utils import resolve_verifier_norm_class
    from speculators.train.cli import create_transformer_layer_config

    layer = create_transformer_layer_config(model_dir, num_layers=1, draft_arch="llama", hidden_act=None,
                                            sliding_window=0, full_attention_indices=[0])  # fmt: skip
    kwargs = dict(verifier_name_or_path=model_dir, draft_vocab_size=vocab, target_layer_ids=aux_ids,
                  draft_attn_impl="eager", norm_before_residual=True, ttt_steps=1)  # fmt: skip
    if algorithm == "eagle3":
        from speculators.models.eagle3.core import Eagle3DraftModel

        model = Eagle3DraftModel.from_training_args(verifier_config=layer, **kwargs)
        # speculators 0.9's EAGLE-3 norms the last slot with the draft's RMSNorm (x * w) whatever the verifier; a
        # Qwen3.5 verifier's final norm is x * (1 + w) (its DFlash model picks that via resolve_verifier_norm_class).
        norm = resolve_verifier_norm_class(model.config)(layer.hidden_size, eps=layer.rms_norm_eps)
        norm.load_state_dict(model.verifier_norm.state_dict())
        model.verifier_norm = norm.requires_grad_(False)
        return model
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.train.utils import resolve_mask_token_id

    mask = resolve_mask_token_id(model_dir, layer.vocab_size)  # as its CLI resolves it
    return DFlashDraftModel.from_training_args(verifier_config=layer, block_size=4, mask_token_id=mask, **kwargs)


def batches(rows: list[dict], algorithm: str, max_len: int, hidden: int, layers: int):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    collate = CollateFn(max_len, hidden, layers, dtype=torch.float32,
                        preprocess=shift_batch if algorithm == "eagle3" else None)  # fmt: skip
    batch, used = [], 0
    for row in rows:
        if batch and used + len(row["input_ids"]) > max_len:
            yield collate(batch)
            batch, used = [], 0
        batch.append(row)
        used += len(row["input_ids"])
    if batch:
        yield collate(batch)


def step(model, batch, algorithm: str, anchors: int):
    """Loss and speculators' accuracy counts (``name -> (correct, total)``) of one batch."""
    from speculators.losses.utils import resolve_loss_config

    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if algorithm == "eagle3":  # speculators' default losses (kl_div; ce for DFlash), eager: the fused need Triton
        _, loss, metrics = model(**inputs, ttt_steps=1, loss_config=resolve_loss_config("kl_div", "eager"))
    else:
        _, loss, metrics = model(**inputs, max_anchors=anchors, loss_config=resolve_loss_config("ce", "eager"))
    counts = {
        name.removesuffix("_sum"): (float(value), float(metrics[name.removesuffix("_sum") + "_total"]))
        for name, value in metrics.items()
        if name.endswith("_sum") and "acc" in name
    }
    return loss, counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("export", type=Path)
    parser.add_argument("model_dir")
    parser.add_argument("algorithm", choices=["eagle3", "dflash"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--control", action="store_true")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-2 for EAGLE-3, 1e-3 for DFlash")
    parser.add_argument("--anchors", type=int, default=64, help="DFlash: anchors per training batch")
    parser.add_argument("--seed", type=int, default=0, help="the draft's initial weights, the row order, the control")
    args = parser.parse_args()
    args.lr = args.lr or (1e-2 if args.algorithm == "eagle3" else 1e-3)  # on the demo, over seeds: docs/benchmarks.md
    torch.manual_seed(args.seed)
    started = time.time()
    train, val, meta = load_rows(args.export)
    if args.control:
        train = shuffled(train, seed=args.seed)
    aux = meta["mapping"]["trainer_aux_ids"]
    hidden = train[0]["verifier_last_hidden_states"].shape[-1]
    vocab = (
        json.loads((Path(args.model_dir) / "config.json").read_text()).get("vocab_size")
        or json.loads((Path(args.model_dir) / "config.json").read_text())["text_config"]["vocab_size"]
    )
    model = build_model(args.algorithm, args.model_dir, aux, vocab).float().train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    losses = []
    for epoch in range(args.epochs):
        random.Random(args.seed * 1000 + epoch).shuffle(train)
        for batch in batches(train, args.algorithm, args.max_len, hidden, len(aux)):
            loss, _ = step(model, batch, args.algorithm, args.anchors)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    model.eval()
    totals: dict[str, list[float]] = {}
    with torch.no_grad():
        for batch in batches(val, args.algorithm, args.max_len, hidden, len(aux)):
            for name, (correct, total) in step(model, batch, args.algorithm, args.max_len)[1].items():
                pair = totals.setdefault(name, [0.0, 0.0])
                pair[0], pair[1] = pair[0] + correct, pair[1] + total
    accuracy = {name: correct / max(total, 1.0) for name, (correct, total) in totals.items()}
    key = "full_acc_0" if args.algorithm == "eagle3" else "position_1_acc"
    result = {
        "algorithm": args.algorithm,
        "control": args.control,
        "train_rows": len(train),
        "val_rows": len(val),
        "steps": len(losses),
        "lr": args.lr,
        "seed": args.seed,
        "losses": losses,
        "agreement": accuracy[key],
        "val_positions": totals[key][1],
        "accuracy": accuracy,  # every metric speculators reports, e.g. DFlash's per block position
        "seconds": time.time() - started,
    }
    args.out.write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}))


if __name__ == "__main__":
    main()
