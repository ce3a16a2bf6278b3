"""`retry_failed_shards` against a real instance: one failed shard, one good one. Its ticks are evaluated here and
their backfill carried out run by run, as the backfill daemon does (test_browser.py has the daemon do it)."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from dagster import (
    AssetsDefinition,
    DagsterInstance,
    build_sensor_context,
    instance_for_test,
    materialize,
)

from hsx_dagster.core.settings import Settings, load_settings
from hsx_dagster.defs.assets.hidden_states import build_hidden_states
from hsx_dagster.defs.assets.tokenized import tokenized_dataset
from hsx_dagster.defs.build import build_definitions
from hsx_dagster.defs.partitions import shard_partitions
from hsx_dagster.defs.resources import GpuResource, HsxSettings
from hsx_dagster.defs.sensors.retries import RETRY_REASONS_TAG, RETRY_TAG
from hsx_dagster.defs_support.asset_keys import HIDDEN_STATES
from hsx_dagster.defs_support.dagster_internals import pool_limits
from hsx_dagster.defs_support.shard_table import shard_table
from hsx_dagster_tests.support.dagster_internals import backfill_partitions, delete_pool_limit, submit_backfill
from hsx_dagster_tests.support.helpers import write_settings


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
    settings: Settings


@pytest.fixture
def pipeline(failing_shard_settings):
    """A test instance with tokenized_dataset and shard-01 materialized, and a way to run a tick."""
    settings = load_settings(failing_shard_settings)
    defs = build_definitions(settings)
    sensor = defs.resolve_sensor_def("retry_failed_shards")
    hidden_states = build_hidden_states(shard_partitions(settings))
    resources = {"settings": HsxSettings(path=str(failing_shard_settings)), "gpu": GpuResource.from_settings(settings)}
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 2}}}) as instance:

        def tick():
            context = build_sensor_context(instance=instance, repository_def=defs.get_repository_def())
            return sensor.evaluate_tick(context)

        assert tick().skip_message == "no failed hidden_states shard"
        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        assert materialize([hidden_states], resources=resources, partition_key="shard-01", instance=instance).success
        out = failing_shard_settings.parent / "out" / "hidden_states"
        yield Pipeline(instance, hidden_states, resources, out, tick, settings)


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
    assert backfill_partitions(request, HIDDEN_STATES) == ["shard-00"]
    assert request.tags[RETRY_REASONS_TAG].startswith("shard-00: retry 1 of 2 (its latest run failed)")

    for attempt in (1, 2):  # the sensor's retries fail too (the folder still holds foreign states)
        assert not run_shard_00(**{RETRY_TAG: "true", RETRY_REASONS_TAG: f"shard-00: retry {attempt} of 2"}).success
    tick = pipeline.tick()
    assert not tick.run_requests
    assert tick.skip_message == "retry budget (2) used up: shard-00"


def test_the_sensor_reruns_exactly_the_failed_shard_then_skips(pipeline):
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
    assert backfill_partitions(request, HIDDEN_STATES) == ["shard-00"]  # one backfill of the failed shards
    assert request.tags[RETRY_REASONS_TAG] == "shard-00: retry 1 of 2 (its latest run failed); 1 left after it"
    # set up again before the retried shards start together (hsx_dagster/defs_support/pools.py)
    assert [(p.name, p.limit) for p in pool_limits(pipeline.instance)] == [("gpu", 2)]
    submit_backfill(pipeline.instance, request)  # as the daemon does; its run has not started yet
    assert pipeline.tick().skip_message == "already queued or running: shard-00"  # no second backfill
    states = {row.shard: row.state for row in shard_table(pipeline.instance, pipeline.settings)}
    assert states == {"shard-00": "retrying", "shard-01": "complete"}
    (pipeline.out / "shard-00").unlink()  # the operator fixes the disk; the retry run then succeeds
    rerun = materialize(
        [pipeline.hidden_states],
        resources=pipeline.resources,
        partition_key="shard-00",
        tags=request.tags,
        instance=pipeline.instance,
    )
    assert rerun.success
    assert pipeline.tick().skip_message == "no failed hidden_states shard"
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (pipeline.out / "shard-01").iterdir()} == good_files
