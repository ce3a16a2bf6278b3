"""Stored tensors against an independent per-sample reference forward pass, resume, and OOM.

The reference is the plain Hugging Face way, one sample at a time: `AutoModelForCausalLM`,
`output_hidden_states=True`, layer id i read at index i + 1; the final state is the last entry
(after the final norm). Nothing of the engine (batching, padding, hooks, gathering) is shared.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx_dagster.core.extraction import Backbone, ShardJob, run_shard
from hsx_dagster.core.inputs import read_tokenized_shard
from hsx_dagster.core.storage import SHARD_INDEX_FILE, StoreError, iter_shard_samples
from hsx_dagster_tests.support.helpers import provenance_of, shard_job
from hsx_dagster_tests.support.sweeps import sweep


def job_keys(tokenized: Path, out: Path, model: Path, layers, **overrides) -> dict:
    """This module's shard job as flat settings keys (see helpers.shard_job)."""
    keys = dict(
        tokenized_dir=tokenized,
        output_dir=out,
        model_path=model,
        layer_ids=tuple(layers),
        storage_dtype="float32",
        batch_size=8,
        max_batch_tokens=4096,
        chunk_bytes=256 * 1024,
    )
    return {**keys, **overrides}


def make_job(tokenized: Path, out: Path, model: Path, layers, **overrides) -> ShardJob:
    return shard_job(**job_keys(tokenized, out, model, layers, **overrides))


_REFERENCES: dict = {}


def reference_states(model_dir: Path, tokenized: Path) -> dict[int, tuple]:
    """sample_id -> hidden_states tuple of a per-sample forward pass (cached per model)."""
    if model_dir not in _REFERENCES:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        table = read_tokenized_shard(tokenized, "shard-00")
        states = {}
        with torch.inference_mode():
            for row in table.select(["sample_id", "input_ids"]).to_pylist():
                out = model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True)
                states[row["sample_id"]] = tuple(h[0] for h in out.hidden_states)
        _REFERENCES[model_dir] = states
    return _REFERENCES[model_dir]


def stored_samples(out: Path) -> dict[int, dict]:
    samples = {}
    for sample in iter_shard_samples(out):
        assert sample["sample_id"] not in samples, "a sample was stored twice"
        samples[sample["sample_id"]] = sample
    return samples


@pytest.mark.parametrize("model_name", ["dense", "hybrid"])
# Quick loop: one fixed shape (test_batch_shape checks a probed run against it); the whole suite adds one batch
# of everything, tiny batches and the probed shape.
@pytest.mark.parametrize(
    "batch_size, max_batch_tokens",
    sweep([(8, 4096), (28, 2048), (3, 100_000), ("auto", "auto")], quick=[(8, 4096)]),
)
def test_stored_states_equal_a_per_sample_reference_fp32(
    model_name, batch_size, max_batch_tokens, tokenized, demo_model_dir, dense_model_dir, tmp_path
):
    model = dense_model_dir if model_name == "dense" else demo_model_dir
    layers = (0, 2, 3) if model_name == "dense" else (1, 3, 4)
    job = make_job(
        tokenized,
        tmp_path / "out",
        model,
        layers,
        include_final=True,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
    )
    result = run_shard(job)
    reference = reference_states(model, tokenized)
    table = read_tokenized_shard(tokenized, "shard-00")
    stored = stored_samples(tmp_path / "out")
    assert set(stored) == set(reference) and result.totals.samples == len(reference)
    assert result.report.padding_efficiency < 1.0 or batch_size == 1  # mixed lengths in one batch
    for row in table.select(["sample_id", "input_ids", "loss_mask"]).to_pylist():
        sample, ref = stored[row["sample_id"]], reference[row["sample_id"]]
        assert sample["input_ids"].tolist() == row["input_ids"] and sample["input_ids"].dtype == torch.int64
        assert sample["loss_mask"].tolist() == row["loss_mask"]
        expected = torch.stack([ref[i + 1] for i in layers], dim=1)
        assert sample["hidden_states"].shape == expected.shape
        torch.testing.assert_close(sample["hidden_states"], expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sample["final_hidden_states"], ref[-1], rtol=1e-4, atol=1e-4)


