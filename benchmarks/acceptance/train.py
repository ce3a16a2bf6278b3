"""Inside the trainer environment: train a drafter with speculators' own EAGLE-3 or DFlash model code on a
speculators export, at one fixed budget (optimizer steps, learning rate, tokens per batch) and a seed, and save it
with speculators' own ``save_pretrained`` (``config.json`` with ``speculators_model_type``, safetensors weights), so
that it loads wherever speculators' checkpoints load.

    python -m benchmarks.acceptance.train --export DIR --target DIR --algorithm eagle3|dflash --out CKPT
        [--steps 300] [--lr LR] [--batch-tokens 2048] [--seed 0] [--control] [--untrained]

``--control`` trains on auxiliary states shuffled between samples (what the tokens alone teach), ``--untrained``
saves the initialised drafter (the floor). A checkpoint already made from the same export, target, budget, seed and
code (its ``hsx_training.json`` stamp) is kept and not trained again. Run with the trainer environment's Python and
this checkout on ``PYTHONPATH`` (speculators' ``hsx`` backend reads the export): see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from hsx_dagster.core.export import build_drafter, drafter_step, load_rows, packed_batches, shuffled_states

HERE = Path(__file__).resolve()
STAMP = "hsx_training.json"
DEFAULT_LR = {"eagle3": 1e-2, "dflash": 1e-3}  # as the training proof measured on the demo (docs/benchmarks.md)


def _file_digest(path: Path, digest: Any) -> None:
    digest.update(str(path.name).encode())
    with open(path, "rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)


def stamp(args: argparse.Namespace) -> str:
    """What the checkpoint is made of: the export's files (its ``hsx_export.json`` names the drafter dataset and
    when it was made), the target's config and weights, the budget and seed, and the training code."""
    digest = hashlib.sha256()
    for path in sorted(p for p in args.export.rglob("*") if p.is_file()):
        _file_digest(path, digest)
    for path in sorted(args.target.glob("*.json")) + sorted(args.target.glob("*.safetensors")):
        _file_digest(path, digest)
    for module in (HERE, Path(build_drafter.__code__.co_filename)):
        _file_digest(module, digest)
    budget = {k: v for k, v in sorted(vars(args).items()) if k not in ("export", "target", "out", "threads")}
    digest.update(json.dumps(budget, default=str).encode())
    return digest.hexdigest()


def train(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(args.seed)
    rows, _, meta = load_rows(args.export)  # the held-out rows stay out: the prompts to decode come from elsewhere
    if args.control:
        rows = shuffled_states(rows, seed=args.seed)
    aux = meta["mapping"]["trainer_aux_ids"]
    model = build_drafter(args.algorithm, str(args.target), aux, ttt_steps=args.ttt_steps, block_size=args.block_size,
                          num_layers=args.layers, eagle3_norms=True).float().train()  # fmt: skip
    hidden = rows[0]["verifier_last_hidden_states"].shape[-1]
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr)
    losses: list[float] = []
    epoch = 0
    while not args.untrained and len(losses) < args.steps:
        random.Random(args.seed * 1000 + epoch).shuffle(rows)
        for batch in packed_batches(rows, args.algorithm, args.batch_tokens, hidden, len(aux)):
            loss, _ = drafter_step(model, batch, args.algorithm, args.anchors, ttt_steps=args.ttt_steps)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
            if len(losses) == args.steps:
                break
        epoch += 1
    facts = {"train_rows": len(rows), "epochs": epoch, "aux_ids": aux, "losses": losses}
    return model.eval(), facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", type=Path, required=True, help="a speculators export folder (hsx_export.json)")
    parser.add_argument("--target", type=Path, required=True, help="the target model's folder")
    parser.add_argument("--algorithm", choices=["eagle3", "dflash"], required=True)
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (the budget)")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-2 for EAGLE-3, 1e-3 for DFlash")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="tokens per packed batch")
    parser.add_argument("--seed", type=int, default=0, help="the draft's initial weights, the row order, the control")
    parser.add_argument("--control", action="store_true", help="states shuffled between samples")
    parser.add_argument("--untrained", action="store_true", help="save the initialised drafter, no step")
    parser.add_argument("--ttt-steps", type=int, default=3, help="EAGLE-3: draft steps unrolled in training")
    parser.add_argument("--block-size", type=int, default=8, help="DFlash: the block (block - 1 drafts per pass)")
    parser.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    parser.add_argument("--anchors", type=int, default=64, help="DFlash: anchors per training batch")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    args.lr = args.lr or DEFAULT_LR[args.algorithm]
    args.export, args.target = args.export.resolve(), args.target.resolve()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    made = stamp(args)
    if (args.out / STAMP).is_file() and json.loads((args.out / STAMP).read_text()).get("stamp") == made:
        print(f"{args.out}: already trained from the same inputs, budget and seed; kept")
        return
    started = time.time()
    model, facts = train(args)
    partial = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    record = {"stamp": made, **{k: str(v) for k, v in vars(args).items()}, **facts, "seconds": time.time() - started}
    (partial / STAMP).write_text(json.dumps(record, indent=2))
    shutil.rmtree(args.out, ignore_errors=True)
    partial.rename(args.out)  # the checkpoint appears whole or not at all
    losses = facts["losses"]
    ends = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, " if losses else "untrained, "
    print(f"{args.out}: {args.algorithm} {len(losses)} steps, {ends}{record['seconds']:.0f} s")


if __name__ == "__main__":
    main()
