"""`retry_failed_shards` against a real instance: one failed shard, one good one."""

from pathlib import Path

import pytest
from dagster import RunRequest, SkipReason, build_schedule_context, instance_for_test, materialize

from hsx_dagster.assets.hidden_states import build_hidden_states
from hsx_dagster.assets.tokenized import tokenized_dataset
from hsx_dagster.core.settings import load_settings
from hsx_dagster.definitions import build_definitions
from hsx_dagster.partitions import shard_partitions
from hsx_dagster.resources import GpuResource, HsxSettings
from hsx_dagster.schedules import RETRY_ATTEMPT_TAG, RETRY_SHARD_TAG


@pytest.fixture
def failing_shard_settings(tmp_path, small_inputs, demo_model_dir) -> Path:
    """Two shards on the CPU; the test makes shard-00's runs fail."""
    path = tmp_path / "hsx.yaml"
    path.write_text(
        f"dataset:\n  paths: [{small_inputs}]\n  max_length: 512\nmodel:\n  path: {demo_model_dir}\n  layers: [1]\n"
        f"shards: 2\noutput_dir: out\nextraction:\n  devices: [cpu]\n  batch_size: 8\n"
        f"operations:\n  max_retries: 2\n"
    )
    return path


def test_retries_only_the_failed_shard_within_its_budget(failing_shard_settings):
    settings = load_settings(failing_shard_settings)
    defs = build_definitions(settings)
    schedule = defs.resolve_schedule_def("retry_failed_shards")
    hidden_states = build_hidden_states(shard_partitions(settings))
    resources = {"settings": HsxSettings(path=str(failing_shard_settings)), "gpu": GpuResource.from_settings(settings)}
    with instance_for_test() as instance:
        def evaluate():
            context = build_schedule_context(instance=instance, repository_def=defs.get_repository_def())
            tick = schedule.evaluate_tick(context)
            return list(tick.run_requests or []), tick.skip_message

        requests, skip = evaluate()
        assert not requests and skip == "no failed hidden_states shard"

        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        # shard-00's folder holds states made by another model: every run of it refuses to mix.
        foreign = failing_shard_settings.parent / "out" / "hidden_states" / "shard-00"
        foreign.mkdir(parents=True)
        (foreign / "shard.json").write_text('{"format": "hsx-hidden-states", "config_sha256": "another model"}')
        assert materialize([hidden_states], resources=resources, partition_key="shard-01", instance=instance).success
        failed = materialize([hidden_states], resources=resources, partition_key="shard-00", instance=instance, raise_on_error=False)
        assert not failed.success

        requests, _ = evaluate()
        assert [(r.partition_key, r.tags[RETRY_ATTEMPT_TAG]) for r in requests] == [("shard-00", "1")]
        assert isinstance(requests[0], RunRequest) and requests[0].run_key.startswith("retry-shard-00-")

        for attempt in (1, 2):  # the schedule's retries fail too (the folder still holds foreign states)
            retry = materialize(
                [hidden_states], resources=resources, partition_key="shard-00", instance=instance,
                tags={RETRY_SHARD_TAG: "shard-00", RETRY_ATTEMPT_TAG: str(attempt)}, raise_on_error=False,
            )
            assert not retry.success
        requests, skip = evaluate()
        assert requests == []
        assert skip == "retry budget (2) used up: shard-00"


def test_the_schedule_reruns_exactly_the_failed_shard_then_skips(failing_shard_settings):
    settings = load_settings(failing_shard_settings)
    defs = build_definitions(settings)
    schedule = defs.resolve_schedule_def("retry_failed_shards")
    hidden_states = build_hidden_states(shard_partitions(settings))
    resources = {"settings": HsxSettings(path=str(failing_shard_settings)), "gpu": GpuResource.from_settings(settings)}
    out = failing_shard_settings.parent / "out" / "hidden_states"
    with instance_for_test() as instance:
        def tick():
            return schedule.evaluate_tick(build_schedule_context(instance=instance, repository_def=defs.get_repository_def()))

        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        assert materialize([hidden_states], resources=resources, partition_key="shard-01", instance=instance).success
        good_files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (out / "shard-01").iterdir()}

        (out / "shard-00").parent.mkdir(parents=True, exist_ok=True)
        (out / "shard-00").write_text("not a folder")  # an unusable output path: the run fails
        assert not materialize([hidden_states], resources=resources, partition_key="shard-00", instance=instance, raise_on_error=False).success

        (request,) = tick().run_requests
        assert request.partition_key == "shard-00"
        (out / "shard-00").unlink()  # the operator fixes the disk; the schedule's run then succeeds
        rerun = materialize([hidden_states], resources=resources, partition_key=request.partition_key, tags=request.tags, instance=instance)
        assert rerun.success
        assert tick().skip_message == "no failed hidden_states shard"
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (out / "shard-01").iterdir()} == good_files
