"""A dataset that lives: inputs grow and shrink without re-extracting committed samples (stable shard
membership), through Dagster with a real instance."""

import json
from pathlib import Path

import pytest
from dagster import AssetKey, instance_for_test, materialize

from hsx_dagster.core.dataset import DrafterDataset, assemble, check_coverage, check_shard
from hsx_dagster.core.extraction import run_shard
from hsx_dagster.core.inputs import read_tokenized_shard
from hsx_dagster.core.settings import load_settings
from hsx_dagster.core.storage import read_index
from hsx_dagster.defs.assets.drafter import drafter_dataset
from hsx_dagster.defs.assets.hidden_states import build_hidden_states
from hsx_dagster.defs.assets.tokenized import tokenized_dataset
from hsx_dagster.defs.checks import drafter_checks
from hsx_dagster.defs.partitions import shard_partitions
from hsx_dagster.defs.resources import GpuResource, HsxSettings
from hsx_dagster_tests.support.helpers import shard_job, tokenize, write_settings

SHARDS = ("shard-00", "shard-01")


def living_settings(path: Path, inputs: list[Path], model_dir: Path) -> Path:
    return write_settings(
        path,
        dataset={"paths": inputs, "max_length": 512},
        model={"path": model_dir, "layers": [1, 4]},
        shards=2,
        output_dir="out",
        extraction={"devices": ["cpu"], "batch_size": 8, "chunk_mb": 0.25},
        drafter={"parity_samples": 2},
    )


@pytest.fixture
def extra_inputs(demo_conversations, small_inputs, tmp_path) -> Path:
    """Three more conversations (about 10% of the 28 in small_inputs), short ones, none of them already there."""
    present = {line for line in small_inputs.read_text().splitlines()}
    rows = [json.dumps({"messages": c.as_chat()}) for c in demo_conversations]
    fresh = sorted((row for row in set(rows) if row not in present), key=len)[10:13]
    path = tmp_path / "extra.jsonl"
    path.write_text("".join(row + "\n" for row in fresh))
    return path


def chunk_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("hidden_states/shard-*/chunk-*"))}


def materialize_all(settings_file: Path, instance) -> dict:
    """tokenized_dataset, every shard, drafter_dataset and its checks; each shard's materialization metadata."""
    settings = load_settings(settings_file)
    hidden_states = build_hidden_states(shard_partitions(settings))
    resources = {"settings": HsxSettings(path=str(settings_file)), "gpu": GpuResource.from_settings(settings)}
    assert materialize([tokenized_dataset], resources=resources, instance=instance).success
    per_shard = {}
    for shard in SHARDS:
        assert materialize([hidden_states], resources=resources, partition_key=shard, instance=instance).success
        event = instance.get_latest_materialization_event(AssetKey("hidden_states"))
        per_shard[shard] = {key: value.value for key, value in event.asset_materialization.metadata.items()}
    assembled = materialize([drafter_dataset, *drafter_checks], resources=resources, instance=instance)
    assert all(c.passed for c in assembled.get_asset_check_evaluations())
    return per_shard


def tokenized_metadata(instance) -> dict:
    event = instance.get_latest_materialization_event(AssetKey("tokenized_dataset"))
    return {key: value.value for key, value in event.asset_materialization.metadata.items()}


@pytest.mark.slow  # three passes of the whole pipeline on 28-31 conversations
def test_grow_by_ten_percent_then_shrink_back_without_start_over(small_inputs, extra_inputs, demo_model_dir, tmp_path):
    settings_file = living_settings(tmp_path / "hsx.yaml", [small_inputs], demo_model_dir)
    out = tmp_path / "out"
    with instance_for_test() as instance:
        materialize_all(settings_file, instance)
        before_ids = set(DrafterDataset(out / "drafter").sample_ids)
        before_chunks = chunk_bytes(out)
        assert len(before_ids) == 28

        living_settings(settings_file, [small_inputs, extra_inputs], demo_model_dir)  # +3 conversations
        grown = materialize_all(settings_file, instance)
        tokenized = tokenized_metadata(instance)
        assert tokenized["samples_to_extract"] == 3 and tokenized["stale_shards"]  # shown before the shards ran
        assert sum(m["samples_this_run"] for m in grown.values()) == 3
        assert sum(m["samples_resumed"] for m in grown.values()) == 28
        after = chunk_bytes(out)
        assert {name: after[name] for name in before_chunks} == before_chunks  # every old chunk byte-identical
        grown_ids = set(DrafterDataset(out / "drafter").sample_ids)
        assert len(grown_ids) == 31 and before_ids < grown_ids

        living_settings(settings_file, [small_inputs], demo_model_dir)  # the file removed again
        shrunk = materialize_all(settings_file, instance)
        assert sum(m["samples_this_run"] for m in shrunk.values()) == 0
        assert sum(m["chunks_reclaimed"] for m in shrunk.values()) >= 1  # the new samples' chunks held nothing else
        assert set(DrafterDataset(out / "drafter").sample_ids) == before_ids
        assert chunk_bytes(out) == before_chunks  # what the grown run added is gone, the rest untouched


@pytest.mark.slow  # two tokenizations and three shard runs
def test_removing_every_input_of_a_shard_leaves_an_empty_shard_that_checks_and_assembles(
    small_inputs, demo_model_dir, tmp_path
):
    lines = small_inputs.read_text().splitlines()[:8]
    inputs = tmp_path / "few.jsonl"
    inputs.write_text("".join(line + "\n" for line in lines))
    tokenized, hidden = tmp_path / "tokenized", tmp_path / "hidden_states"
    tokenize([inputs], demo_model_dir, tokenized, shards=2, max_length=64)
    for shard in SHARDS:
        run_shard(
            shard_job(
                shard=shard,
                tokenized_dir=tokenized,
                output_dir=hidden / shard,
                model_path=demo_model_dir,
                layer_ids=(1, 3),
            )
        )
    kept = read_tokenized_shard(tokenized, "shard-00", columns=["source_index"]).column("source_index").to_pylist()
    inputs.write_text("".join(lines[i] + "\n" for i in sorted(kept)))  # every input of shard-01 removed
    summary = tokenize([inputs], demo_model_dir, tokenized, shards=2, max_length=64)
    assert [(s.samples, s.added) for s in summary.shards] == [(len(kept), 0), (0, 0)]

    emptied = run_shard(
        shard_job(
            shard="shard-01",
            tokenized_dir=tokenized,
            output_dir=hidden / "shard-01",
            model_path=demo_model_dir,
            layer_ids=(1, 3),
        )
    )
    assert emptied.report.samples == 0 and emptied.reclaimed_chunks >= 1 and not read_index(hidden / "shard-01")
    outcomes = check_shard(hidden / "shard-01", tokenized, "shard-01", heal=True)
    assert all(o.passed for o in outcomes.values()), {k: o.description for k, o in outcomes.items()}
    summary = assemble(tokenized, hidden, list(SHARDS), tmp_path / "drafter", val_fraction=0.1, settings={})
    assert summary.samples == len(kept) and [s.samples for s in summary.shards] == [len(kept), 0]
    assert check_coverage(tmp_path / "drafter", tokenized).passed
