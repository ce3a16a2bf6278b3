"""The Dagster layer through real instances: definitions load, the tokenized_dataset asset and its
check materialize with metadata, the CLI entry point users run works, and bad settings fail early."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import AssetKey, AssetSelection, DagsterInstance, instance_for_test, materialize

from hsx_dagster.assets.tokenized import tokenized_dataset, tokenized_dataset_consistent
from hsx_dagster.core.settings import SettingsError, load_settings
from hsx_dagster.core.tokenization import TokenizedSummary
from hsx_dagster.definitions import build_definitions
from hsx_dagster.assets.hidden_states import build_hidden_states
from hsx_dagster.partitions import shard_partitions
from hsx_dagster.resources import GpuResource, HsxSettings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def settings_file(tmp_path, demo_paths, demo_model_dir) -> Path:
    path = tmp_path / "hsx.yaml"
    paths = "".join(f"\n    - {p}" for p in demo_paths)
    path.write_text(
        f"dataset:\n  paths:{paths}\n  min_loss_tokens: 4\nmodel:\n  path: {demo_model_dir}\n  layers: eagle3\n"
        f"shards: 3\noutput_dir: out\n"
    )
    return path


def test_definitions_graph_partitions_and_resources(settings_file):
    defs = build_definitions(load_settings(settings_file))
    graph = defs.resolve_asset_graph()
    keys = {key.to_user_string() for key in graph.get_all_asset_keys()}
    assert keys == {"tokenized_dataset", "hidden_states", "drafter_dataset"}
    hidden = defs.resolve_assets_def("hidden_states")
    assert hidden.op.name == "extract_hidden_states"
    assert "gpu" in hidden.required_resource_keys
    assert hidden.partitions_def.get_partition_keys() == ["shard-00", "shard-01", "shard-02"]
    assert graph.get(AssetKey("hidden_states")).parent_keys == {AssetKey("tokenized_dataset")}
    assert graph.get(AssetKey("drafter_dataset")).parent_keys == {AssetKey("hidden_states")}


def test_the_module_definitions_load_from_the_repo_settings():
    from hsx_dagster.definitions import defs

    assert defs.resolve_assets_def("hidden_states").partitions_def.get_partition_keys() == load_settings(REPO / "hsx.yaml").shard_keys


def test_tokenized_dataset_materializes_with_metadata_and_passing_check(settings_file):
    with instance_for_test() as instance:
        result = materialize(
            [tokenized_dataset, tokenized_dataset_consistent],
            resources={"settings": HsxSettings(path=str(settings_file))},
            instance=instance,
        )
        assert result.success
        event = instance.get_latest_materialization_event(AssetKey("tokenized_dataset"))
        metadata = event.asset_materialization.metadata
        summary = TokenizedSummary.read(settings_file.parent / "out" / "tokenized")
        assert metadata["samples"].value == summary.samples >= 2000
        assert metadata["dagster/row_count"].value == summary.samples
        assert metadata["tokens"].value == summary.tokens
        assert metadata["rejected"].value == summary.rejected > 0
        assert metadata["rejects_by_reason"].value == summary.rejects
        assert metadata["shards"].value == 3
        assert metadata["shard_token_imbalance_max_over_mean"].value < 1.01
        assert "| shard-02 |" in metadata["per_shard"].value
        assert "| tokens | samples |" in metadata["token_length_histogram"].value
        checks = result.get_asset_check_evaluations()
        assert [(c.check_name, c.passed) for c in checks] == [("tokenized_dataset_consistent", True)]


def test_run_config_overrides_settings(settings_file):
    with instance_for_test() as instance:
        result = materialize(
            [tokenized_dataset],
            resources={"settings": HsxSettings(path=str(settings_file))},
            instance=instance,
            run_config={"ops": {"tokenized_dataset": {"config": {"max_length": 128}}}},
        )
        assert result.success
    summary = TokenizedSummary.read(settings_file.parent / "out" / "tokenized")
    assert summary.options["max_length"] == 128
    assert max(b["max"] for b in summary.histogram if b["samples"]) <= 128


def test_check_fails_when_a_shard_file_is_tampered_with(settings_file):
    import pyarrow.parquet as pq

    with instance_for_test() as instance:
        resources = {"settings": HsxSettings(path=str(settings_file))}
        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        shard = settings_file.parent / "out" / "tokenized" / "samples" / "shard-01.parquet"
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


def test_cli_materialize_against_a_persistent_instance(settings_file, tmp_path):
    """What `make demo` runs: the dagster CLI, HSX_CONFIG, a project-local DAGSTER_HOME."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "deploy" / "local" / "dagster.yaml").read_text())
    env = {**os.environ, "HSX_CONFIG": str(settings_file), "DAGSTER_HOME": str(home)}
    dagster = Path(sys.executable).with_name("dagster")
    completed = subprocess.run(
        [str(dagster), "asset", "materialize", "-m", "hsx_dagster.definitions", "--select", "tokenized_dataset"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_latest_materialization_event(AssetKey("tokenized_dataset")) is not None
    report = subprocess.run(
        [sys.executable, "-m", "hsx_dagster.report", "--config", str(settings_file)],
        capture_output=True, text=True, timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "shard-02" in report.stdout and "rejects" in report.stdout


def test_extraction_skeleton_refuses_to_pretend(settings_file):
    settings = load_settings(settings_file)
    with instance_for_test() as instance:
        result = materialize(
            [build_hidden_states(shard_partitions(settings))],
            resources={"settings": HsxSettings(path=str(settings_file)), "gpu": GpuResource.from_settings(settings)},
            partition_key="shard-00",
            instance=instance,
            raise_on_error=False,
        )
        assert not result.success
    assert not (settings_file.parent / "out" / "hidden_states").exists()


def test_dagster_definitions_validate_cli(settings_file, tmp_path):
    env = {**os.environ, "HSX_CONFIG": str(settings_file), "DAGSTER_HOME": str(tmp_path)}
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    dagster = str(Path(sys.executable).with_name("dagster"))
    ok = subprocess.run([dagster, "definitions", "validate"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "All code locations passed validation" in ok.stderr + ok.stdout
    env["HSX_SHARDS"] = "0"
    bad = subprocess.run([dagster, "definitions", "validate"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "key `shards`: Input should be greater than or equal to 1" in bad.stderr + bad.stdout
