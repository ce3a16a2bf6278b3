"""Inside the trainer environment: speculators' own `ArrowDataset` reads every row of an hsx export, through our
`hsx` backend and (when written) the plain `file` layout, and each row is compared with an independent reference
forward pass made in the project's environment (REFERENCE: ``ids_<r>``, ``mask_<r>``, ``aux_<r>`` [T, aux, H],
``last_<r>`` [T, H] the raw output of the last decoder layer, ``logits_<r>`` for the first rows).
Target logits are computed from the last slot the way speculators computes them: its verifier norm and LM head.

    python read_speculators.py EXPORT_DIR REFERENCE.safetensors MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

import hsx_dagster.core.export.hs_backend as hsx_backend

warnings.filterwarnings("ignore")


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """bf16 storage: each value within a few bf16 steps of the reference; returns the worst error relative to scale."""
    actual, expected = actual.float(), expected.float()
    error = (actual - expected).abs()
    bound = 2**-7 * expected.abs() + 2**-8 * expected.abs().max()
    assert bool((error <= bound).all()), f"{what}: max error {error.max().item():.4g} over the bf16 tolerance"
    return float(error.max() / expected.abs().max())


def verifier_heads(model_dir: str, aux_ids: list[int]):
    """speculators' own verifier norm + LM head, as its draft models load them from the verifier."""
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer = create_transformer_layer_config(model_dir, num_layers=1, draft_arch="llama", hidden_act=None,
                                            sliding_window=0, full_attention_indices=[0])  # fmt: skip
    vocab = layer.vocab_size
    kwargs = dict(verifier_name_or_path=model_dir, draft_vocab_size=vocab, target_layer_ids=aux_ids,
                  draft_attn_impl="eager", norm_before_residual=True, ttt_steps=1)  # fmt: skip
    dflash = DFlashDraftModel.from_training_args(verifier_config=layer, block_size=4, **kwargs).float()
    eagle3 = Eagle3DraftModel.from_training_args(verifier_config=layer, **kwargs).float()
    return {
        "dflash": lambda h: dflash.verifier_lm_head(dflash.verifier_norm(h)),
        "eagle3": lambda h: eagle3.verifier_lm_head(eagle3.verifier_norm(h)),
    }


def main() -> None:
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset

    export, reference, model_dir, out = Path(sys.argv[1]), load_file(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    meta = json.loads((export / "hsx_export.json").read_text())
    transfers = {"hsx": hsx_backend.HsxTransfer(export)}
    if (export / "hidden_states").is_dir():
        transfers["file"] = FileTransfer(export / "hidden_states")
    heads = verifier_heads(model_dir, meta["mapping"]["trainer_aux_ids"])
    result: dict = {"rows": meta["rows"], "backends": {}, "logits": {}}
    for name, transfer in transfers.items():
        dataset = ArrowDataset(max_len=1 << 20, datapath=str(export), transfer=transfer, on_missing="raise")
        assert len(dataset) == meta["rows"]
        worst = {"aux": 0.0, "last": 0.0}
        for row in range(len(dataset)):
            item = dataset[row]
            assert torch.equal(item["input_ids"], reference[f"ids_{row}"]), f"{name} row {row}: input_ids differ"
            assert torch.equal(item["loss_mask"], reference[f"mask_{row}"]), f"{name} row {row}: loss_mask differs"
            aux = reference[f"aux_{row}"]
            worst["aux"] = max(worst["aux"], close(item["hidden_states"], aux.flatten(1), f"{name} row {row} aux"))
            last = reference[f"last_{row}"]
            worst["last"] = max(worst["last"], close(item["verifier_last_hidden_states"], last, f"{name} row {row}"))
            if f"logits_{row}" in reference and name == "hsx":
                expected = reference[f"logits_{row}"]
                with torch.no_grad():
                    for head, compute in heads.items():
                        logits = compute(item["verifier_last_hidden_states"].float())
                        entry = result["logits"].setdefault(head, {"top1_agreement": [], "max_error": 0.0})
                        same = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
                        entry["top1_agreement"].append(same)
                        error = ((logits - expected).abs().max() / expected.abs().max()).item()
                        entry["max_error"] = max(entry["max_error"], error)
        result["backends"][name] = worst
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
