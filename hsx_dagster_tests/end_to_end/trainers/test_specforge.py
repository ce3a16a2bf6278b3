"""SpecForge's own offline reading code takes an hsx SpecForge export (issue #22): its manifest reader, feature
loader, per-algorithm normaliser and collator, for the EAGLE-3 and the DFlash layouts; for EAGLE-3 its target head
(the LM head alone) on `hidden_state` gives the target model's logits, so `hidden_state` is the final norm's output,
as SpecForge expects. SpecForge's trainer needs sglang and a GPU: its reading code imports on the CPU without
them, and that is what runs here (in the isolated trainer environment, env.py). Slow: it may build it."""

import json

import pytest

from hsx_dagster.core.export import export_specforge
from hsx_dagster_tests.end_to_end.trainers.env import run_script

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", ["eagle3", "dflash"])
def test_specforge_reader_takes_the_export(layout, trainer_dataset, demo_model_dir, tmp_path):
    out, reference = trainer_dataset
    export = export_specforge(out / "drafter", tmp_path / "specforge", layout=layout).path
    result_file = tmp_path / "read.json"
    run_script("read_specforge.py", export, layout, demo_model_dir, reference, result_file)
    result = json.loads(result_file.read_text())
    assert result["rows"] == 28
    shapes = result["shapes"]  # the last row's, after SpecForge's normaliser: a batch dimension of 1
    length = shapes["input_ids"][1]
    if layout == "eagle3":
        assert shapes["hidden_state"] == [1, length, 3 * 64] and shapes["target"] == [1, length, 64]
        assert min(result["logits_top1"]) >= 0.95 and result["logits_max_error"] < 0.05, result
    else:
        assert shapes["hidden_states"] == [1, length, 4 * 64]
    assert result["batch"]["input_ids"][0] == 4  # its collator batches four rows
