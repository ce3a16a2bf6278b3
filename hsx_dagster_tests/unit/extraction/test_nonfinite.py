"""NaN or Inf in extracted states: the shard fails naming the samples (keeping what was good), or,
with nan_policy: quarantine, the samples are set aside with a reason and everything else is stored;
the drafter dataset and its checks account for them."""

from pathlib import Path

import pytest
import torch

from hsx_dagster.core.dataset import assemble, check_coverage
from hsx_dagster.core.extraction import Backbone, ShardJob, run_shard
from hsx_dagster.core.inputs import read_tokenized_shard
from hsx_dagster.core.storage import DRAFTER_QUARANTINE_FILE, NonFiniteStatesError, iter_shard_samples, read_quarantine
from hsx_dagster_tests.support.helpers import shard_job
from hsx_dagster_tests.support.sweeps import sweep


@pytest.fixture
def poisoned(tokenized, monkeypatch) -> dict[int, str]:
    """Two samples whose layer-4 states get a NaN and an Inf, found by their tokens in the batch."""
    table = read_tokenized_shard(tokenized, "shard-00", columns=["sample_id", "input_ids"]).to_pylist()
    targets = {table[5]["sample_id"]: table[5]["input_ids"], table[17]["sample_id"]: table[17]["input_ids"]}
    original = Backbone.forward

    def forward(self, input_ids, attention_mask):
        captured = original(self, input_ids, attention_mask)
        for row in range(input_ids.shape[0]):
            length = int(attention_mask[row].sum())
            for poison, tokens in zip((float("nan"), float("inf")), targets.values()):
                if input_ids[row, :length].tolist() == tokens:
                    with torch.inference_mode():
                        captured[4][row, length // 2, 7] = poison
        return captured

    monkeypatch.setattr(Backbone, "forward", forward)
    return targets


def job(tokenized: Path, out: Path, model: Path, **overrides) -> ShardJob:
    return shard_job(
        **{
            **dict(
                shard="shard-00",
                shard_index=0,
                tokenized_dir=tokenized,
                output_dir=out,
                model_path=model,
                layer_ids=(1, 4),
                devices=("cpu",),
                storage_dtype="bfloat16",
                batch_size=4,
                max_batch_tokens=4096,
                chunk_bytes=50_000,
            ),
            **overrides,
        }
    )


def test_nan_fails_the_shard_naming_samples_and_layer_and_keeps_good_work(
    poisoned, tokenized, demo_model_dir, tmp_path
):
    with pytest.raises(NonFiniteStatesError) as failed:
        run_shard(job(tokenized, tmp_path / "out", demo_model_dir))
    message = str(failed.value)
    assert (
        any(f"sample {bad}: NaN or Inf in 1 of" in message for bad in poisoned)
        and "(layer 4)" in message
        and "nan_policy: quarantine" in message
    )
    stored = {s["sample_id"] for s in iter_shard_samples(tmp_path / "out")}
    assert stored and not stored & set(poisoned)  # what was fine before it is committed, nothing poisoned is
    assert not (tmp_path / "out" / "complete.json").exists()


@pytest.mark.parametrize("storage_dtype", sweep(["bfloat16", "float8_e4m3"], quick=["bfloat16"]))
def test_quarantine_sets_samples_aside_with_a_reason(storage_dtype, poisoned, tokenized, demo_model_dir, tmp_path):
    out = tmp_path / "hidden_states" / "shard-00"
    result = run_shard(job(tokenized, out, demo_model_dir, nan_policy="quarantine", storage_dtype=storage_dtype))
    quarantined = {record.sample_id: record for record in read_quarantine(out)}
    assert set(quarantined) == set(poisoned) and result.quarantined == 2
    assert all(r.reason == "non_finite_states" and "(layer 4)" in r.detail for r in quarantined.values())
    stored = {s["sample_id"]: s for s in iter_shard_samples(out)}
    assert len(stored) == 26 and not set(stored) & set(poisoned)
    assert all(bool(torch.isfinite(s["hidden_states"].float()).all()) for s in stored.values())

    # a re-run neither redoes nor loses them; the dataset lists them and coverage accounts for them
    again = run_shard(job(tokenized, out, demo_model_dir, nan_policy="quarantine", storage_dtype=storage_dtype))
    assert again.report.samples == 0 and again.quarantined == 2
    summary = assemble(
        tokenized, tmp_path / "hidden_states", ["shard-00"], tmp_path / "drafter", val_fraction=0.2, settings={}
    )
    quarantined = (summary.manifest.quarantined_samples, summary.manifest.quarantine_file)
    assert quarantined == (2, DRAFTER_QUARANTINE_FILE) and summary.samples == 26
    coverage = check_coverage(tmp_path / "drafter", tokenized)
    assert coverage.passed and coverage.metadata["quarantined"] == 2, coverage.description
