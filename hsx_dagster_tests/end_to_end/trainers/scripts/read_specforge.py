"""Inside the trainer environment: SpecForge 0.2's own offline reading code takes an hsx SpecForge export.

Its `OfflineManifestReader` lists the files (sorted paths = our row order), `load_feature_file` loads each, and the
algorithm's own offline normaliser (EAGLE-3: `specforge.algorithms.eagle3.data`; DFlash:
`specforge.algorithms.common.dflash_family_data`) turns it into training tensors, which its collator batches. For
EAGLE-3 its `TargetHead` (the LM head alone: SpecForge takes `hidden_state` as already normed) turns the target
slot into logits, compared with the target model's own (REFERENCE, made in the project's environment). SpecForge's
trainer itself needs sglang and a GPU: only its reading code runs here.

    python read_specforge.py EXPORT_DIR LAYOUT MODEL_DIR REFERENCE.safetensors OUT_JSON
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

warnings.filterwarnings("ignore")


def target_head(model_dir: str):
    from specforge.modeling.target.target_head import TargetHead

    head = TargetHead(model_dir)  # its load_weights wants a sharded checkpoint's index.json; the demo has one file
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as weights:
        head.fc.weight.data.copy_(weights.get_tensor("lm_head.weight"))
    return head.float().eval()


def main() -> None:
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    export, layout, model_dir = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    reference, out = load_file(sys.argv[4]), Path(sys.argv[5])
    meta = json.loads((export / "hsx_export.json").read_text())
    if layout == "eagle3":
        from specforge.algorithms.eagle3.data import build_offline_collator, normalize_offline_sample

        keys = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
        reader = OfflineManifestReader(str(export), feature_keys=keys, validate_files=True)
        collate = build_offline_collator()
    else:
        from specforge.algorithms.common.dflash_family_data import (
            build_collator,
            build_offline_reader,
            normalize_offline_sample,
        )

        reader = build_offline_reader("dflash", str(export), run_id="hsx", ttt_length=1, max_len=1 << 20)
        reader.validate_files = True  # the eager pass: every file's keys and tensors checked up front
        collate = build_collator()
    refs = reader.read()
    assert len(refs) == meta["rows"], (len(refs), meta["rows"])
    head = target_head(model_dir) if layout == "eagle3" else None
    samples, result = [], {"rows": len(refs), "shapes": None, "logits_top1": [], "logits_max_error": 0.0}
    for row, ref in enumerate(refs):
        raw = load_feature_file(ref.feature_store_uri.removeprefix("file://"))
        sample = normalize_offline_sample(raw, max_len=1 << 20)
        ids = reference[f"ids_{row}"]
        assert torch.equal(sample["input_ids"][0], ids), f"row {row}: input_ids differ"
        mask = sample["loss_mask"][0]
        assert torch.equal(mask[: len(ids) - 1], reference[f"mask_{row}"][:-1]), f"row {row}: loss_mask differs"
        result["shapes"] = {k: list(v.shape) for k, v in sample.items()}
        if head is not None and f"logits_{row}" in reference:
            with torch.no_grad():
                _, target, _ = head.preprocess(sample["input_ids"], sample["target"], sample["loss_mask"])
                logits = head(target.float())[0, :-1]  # its preprocess shifts the target one token left
            expected = reference[f"logits_{row}"][1:]
            result["logits_top1"].append((logits.argmax(-1) == expected.argmax(-1)).float().mean().item())
            error = ((logits - expected).abs().max() / expected.abs().max()).item()
            result["logits_max_error"] = max(result["logits_max_error"], error)
        samples.append(sample)
    batch = collate(samples[:4])
    result["batch"] = {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
