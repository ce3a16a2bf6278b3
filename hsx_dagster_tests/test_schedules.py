"""`retry_failed_shards` against a real instance: one failed shard, one good one."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from dagster import (
    AssetsDefinition,
    DagsterInstance,
    RunRequest,
    build_schedule_context,
    instance_for_test,
    materialize,
)

from hsx_dagster.assets.hidden_states import build_hidden_states
from hsx_dagster.assets.tokenized import tokenized_dataset
from hsx_dagster.core.settings import load_settings
from hsx_dagster.dagster_internals import delete_pool_limit, pool_limits
from hsx_dagster.definitions import build_definitions
from hsx_dagster.partitions import shard_partitions
from hsx_dagster.resources import GpuResource, HsxSettings
from hsx_dagster.schedules import RETRY_ATTEMPT_TAG, RETRY_REASON_TAG, RETRY_SHARD_TAG
from hsx_dagster_tests.helpers import write_settings


@pytest.fixture
def failing_shard_settings(tmp_path, small_inputs, demo_model_dir) -> Path:
    """Two shards on the CPU; the test makes shard-00's runs fail."""
    return write_settings(
        tmp_path / "hsx.yaml",
        dataset={"paths": [small_inputs], "max_length": 512},
        model={"path": demo_model_dir, "layers": [1]},
        shards=2,
        output_dir="out",
        extraction={"devices": ["cpu"], "batch_size": 8},
        operations={"max_retries": 2},
    )


@dataclass
class Pipeline:
    instance: DagsterInstance
    hidden_states: AssetsDefinition
    resources: dict
    out: Path
    tick: Callable


@pytest.fixture
def pipeline(failing_shard_settings):
    """A test instance with tokenized_dataset and shard-01 materialized, and a way to run a tick."""
    settings = load_settings(failing_shard_settings)
    defs = build_definitions(settings)
    schedule = defs.resolve_schedule_def("retry_failed_shards")
    hidden_states = build_hidden_states(shard_partitions(settings))
    resources = {"settings": HsxSettings(path=str(failing_shard_settings)), "gpu": GpuResource.from_settings(settings)}
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 2}}}) as instance:

        def tick():
            return schedule.evaluate_tick(
                build_schedule_context(instance=instance, repository_def=defs.get_repository_def())
            )

        assert tick().skip_message == "no failed hidden_states shard"
        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        assert materialize([hidden_states], resources=resources, partition_key="shard-01", instance=instance).success
        yield Pipeline(
            instance, hidden_states, resources, failing_shard_settings.parent / "out" / "hidden_states", tick
        )


@pytest.mark.slow  # five runs and three ticks; the quick loop runs the retry that succeeds
def test_retries_only_the_failed_shard_within_its_budget(pipeline):
    def run_shard_00(**tags):
        return materialize(
            [pipeline.hidden_states],
            resources=pipeline.resources,
            partition_key="shard-00",
            instance=pipeline.instance,
            tags=tags,
            raise_on_error=False,
        )

    # shard-00's folder holds states made by another model: every run of it refuses to mix.
    (pipeline.out / "shard-00").mkdir(parents=True)
    (pipeline.out / "shard-00" / "shard.json").write_text(
        '{"format": "hsx-hidden-states", "config_sha256": "another model"}'
    )
    assert not run_shard_00().success

    (request,) = pipeline.tick().run_requests
    assert (request.partition_key, request.tags[RETRY_ATTEMPT_TAG]) == ("shard-00", "1")
    assert isinstance(request, RunRequest) and request.run_key.startswith("retry-shard-00-")

    for attempt in (1, 2):  # the schedule's retries fail too (the folder still holds foreign states)
        assert not run_shard_00(**{RETRY_SHARD_TAG: "shard-00", RETRY_ATTEMPT_TAG: str(attempt)}).success
    tick = pipeline.tick()
    assert not tick.run_requests
    assert tick.skip_message == "retry budget (2) used up: shard-00"


def test_the_schedule_reruns_exactly_the_failed_shard_then_skips(pipeline):
    good_files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (pipeline.out / "shard-01").iterdir()}
    (pipeline.out / "shard-00").write_text("not a folder")  # an unusable output path: the run fails
    failed = materialize(
        [pipeline.hidden_states],
        resources=pipeline.resources,
        partition_key="shard-00",
        instance=pipeline.instance,
        raise_on_error=False,
    )
    assert not failed.success

    delete_pool_limit(pipeline.instance, "gpu")  # say, removed in the UI
    (request,) = pipeline.tick().run_requests
    assert request.partition_key == "shard-00" and request.tags[RETRY_REASON_TAG] == "its latest run failed"
    # set up again before the retried shards start together (hsx_dagster/pools.py)
    assert [(p.name, p.limit) for p in pool_limits(pipeline.instance)] == [("gpu", 2)]
    (pipeline.out / "shard-00").unlink()  # the operator fixes the disk; the schedule's run then succeeds
    rerun = materialize(
        [pipeline.hidden_states],
        resources=pipeline.resources,
        partition_key=request.partition_key,
        tags=request.tags,
        instance=pipeline.instance,
    )
    assert rerun.success
    assert pipeline.tick().skip_message == "no failed hidden_states shard"
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (pipeline.out / "shard-01").iterdir()} == good_files
