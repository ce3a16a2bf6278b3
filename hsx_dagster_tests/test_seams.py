"""The seams over foreign private APIs: every private use of Dagster and transformers sits in one module each,
checked on the releases that module lists; another release installed fails here, naming the seam to re-check."""

import re
from pathlib import Path

import dagster
import pytest
import torch
import transformers

from hsx_dagster.core.model import (
    AttentionFlags,
    attn_implementation_in_use,
    kernel_fallbacks,
    package_distribution,
    transformers_internals,
)
from hsx_dagster.defs_support import dagster_internals
from hsx_dagster_tests.support import dagster_internals as dagster_internals_of_tests
from hsx_dagster_tests.support.paths import REPO

SEAMS = {
    "dagster": (dagster_internals, dagster.__version__),
    "dagster (the tests' calls)": (dagster_internals_of_tests, dagster.__version__),
    "transformers": (transformers_internals, transformers.__version__),
}
# What only a seam may use: Dagster's private modules and event log storage, transformers' private attributes.
PRIVATE_USES = re.compile(
    r"\bdagster\._|\bevent_log_storage\b|\b_create_run\b|\._model_mapping\b|\b_supports_sdpa\b"
    r"|\b_supports_flash_attn\b|\b_compatible_flash_implementations\b|\b_attn_implementation\b"
    r"|\b_PACKAGE_TO_DISTRIBUTION\b|\b_PACKAGE_SUPPORTED_DEVICES\b"
)


@pytest.mark.parametrize("library", sorted(SEAMS))
def test_the_installed_release_is_one_the_seam_was_checked_on(library):
    seam, installed = SEAMS[library]
    path = Path(seam.__file__).relative_to(REPO)
    assert installed in seam.CHECKED_ON, (
        f"{library} {installed} is installed, but {path} (every private use of {library}) was checked on "
        f"{', '.join(seam.CHECKED_ON)} only: re-read its uses against {installed}, then add it to CHECKED_ON there "
        "and to constraints.txt"
    )


def test_private_uses_live_in_their_seam_only():
    seams = {Path(seam.__file__).resolve() for seam, _ in SEAMS.values()}
    found = []
    for folder in ("hsx_dagster", "hsx_dagster_tests", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.resolve() in seams or path.resolve() == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if PRIVATE_USES.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == [], "private API used outside its seam:\n" + "\n".join(found)


def test_the_attention_flags_mean_what_the_extraction_reads_them_as():
    llama, gpt_oss = AttentionFlags.of(transformers.LlamaModel), AttentionFlags.of(transformers.GptOssModel)
    assert (llama.sdpa, llama.flash, llama.flash_variants) == (True, True, None)
    assert (gpt_oss.sdpa, gpt_oss.flash) == (False, True)  # attention sinks: no sdpa, only some flash kernels
    assert gpt_oss.flash_variants is not None and "flash_attention_4" in gpt_oss.flash_variants
    assert "flash_attention_2" not in gpt_oss.flash_variants
    for implementation in ("eager", "sdpa"):
        config = transformers.LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            attn_implementation=implementation,
        )
        assert attn_implementation_in_use(transformers.LlamaModel(config)) == implementation


def test_the_kernel_fallbacks_mean_what_the_extraction_reads_them_as(monkeypatch):
    """transformers' own fallback wrapper around a stand-in kernel package: the seam must say what it chose and
    what a call runs on each device, and a real call on the CPU must run what the seam says."""
    import sys
    import types

    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    calls: list[str] = []

    def package_function(x):
        calls.append("package")
        return x

    def torch_causal_conv1d_fn(x):
        calls.append("torch")
        return x

    # causal_conv1d: a package transformers runs on CUDA only; hsx_test_kernels: one it runs on every device
    for package in ("causal_conv1d", "hsx_test_kernels"):
        monkeypatch.setitem(sys.modules, package, types.SimpleNamespace(causal_conv1d_fn=package_function))
    module = types.ModuleType("stand_in_modeling")
    module.restricted = use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")(
        torch_causal_conv1d_fn
    )
    module.everywhere = use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "hsx_test_kernels")(
        torch_causal_conv1d_fn
    )
    module.missing = use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "hsx_not_installed")(
        torch_causal_conv1d_fn
    )
    fallbacks = {f.name: f for f in kernel_fallbacks(module)}
    assert set(fallbacks) == {"restricted", "everywhere", "missing"}
    restricted, everywhere, missing = fallbacks["restricted"], fallbacks["everywhere"], fallbacks["missing"]
    assert restricted.imported and restricted.package == "causal_conv1d" and "cpu" not in restricted.devices
    assert restricted.runs("cuda") is package_function and restricted.runs("cpu") is torch_causal_conv1d_fn
    assert everywhere.imported and everywhere.devices is None and everywhere.runs("cpu") is package_function
    assert not missing.imported and missing.runs("cuda") is torch_causal_conv1d_fn
    x = torch.zeros(2)
    for name, fallback in fallbacks.items():
        calls.clear()
        getattr(module, name)(x)
        assert calls == ["package" if fallback.runs("cpu") is package_function else "torch"], name
    assert package_distribution("fla") == "flash-linear-attention"
    assert package_distribution("causal_conv1d") == "causal-conv1d"

    # and the Gated DeltaNet layers of the installed transformers are routed through it
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

    names = {f.name: f.package for f in kernel_fallbacks(qwen3_5)}
    assert names["torch_chunk_gated_delta_rule"] == "fla" and names["causal_conv1d_fn"] == "causal_conv1d"