def test_bf16_storage_is_the_reference_rounded(tokenized, demo_model_dir, tmp_path):
    layers = (1, 3, 4)
    run_shard(make_job(tokenized, tmp_path / "out", demo_model_dir, layers, storage_dtype="bfloat16"))
    reference = reference_states(demo_model_dir, tokenized)
    for sample_id, sample in stored_samples(tmp_path / "out").items():
        assert sample["hidden_states"].dtype == torch.bfloat16 and "final_hidden_states" not in sample
        expected = torch.stack([reference[sample_id][i + 1] for i in layers], dim=1)
        # bf16 keeps 8 significant bits: within half a unit in the last place, plus fp32 noise.
        error = (sample["hidden_states"].float() - expected).abs()
        assert torch.all(error <= expected.abs() * 2**-8 + 1e-5)


@pytest.mark.slow  # two shard runs (the quick loop checks what is loaded in test_model_families)
def test_only_needed_layers_are_loaded(tokenized, demo_model_dir, tmp_path):
    result = run_shard(make_job(tokenized, tmp_path / "out", demo_model_dir, (1, 3)))
    assert (result.backbone.kept_layers, result.backbone.num_layers) == (4, 8)
    final = run_shard(make_job(tokenized, tmp_path / "out2", demo_model_dir, (1, 3), include_final=True))
    assert final.backbone.kept_layers == 8


