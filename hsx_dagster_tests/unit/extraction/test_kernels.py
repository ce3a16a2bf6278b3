"""The kernels a hybrid target's linear-attention layers run: named in the shard's metadata, run log and report,
and a warning before the model loads when a GPU would run them on transformers' PyTorch reference path.

No GPU here: the demo hybrid on the CPU must say the PyTorch path ran; the warning's decision is a function of
the device type and of what transformers found, and its place (before any weight loads) is shown by a CUDA
load whose `from_pretrained` is replaced by one that stops the run.
"""

from __future__ import annotations

import json

import pytest
import torch

from hsx_dagster.core.extraction import (
    INSTALL_HINT,
    describe_kernels,
    fast_kernel_warning,
    kernel_packages_found,
    kernels_in_use,
    load_backbone,
    load_text_decoder,
    run_shard,
    text_model_class,
)
from hsx_dagster.core.model import check_model_dir
from hsx_dagster_tests.unit.extraction.test_engine import make_job

PYTORCH_PATH = "PyTorch reference path"


@pytest.mark.parametrize(
    "device_type, found, missing",
    [
        ("cuda", {"fla": False, "causal_conv1d": False}, ["flash-linear-attention", "causal-conv1d"]),
        ("cuda", {"fla": True, "causal_conv1d": False}, ["causal-conv1d"]),
        ("cuda", {"fla": False, "causal_conv1d": True}, ["flash-linear-attention"]),
        ("cuda", {"fla": True, "causal_conv1d": True}, []),
        ("cuda", {}, []),  # a dense target: nothing to warn about
        ("cpu", {"fla": False, "causal_conv1d": False}, []),  # the PyTorch path is the only one on a CPU
        ("mps", {"fla": False}, []),
    ],
)
def test_the_warning_names_what_is_missing_on_cuda_only(device_type, found, missing):
    warning = fast_kernel_warning(device_type, found, "Qwen3_5TextModel")
    if not missing:
        assert warning is None
        return
    assert warning is not None and warning.startswith("Qwen3_5TextModel has layers whose")
    command = INSTALL_HINT.format(packages=" ".join(sorted(missing)))
    assert command in warning  # the pip command that fixes it, with exactly the missing packages
    installed = {"flash-linear-attention", "causal-conv1d"} - set(missing)
    assert all(name not in warning for name in installed)


def test_the_demo_hybrid_runs_the_pytorch_path_on_a_cpu(demo_model_dir):
    info = load_backbone(check_model_dir(demo_model_dir), [1, 3]).info
    uses = {use.role: use for use in info.kernels}
    assert set(uses) == {"linear attention", "causal conv1d"}
    linear = uses["linear attention"]
    assert linear.distribution == "flash-linear-attention" and not linear.fast
    assert any(name.endswith("modeling_qwen3_5.torch_chunk_gated_delta_rule") for name in linear.functions)
    assert linear.why == "the only path on a CPU"
    assert uses["causal conv1d"].distribution == "causal-conv1d" and not uses["causal conv1d"].fast
    line = describe_kernels(info.attn_implementation, info.kernels)
    assert line.startswith("attention: sdpa; linear attention: PyTorch reference path (torch_chunk_gated_delta_rule")


def test_a_dense_target_has_no_linear_attention_kernels(dense_model_dir):
    info = load_backbone(check_model_dir(dense_model_dir), [1, 3]).info
    assert info.kernels == ()
    assert describe_kernels(info.attn_implementation, info.kernels) == f"attention: {info.attn_implementation}"


def test_the_warning_comes_before_the_weights_load_on_cuda(demo_model_dir, monkeypatch):
    model = check_model_dir(demo_model_dir)
    from transformers import AutoConfig

    model_class = text_model_class(AutoConfig.from_pretrained(str(demo_model_dir)).get_text_config(), model.path)
    found = kernel_packages_found(model_class)
    assert set(found) == {"fla", "causal_conv1d"}
    events: list[str] = []

    def stop_before_loading(*args, **kwargs):
        events.append("from_pretrained")
        raise RuntimeError("stopped before loading")

    monkeypatch.setattr(model_class, "from_pretrained", stop_before_loading)
    with pytest.raises(RuntimeError, match="stopped before loading"):
        load_text_decoder(model, 2, device="cuda", compute_dtype=torch.bfloat16, warn=events.append)
    expected = fast_kernel_warning("cuda", found, model_class.__name__)
    if expected is None:  # this environment has both kernel packages: nothing to warn about
        assert events == ["from_pretrained"]
    else:
        assert events == [expected, "from_pretrained"]
        assert "pip install --no-build-isolation" in expected

    events.clear()
    with pytest.raises(RuntimeError, match="stopped before loading"):
        load_text_decoder(model, 2, device="cpu", warn=events.append)
    assert events == ["from_pretrained"]  # no warning on a CPU


def test_the_kernels_are_in_the_metadata_the_log_and_the_report(tokenized, demo_model_dir, tmp_path):
    from hsx_dagster.defs.assets.hidden_states import hidden_states_metadata
    from hsx_dagster.report import kernel_lines

    job = make_job(tokenized, tmp_path / "out", demo_model_dir, (1, 4))
    messages: list[str] = []
    result = run_shard(job, log_line=messages.append)
    assert any(m.startswith("shard-00: attention: sdpa; linear attention: " + PYTORCH_PATH) for m in messages)

    metadata = hidden_states_metadata(result, job)
    assert metadata["attention"] == "sdpa"
    assert metadata["linear attention"].startswith(PYTORCH_PATH + " (torch_chunk_gated_delta_rule")
    assert metadata["causal conv1d"].startswith(PYTORCH_PATH + " (causal_conv1d_fn")

    last_run = json.loads((tmp_path / "out" / "complete.json").read_text())["last_run"]
    recorded = last_run["kernels"]
    assert recorded["attention"] == "sdpa"
    assert [use["distribution"] for use in recorded["linear_attention"]] == ["flash-linear-attention", "causal-conv1d"]
    assert not any(use["fast"] for use in recorded["linear_attention"])
    assert kernel_lines(last_run) == [f"      kernels {describe_kernels('sdpa', result.backbone.kernels)}"]

    again = run_shard(job)  # nothing left to do: no model loaded, nothing claimed about kernels
    assert again.backbone is None
    assert "kernels" not in json.loads((tmp_path / "out" / "complete.json").read_text())["last_run"]
    assert kernels_in_use(torch.nn.Linear(2, 2), "cpu") == ()
