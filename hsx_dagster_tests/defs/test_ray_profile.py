"""The Ray profile's run tags (deploy/ray/): what dagster-ray's RayRunLauncher reads from each run (no cluster
needed; test_ray_cluster.py runs them on a live one)."""

import json

import pytest

from hsx_dagster.core.settings import SettingsError, load_settings
from hsx_dagster.defs.build import build_definitions
from hsx_dagster_tests.support.helpers import write_settings
from hsx_dagster_tests.support.paths import REPO

RAY_RUN_CONFIG = REPO / "deploy" / "ray" / "shard-run-config.yaml"
run_launcher = pytest.importorskip("dagster_ray.core.run_launcher", reason="the ray extra: pip install -e '.[ray]'")


def definitions(tmp_path, small_inputs, demo_model_dir, **sections):
    settings_file = write_settings(
        tmp_path / "hsx.yaml", dataset={"paths": [small_inputs]}, model={"path": demo_model_dir}, shards=4, **sections
    )
    return build_definitions(load_settings(settings_file))


def test_shard_runs_ask_ray_for_one_gpu_and_leave_retries_to_the_sensor(tmp_path, small_inputs, demo_model_dir):
    defs = definitions(tmp_path, small_inputs, demo_model_dir, operations={"ray_run_config": RAY_RUN_CONFIG})
    tags = defs.resolve_job_def("hidden_states_shard").tags
    assert run_launcher.RayLauncherConfig.from_tags(tags).num_gpus == 1  # as the launcher reads it
    assert tags["dagster/max_retries"] == "0"
    # drafter_dataset's run (requested by hsx_automation) asks for one for its parity check
    drafter_tags = defs.resolve_sensor_def("hsx_automation").run_tags
    assert json.loads(drafter_tags["dagster-ray/config"]) == {"num_gpus": 1}
    # every other run asks for none: the observation job carries no Ray tag
    assert "dagster-ray/config" not in defs.resolve_job_def("observe_inputs").tags


def test_no_gpu_for_the_dataset_when_its_parity_check_loads_no_model(tmp_path, small_inputs, demo_model_dir):
    defs = definitions(
        tmp_path,
        small_inputs,
        demo_model_dir,
        operations={"ray_run_config": RAY_RUN_CONFIG},
        drafter={"parity_samples": 0},
    )
    assert "dagster-ray/config" not in (defs.resolve_sensor_def("hsx_automation").run_tags or {})
    assert "dagster-ray/config" in defs.resolve_job_def("hidden_states_shard").tags


def test_without_a_ray_run_config_no_run_carries_a_ray_tag(tmp_path, small_inputs, demo_model_dir):
    defs = definitions(tmp_path, small_inputs, demo_model_dir)
    assert defs.resolve_job_def("hidden_states_shard").tags == {}
    assert not defs.resolve_sensor_def("hsx_automation").run_tags


def test_a_missing_ray_run_config_is_named(tmp_path, small_inputs, demo_model_dir):
    with pytest.raises(SettingsError, match=r"key `operations\.ray_run_config`: file not found: .*nope\.yaml"):
        definitions(tmp_path, small_inputs, demo_model_dir, operations={"ray_run_config": "nope.yaml"})