# The engine's bookkeeping (resume, leftovers, refusals, out-of-memory splits) is the same for every model: these
# tests run the dense tiny model, faster than the hybrid, whose states the reference tests check.
def test_resume_after_a_crash_gives_the_same_content(tokenized, dense_model_dir, tmp_path, monkeypatch):
    layers = (1, 4)
    run_shard(make_job(tokenized, tmp_path / "clean", dense_model_dir, layers, batch_size=4))
    clean = stored_samples(tmp_path / "clean")

    calls = {"n": 0}
    original = Backbone.forward

    def crash_on_fourth_batch(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated crash: the node went away")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Backbone, "forward", crash_on_fourth_batch)
    out = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_shard(make_job(tokenized, out, dense_model_dir, layers, batch_size=4, chunk_bytes=1))
    index_lines = (out / SHARD_INDEX_FILE).read_text().splitlines()
    committed = [json.loads(line)["samples"] for line in index_lines]
    assert sum(committed) == 12  # the three finished batches of 4 were committed
    assert committed == [1] * 12  # chunk_bytes=1: every sample alone in its chunk (a chunk never outgrows it)
    first_chunks = {line: (out / json.loads(line)["chunk"]).stat().st_mtime_ns for line in index_lines}
    assert not (out / "complete.json").exists()

    monkeypatch.setattr(Backbone, "forward", original)
    result = run_shard(make_job(tokenized, out, dense_model_dir, layers, batch_size=4, chunk_bytes=1))
    assert result.report.samples_skipped == 12 and result.report.samples == 28 - 12
    assert (out / SHARD_INDEX_FILE).read_text().splitlines()[:12] == index_lines
    assert all((out / json.loads(line)["chunk"]).stat().st_mtime_ns == mtime for line, mtime in first_chunks.items())
    resumed = stored_samples(out)
    assert resumed.keys() == clean.keys()
    for sample_id, sample in resumed.items():
        torch.testing.assert_close(sample["hidden_states"], clean[sample_id]["hidden_states"], rtol=1e-5, atol=1e-5)
    assert (out / "complete.json").is_file()
    assert not [p for p in out.iterdir() if ".tmp" in p.name]

    again = run_shard(make_job(tokenized, out, dense_model_dir, layers, batch_size=4, chunk_bytes=1))
    assert again.report.samples == 0 and again.report.samples_skipped == 28  # nothing is redone


def test_out_of_memory_splits_batches_and_loses_nothing(tokenized, dense_model_dir, tmp_path, monkeypatch):
    original = Backbone.forward

    def small_device(self, input_ids, attention_mask):
        if input_ids.numel() > 1500:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return original(self, input_ids, attention_mask)

    monkeypatch.setattr(Backbone, "forward", small_device)
    messages = []
    result = run_shard(
        make_job(tokenized, tmp_path / "out", dense_model_dir, (1, 4), batch_size=16, max_batch_tokens=100_000),
        log_line=messages.append,
    )
    assert result.report.oom_splits > 0
    assert result.report.final_max_batch_tokens < 100_000
    assert any("out of memory" in m and "lowered max_batch_tokens" in m for m in messages)
    stored = stored_samples(tmp_path / "out")
    table = read_tokenized_shard(tokenized, "shard-00")
    assert sorted(stored) == sorted(table.column("sample_id").to_pylist())


def test_a_single_sample_too_large_fails_clearly(tokenized, demo_model_dir, tmp_path, monkeypatch):
    def no_memory(self, input_ids, attention_mask):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(Backbone, "forward", no_memory)
    with pytest.raises(RuntimeError, match=r"out of memory on a single sample of .* tokens; lower dataset\.max_length"):
        run_shard(make_job(tokenized, tmp_path / "out", demo_model_dir, (1,)))


def test_changed_layers_under_existing_output_are_refused(tokenized, dense_model_dir, tmp_path):
    run_shard(make_job(tokenized, tmp_path / "out", dense_model_dir, (1, 4)))
    with pytest.raises(StoreError, match=r"layer_ids: \[1, 4\] -> \[1, 3\].*Refusing to mix"):
        run_shard(make_job(tokenized, tmp_path / "out", dense_model_dir, (1, 3)))


def test_no_padding_is_stored(tokenized, demo_model_dir, tmp_path):
    result = run_shard(make_job(tokenized, tmp_path / "out", demo_model_dir, (1, 4), storage_dtype="bfloat16"))
    table = read_tokenized_shard(tokenized, "shard-00")
    tokens = int(np.sum(table.column("num_tokens").to_numpy()))
    payload = tokens * 2 * 64 * 2  # tokens x layers x hidden x bf16
    assert result.totals.tokens == tokens
    # Ids, masks and offsets cost 5 bytes per token plus a header: never a padded row.
    assert payload < result.totals.bytes < payload + tokens * 6 + 64 * 1024


def test_leftovers_of_a_crash_are_cleaned_and_redone(tokenized, dense_model_dir, tmp_path):
    """A crash between rename and index append leaves an orphan chunk; one during the append leaves a
    torn index line; one during a write leaves a temporary. A re-run removes all three and redoes
    exactly the uncommitted samples."""
    out = tmp_path / "out"
    # chunk_bytes=1: every batch is cut into chunks of one sample; the one redone is computed in its batch again.
    run_shard(make_job(tokenized, out, dense_model_dir, (1, 4), batch_size=4, chunk_bytes=1))
    clean = stored_samples(out)
    lines = (out / SHARD_INDEX_FILE).read_text().splitlines(keepends=True)
    last = json.loads(lines[-1])
    # Un-commit the last chunk: its file stays (orphan), its index line is torn in half.
    (out / SHARD_INDEX_FILE).write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    (out / ".chunk-000099.safetensors.tmp-123").write_bytes(b"half a chunk")
    (out / "complete.json").unlink()

    result = run_shard(make_job(tokenized, out, dense_model_dir, (1, 4), batch_size=4, chunk_bytes=1))
    assert result.report.samples == last["samples"]
    assert sorted(p.name for p in out.iterdir() if ".tmp" in p.name) == []
    assert (out / SHARD_INDEX_FILE).read_text().endswith("\n") and len(
        (out / SHARD_INDEX_FILE).read_text().splitlines()
    ) == len(lines)
    again = stored_samples(out)
    assert again.keys() == clean.keys()
    for sample_id in clean:
        assert torch.equal(again[sample_id]["hidden_states"], clean[sample_id]["hidden_states"])


def test_two_runs_of_one_shard_never_both_write(tokenized, demo_model_dir, tmp_path):
    from hsx_dagster.core.storage import ShardStore

    made = provenance_of(tmp_path / "out")
    with ShardStore(tmp_path / "out", made), pytest.raises(StoreError, match="being written by another run"):
        ShardStore(tmp_path / "out", made)
    ShardStore(tmp_path / "out", made).close()  # released with its holder


def test_flash_attention_without_the_package_is_a_clear_error(tokenized, demo_model_dir, tmp_path):
    import importlib.util

    from hsx_dagster.core.extraction import BackboneError

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(BackboneError, match="flash_attention_2 but flash-attn is not installed"):
        run_shard(make_job(tokenized, tmp_path / "out", demo_model_dir, (1,), attn_implementation="flash_attention_2"))


def test_rerunning_a_complete_shard_loads_no_model(tokenized, dense_model_dir, tmp_path, monkeypatch):
    from hsx_dagster.core.extraction import shard_run as shard_run_module

    job = make_job(tokenized, tmp_path / "out", dense_model_dir, (1, 3))
    first = run_shard(job)
    chunks = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("chunk-*")}

    def must_not_load(*args, **kwargs):
        raise AssertionError("a complete shard loaded the model again")

    monkeypatch.setattr(shard_run_module, "load_backbone", must_not_load)
    again = run_shard(job)
    assert again.backbone is None and again.report.samples == 0 and again.report.samples_skipped == 28
    assert again.totals == first.totals and (tmp_path / "out" / "complete.json").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("chunk-*")} == chunks
