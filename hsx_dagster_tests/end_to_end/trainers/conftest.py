"""The demo export the trainer tests share: 28 conversations extracted with the `speculators` layers and the final
state, and an independent reference forward pass per row (in the export's row order)."""

from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from hsx_dagster.core.export import export_speculators
from hsx_dagster_tests.support.helpers import build_drafter_dataset

LAYERS = [1, 3, 4, 7]  # model.layers: speculators for the demo model (8 layers)
LOGIT_ROWS = 4


def reference_file(model_dir: Path, export: Path, path: Path) -> Path:
    """Per export row: ids, mask and an independent single-sample forward pass of the target (float32): the
    auxiliary layers' outputs, the raw output of the last decoder layer (a hook: Hugging Face's last
    hidden_states entry is normed) and, for the first rows, the logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    captured = {}
    model.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o)
    )
    with pa.memory_map(str(export / "data-00000-of-00001.arrow")) as source:
        table = pa.ipc.open_stream(source).read_all()
    tensors = {}
    for row in range(table.num_rows):
        ids = torch.tensor(table.column("input_ids")[row].as_py(), dtype=torch.int64)
        with torch.inference_mode():
            out = model(input_ids=ids[None], output_hidden_states=True)
        tensors[f"ids_{row}"] = ids
        tensors[f"mask_{row}"] = torch.tensor(table.column("loss_mask")[row].as_py(), dtype=torch.int64)
        tensors[f"aux_{row}"] = torch.stack([out.hidden_states[i + 1][0] for i in LAYERS[:-1]], dim=1)
        tensors[f"last_{row}"] = captured["last"][0].clone()
        if row < LOGIT_ROWS:
            tensors[f"logits_{row}"] = out.logits[0].clone()
    save_file(tensors, path)
    return path


@pytest.fixture(scope="session")
def trainer_dataset(small_inputs, demo_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(output_dir with tokenized/ and drafter/, the reference file)."""
    out = build_drafter_dataset(
        [small_inputs], demo_model_dir, tmp_path_factory.mktemp("trainers"), layer_ids=LAYERS, include_final=True
    )
    rows = export_speculators(out / "drafter", out / "tokenized", out / "rows").path  # the row order, ids, masks
    return out, reference_file(demo_model_dir, rows, out / "reference.safetensors")
