"""Kubernetes: the Job that dagster-k8s would submit for a hidden_states shard run, built from the
Helm values and the run's `dagster-k8s/config` tag (no cluster needed)."""

import pytest
import yaml

from hsx_dagster.core.settings import load_settings
from hsx_dagster.defs.build import build_definitions
from hsx_dagster_tests.support.helpers import write_settings
from hsx_dagster_tests.support.paths import REPO

dagster_k8s = pytest.importorskip("dagster_k8s")


def test_shard_run_job_gets_one_gpu_the_image_the_command_and_the_volumes(tmp_path, small_inputs, demo_model_dir):
    from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job, get_user_defined_k8s_config

    settings_file = write_settings(
        tmp_path / "hsx.yaml",
        dataset={"paths": [small_inputs]},
        model={"path": demo_model_dir},
        shards=4,
        operations={"k8s_run_config": REPO / "deploy" / "k8s" / "shard-run-config.yaml"},
    )
    defs = build_definitions(load_settings(settings_file))
    job = defs.resolve_job_def("hidden_states_shard")
    run_tags = {**job.tags, "dagster/partition": "shard-03"}  # what a run of shard-03 carries

    values = yaml.safe_load((REPO / "deploy" / "k8s" / "values.yaml").read_text())
    deployment = values["dagster-user-deployments"]["deployments"][0]
    image = f"{deployment['image']['repository']}:{deployment['image']['tag']}"
    launcher_config = DagsterK8sJobConfig(
        job_image=image,
        dagster_home="/opt/dagster/dagster_home",
        instance_config_map="dagster-instance",
        env_vars=values["runLauncher"]["config"]["k8sRunLauncher"]["envVars"],
    )
    command = ["dagster", "api", "execute_run", '{"run_id": "..."}']  # the launcher's execute_run call
    k8s_job = construct_dagster_k8s_job(
        launcher_config,
        args=command,
        job_name="dagster-run-shard-03",
        user_defined_k8s_config=get_user_defined_k8s_config(run_tags),
        component="run_worker",
    )
    (container,) = k8s_job.spec.template.spec.containers
    assert container.image == "registry.example.com/hsx-dagster:0.1.0"
    assert container.args == command
    assert str(container.resources.limits["nvidia.com/gpu"]) == "1"
    mounts = {m.name: m.mount_path for m in container.volume_mounts}
    assert mounts["hsx-data"] == "/data" and mounts["hsx-settings"] == "/etc/hsx"
    volumes = {v.name: v for v in k8s_job.spec.template.spec.volumes}
    assert volumes["hsx-data"].persistent_volume_claim.claim_name == "hsx-data"
    assert {e.name: e.value for e in container.env}["HSX_CONFIG"] == "/etc/hsx/hsx.yaml"
    assert any(t.key == "nvidia.com/gpu" for t in k8s_job.spec.template.spec.tolerations)


def test_missing_k8s_run_config_is_named(tmp_path, small_inputs, demo_model_dir):
    from hsx_dagster.core.settings import SettingsError

    settings_file = write_settings(
        tmp_path / "hsx.yaml",
        dataset={"paths": [small_inputs]},
        model={"path": demo_model_dir},
        operations={"k8s_run_config": "nope.yaml"},
    )
    with pytest.raises(SettingsError, match=r"key `operations\.k8s_run_config`: file not found"):
        load_settings(settings_file)
