"""The seams over foreign private APIs: every private use of Dagster and transformers sits in one module each,
checked on the releases that module lists; another release installed fails here, naming the seam to re-check."""

import re
from pathlib import Path

import dagster
import pytest
import transformers

from hsx_dagster import dagster_internals
from hsx_dagster.core import transformers_internals
from hsx_dagster.core.transformers_internals import AttentionFlags, attn_implementation_in_use

REPO = Path(__file__).resolve().parents[1]
SEAMS = {
    "dagster": (dagster_internals, dagster.__version__),
    "transformers": (transformers_internals, transformers.__version__),
}
# What only a seam may use: Dagster's private modules and event log storage, transformers' private attributes.
PRIVATE_USES = re.compile(
    r"\bdagster\._|\bevent_log_storage\b|\b_create_run\b|\._model_mapping\b|\b_supports_sdpa\b"
    r"|\b_supports_flash_attn\b|\b_compatible_flash_implementations\b|\b_attn_implementation\b"
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
