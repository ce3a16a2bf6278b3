"""The Dagster layer through real instances: definitions load, the tokenized_dataset asset and its
check materialize with metadata, the CLI entry point users run works, and bad settings fail early."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import AssetKey, AssetSelection, DagsterInstance, instance_for_test, materialize

from hsx_dagster.core.inputs import TokenizedSummary
from hsx_dagster.core.settings import SettingsError, load_settings
from hsx_dagster.defs.assets.drafter import drafter_dataset
from hsx_dagster.defs.assets.hidden_states import build_hidden_states
from hsx_dagster.defs.assets.tokenized import tokenized_dataset
from hsx_dagster.defs.build import build_definitions
from hsx_dagster.defs.checks import drafter_checks, tokenized_dataset_consistent
from hsx_dagster.defs.partitions import shard_partitions
from hsx_dagster.defs.resources import GpuResource, HsxSettings
from hsx_dagster.defs_support.dagster_internals import pool_limits
from hsx_dagster_tests.support.helpers import write_settings
from hsx_dagster_tests.support.paths import REPO


def three_shards(folder: Path, inputs: list[Path], model_dir: Path) -> Path:
    return write_settings(
        folder / "hsx.yaml",
        dataset={"paths": inputs, "min_loss_tokens": 4},
        model={"path": model_dir, "layers": "eagle3"},
        shards=3,
        output_dir="out",
    )


@pytest.fixture
def settings_file(tmp_path, demo_paths, demo_model_dir) -> Path:
    """The whole demo corpus (rejects included) in three shards."""
    return three_shards(tmp_path, demo_paths, demo_model_dir)


@pytest.fixture
def small_corpus_settings_file(tmp_path, small_inputs, demo_model_dir) -> Path:
    """The same settings over 28 conversations: for what does not need the whole corpus."""
    return three_shards(tmp_path, [small_inputs], demo_model_dir)


def test_definitions_graph_partitions_and_resources(settings_file):
    defs = build_definitions(load_settings(settings_file))
    graph = defs.resolve_asset_graph()
    keys = {key.to_user_string() for key in graph.get_all_asset_keys()}
    assert keys == {"conversations", "target_model", "tokenized_dataset", "hidden_states", "drafter_dataset",
                    "speculators_dataset", "specforge_dataset"}  # fmt: skip
    assert graph.get(AssetKey("conversations")).is_observable and graph.get(AssetKey("target_model")).is_observable
    hidden = defs.resolve_assets_def("hidden_states")
    assert hidden.op.name == "extract_hidden_states"
    assert "gpu" in hidden.required_resource_keys
    assert hidden.partitions_def.get_partition_keys() == ["shard-00", "shard-01", "shard-02"]
    inputs = {AssetKey("conversations"), AssetKey("target_model")}  # one-hop staleness: each asset names its inputs
    assert graph.get(AssetKey("tokenized_dataset")).parent_keys == inputs
    assert graph.get(AssetKey("hidden_states")).parent_keys == {AssetKey("tokenized_dataset"), *inputs}
    assert graph.get(AssetKey("drafter_dataset")).parent_keys == {AssetKey("hidden_states"), *inputs}
    assert {key.name for key in graph.asset_check_keys if key.asset_key == AssetKey("hidden_states")} == {
        "shard_coverage",
        "shard_integrity",
        "shard_numerics",
    }
    assert all(graph.get(key).code_version for key in graph.materializable_asset_keys)


def test_the_module_definitions_load_from_the_repo_settings():
    from hsx_dagster.definitions import defs

    assert (
        defs.resolve_assets_def("hidden_states").partitions_def.get_partition_keys()
        == load_settings(REPO / "hsx.yaml").shard_keys
    )


@pytest.mark.slow  # the whole demo corpus through Dagster (the quick loop materializes the asset on 28 conversations)
def test_tokenized_dataset_materializes_with_metadata_and_passing_check(settings_file):
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 2}}}) as instance:
        assert pool_limits(instance) == []
        result = materialize(
            [tokenized_dataset, tokenized_dataset_consistent],
            resources={"settings": HsxSettings(path=str(settings_file))},
            instance=instance,
        )
        assert result.success
        event = instance.get_latest_materialization_event(AssetKey("tokenized_dataset"))
        metadata = event.asset_materialization.metadata
        summary = TokenizedSummary.read(settings_file.parent / "out" / "tokenized")
        assert metadata["dagster/row_count"].value == summary.samples >= 2000
        assert metadata["tokens"].value.startswith(f"{summary.tokens:,}, {summary.loss_tokens:,} supervised")
        assert metadata["rejected"].value == f"{summary.rejected:,}" and summary.rejected > 0
        rejects = {row.data["reason"]: row.data["count"] for row in metadata["rejects by reason"].value.records}
        assert rejects == {reason: f"{count:,}" for reason, count in summary.rejects.items()}
        assert metadata["shards"].value.startswith("3, token imbalance max/mean 1.00")
        assert "| shard-02 |" in metadata["per shard"].value
        assert "| tokens | samples |" in metadata["token lengths"].value
        # disk estimate per storage dtype and shard, before any model loads, one table with totals
        estimate = metadata["estimated size of hidden states"].value
        assert "| shard-02 |" in estimate and "| **total** |" in estimate and "float8_e4m3" in estimate
        assert "bytes" not in " ".join(metadata)  # sizes carry their unit; no raw byte counts
        checks = result.get_asset_check_evaluations()
        assert [(c.check_name, c.passed) for c in checks] == [("tokenized_dataset_consistent", True)]
        # the extraction pool is set up before any shard claims it (hsx_dagster/defs_support/pools.py)
        assert [(p.name, p.limit, p.from_default) for p in pool_limits(instance)] == [("gpu", 2, True)]


def test_run_config_overrides_settings(small_corpus_settings_file):
    with instance_for_test() as instance:
        result = materialize(
            [tokenized_dataset],
            resources={"settings": HsxSettings(path=str(small_corpus_settings_file))},
            instance=instance,
            run_config={"ops": {"tokenized_dataset": {"config": {"max_length": 128}}}},
        )
        assert result.success
    summary = TokenizedSummary.read(small_corpus_settings_file.parent / "out" / "tokenized")
    assert summary.options["max_length"] == 128
    assert max(b.max for b in summary.histogram if b.samples) <= 128


def test_check_fails_when_a_shard_file_is_tampered_with(small_corpus_settings_file):
    import pyarrow.parquet as pq

    with instance_for_test() as instance:
        resources = {"settings": HsxSettings(path=str(small_corpus_settings_file))}
        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        shard = small_corpus_settings_file.parent / "out" / "tokenized" / "samples" / "shard-01.parquet"
        table = pq.read_table(shard)
        pq.write_table(table.slice(0, table.num_rows - 1), shard)
        result = materialize(
            [tokenized_dataset, tokenized_dataset_consistent],
            resources=resources,
            instance=instance,
            selection=AssetSelection.checks(tokenized_dataset_consistent),
            raise_on_error=False,
        )
        (evaluation,) = result.get_asset_check_evaluations()
        assert not evaluation.passed
        assert "shard-01.parquet" in evaluation.description


def test_bad_settings_fail_at_definition_load_with_the_key(tmp_path, settings_file):
    text = settings_file.read_text().replace("layers: eagle3", "layers: [1, 99]")
    settings_file.write_text(text)
    with pytest.raises(SettingsError, match=r"key `model.layers`: item \[1\]: layer id 99 is out of range"):
        build_definitions(load_settings(settings_file))


@pytest.fixture
def small_settings_file(tmp_path, small_inputs, demo_model_dir) -> Path:
    """28 conversations, two shards, small chunks: the whole pipeline in seconds."""
    return write_settings(
        tmp_path / "small.yaml",
        dataset={"paths": [small_inputs], "max_length": 1024},
        model={"path": demo_model_dir, "layers": [1, 4], "include_final": True},
        shards=2,
        output_dir="out",
        extraction={"devices": ["cpu"], "batch_size": 8, "max_batch_tokens": 4096, "chunk_mb": 0.25},
        drafter={"parity_samples": 4},
    )


def test_all_three_assets_over_every_shard(small_settings_file):
    settings = load_settings(small_settings_file)
    hidden_states = build_hidden_states(shard_partitions(settings))
    resources = {"settings": HsxSettings(path=str(small_settings_file)), "gpu": GpuResource.from_settings(settings)}
    with instance_for_test() as instance:
        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        first = materialize([hidden_states], resources=resources, partition_key="shard-00", instance=instance)
        assert first.success
        metadata = instance.get_latest_materialization_event(AssetKey("hidden_states")).asset_materialization.metadata
        assert metadata["shard"].value.startswith("shard-00: 14 samples,")
        assert metadata["this run"].value.startswith("14 samples in ")
        assert 0 < float(metadata["padding efficiency"].value.rstrip("%")) <= 100
        assert 0 < float(metadata["forward share"].value.rstrip("%")) <= 100
        # the host's CPU-seconds per GB stored, by part, adding up to the process's at the end of the step
        parts = re.findall(r"^\| (\w+) \| ([\d.]+) \|", metadata["host CPU per GB"].value, flags=re.M)
        assert {"forward", "write", "fsync", "hash", "index_and_records", "startup_and_dagster"} <= dict(parts).keys()
        total = metadata["host_cpu_s_per_gb"].value
        assert total > 0 and sum(float(v) for _, v in parts) == pytest.approx(total, abs=0.002 * len(parts))
        assert re.fullmatch(
            r"(direct|buffered) \(.+\): \d+ of \d+ chunks written direct", metadata["chunk writes"].value
        )
        assert (
            metadata["layers"].value == "1, 4 and the final norm"
            and metadata["dtypes"].value == "float32 compute, bfloat16 storage"
        )
        assert metadata["device"].value == "cpu" and metadata["batch settings"].value.startswith("batch_size 8,")
        # every shard in one table with totals, the other one not started yet
        assert metadata["all shards"].value.startswith("14 of 28 samples,")
        table = metadata["shards"].value
        assert "| shard\u201100 | complete |" in table and "| shard\u201101 | not\u00a0started |" in table
        assert "**total**" in table and "| 0/3 |" in table  # retries used of the budget

        early = materialize([drafter_dataset], resources=resources, instance=instance, raise_on_error=False)
        assert not early.success
        failure = early.get_step_failure_events()[0].event_specific_data.error.to_string()
        assert "shards not ready: shard-01 (missing)" in failure

        assert materialize([hidden_states], resources=resources, partition_key="shard-01", instance=instance).success
        assembled = materialize([drafter_dataset, *drafter_checks], resources=resources, instance=instance)
        assert assembled.success
        evaluations = {c.check_name: c for c in assembled.get_asset_check_evaluations()}
        assert set(evaluations) == {"drafter_coverage", "drafter_integrity", "drafter_numerics", "drafter_parity"}
        assert all(c.passed for c in evaluations.values()), {k: c.description for k, c in evaluations.items()}
        parity = evaluations["drafter_parity"].metadata
        assert {"what": "samples checked", "count": "4"} in [row.data for row in parity["counts"].value.records]
        layers = [row.data for row in parity["relative error per layer"].value.records]
        assert [row["layer"] for row in layers] == ["layer 1", "layer 4", "final"] and all(
            r["within"] == "yes" for r in layers
        )
        assert 0 <= parity["worst relative error"].value <= float(layers[0]["tolerance"])
        drafter = instance.get_latest_materialization_event(AssetKey("drafter_dataset")).asset_materialization.metadata
        assert drafter["dagster/row_count"].value == 28 and drafter["samples"].value.startswith("28: ")
        assert "DrafterDataset(" in drafter["how to load"].value
    out = small_settings_file.parent / "out"
    manifest = json.loads((out / "drafter" / "manifest.json").read_text())
    assert manifest["layers"]["ids"] == [1, 4] and manifest["layers"]["include_final"] is True
    assert manifest["hidden_size"] == 64 and manifest["totals"]["samples"] == 28


@pytest.mark.slow
def test_cli_materialize_against_a_persistent_instance(small_settings_file, tmp_path):
    """What users run: the dagster CLI, HSX_CONFIG, a project-local DAGSTER_HOME, and run config
    from the command line changing the batch size for one run."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "deploy" / "local" / "dagster.yaml").read_text())
    env = {**os.environ, "HSX_CONFIG": str(small_settings_file), "DAGSTER_HOME": str(home)}
    dagster = str(Path(sys.executable).with_name("dagster"))

    def cli(*args):
        completed = subprocess.run([dagster, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert completed.returncode == 0, completed.stderr[-3000:]

    module = ["-m", "hsx_dagster.definitions"]
    cli("asset", "materialize", *module, "--select", "tokenized_dataset")
    run_config = json.dumps({"resources": {"gpu": {"config": {"batch_size": 4}}}})
    cli(
        "asset",
        "materialize",
        *module,
        "--select",
        "hidden_states",
        "--partition",
        "shard-01",
        "--config-json",
        run_config,
    )
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_latest_materialization_event(AssetKey("tokenized_dataset")) is not None
        event = instance.get_latest_materialization_event(AssetKey("hidden_states"))
        assert event.asset_materialization.partition == "shard-01"
        assert event.asset_materialization.metadata["batch settings"].value.startswith("batch_size 4,")
    report = subprocess.run(
        [sys.executable, "-m", "hsx_dagster.report", "--config", str(small_settings_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "shard-01" in report.stdout


@pytest.mark.slow
def test_dagster_definitions_validate_cli(settings_file, tmp_path):
    env = {**os.environ, "HSX_CONFIG": str(settings_file), "DAGSTER_HOME": str(tmp_path)}
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    dagster = str(Path(sys.executable).with_name("dagster"))
    ok = subprocess.run(
        [dagster, "definitions", "validate"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "All code locations passed validation" in ok.stderr + ok.stdout
    env["HSX_SHARDS"] = "0"
    bad = subprocess.run(
        [dagster, "definitions", "validate"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode != 0
    assert "key `shards`: Input should be greater than or equal to 1" in bad.stderr + bad.stdout


def test_every_gpu_knob_reaches_the_resource_from_the_environment(settings_file, monkeypatch):
    monkeypatch.setenv("HSX_EXTRACTION__BATCH_SIZE", "64")
    monkeypatch.setenv("HSX_EXTRACTION__MAX_BATCH_TOKENS", "65536")
    monkeypatch.setenv("HSX_EXTRACTION__DEVICES", "cuda:0,cuda:1")
    monkeypatch.setenv("HSX_EXTRACTION__STORAGE_DTYPE", "float16")
    gpu = build_definitions(load_settings(settings_file)).resources["gpu"]
    assert (gpu.batch_size, gpu.max_batch_tokens, gpu.devices, gpu.storage_dtype) == (
        64,
        65536,
        ["cuda:0", "cuda:1"],
        "float16",
    )


def test_bad_run_config_for_the_gpu_is_named(settings_file):
    with pytest.raises(
        SettingsError,
        match=r"resource `gpu` config: `storage_dtype`: Input should be 'bfloat16', 'float16', 'float32' or "
        r"'float8_e4m3'",
    ):
        GpuResource(storage_dtype="int8").validated()
    with pytest.raises(SettingsError, match=r"`devices`.*'tpu' is not a device"):
        GpuResource(devices=["tpu"]).validated()


def test_local_instance_config_retries_crashes_not_pipeline_errors(tmp_path):
    import yaml

    config = yaml.safe_load((REPO / "deploy" / "local" / "dagster.yaml").read_text())
    with instance_for_test(overrides=config) as instance:
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
        assert instance.run_retries_retry_on_asset_or_op_failure is False
        limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
        assert limits == [{"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1}]
        # the `gpu` pool has slots (no warning in the UI); `make instance` sets them to the number of GPUs
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
