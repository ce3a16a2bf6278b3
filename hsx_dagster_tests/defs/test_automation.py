"""Lineage that knows what is stale, and `drafter_dataset` following by itself, on a real instance:
the inputs observed by content, code versions from the settings that shape the data, and the
drafter's automation condition driven through Dagster's evaluation API (what the daemon's sensor runs)."""

from dataclasses import dataclass
from pathlib import Path

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    Definitions,
    SensorResult,
    SkipReason,
    build_sensor_context,
    evaluate_automation_conditions,
    instance_for_test,
)

from hsx_dagster.core.fingerprints import code_versions
from hsx_dagster.core.settings import load_settings
from hsx_dagster.core.storage import read_index
from hsx_dagster.defs.build import build_definitions
from hsx_dagster.defs_support.dagster_internals import StaleStatus
from hsx_dagster_tests.support.dagster_internals import stale_status
from hsx_dagster_tests.support.helpers import write_settings

DRAFTER = AssetKey("drafter_dataset")
SHARDS = ("shard-00", "shard-01")


def project_settings(folder: Path, inputs: Path, model: Path, layers=(1, 4), dtype: str = "bfloat16") -> Path:
    return write_settings(
        folder / "hsx.yaml",
        dataset={"paths": [inputs], "max_length": 512},
        model={"path": model, "layers": layers},
        shards=2,
        output_dir="out",
        extraction={"devices": ["cpu"], "batch_size": 8, "storage_dtype": dtype},
        drafter={"parity_samples": 0},
    )


@dataclass
class Project:
    instance: DagsterInstance
    defs: Definitions
    inputs: Path
    out: Path
    cursor: object = None

    def observe(self):
        assert self.defs.resolve_job_def("observe_inputs").execute_in_process(instance=self.instance).success

    def sense_inputs(self):
        """One tick of the sensor observe_inputs_on_change, its observations recorded as the daemon records them
        (without a run); what it returned."""
        sensor = self.defs.resolve_sensor_def("observe_inputs_on_change")
        context = build_sensor_context(instance=self.instance, resources=self.defs.resources)
        result = sensor(context)
        for event in getattr(result, "asset_events", []):
            self.instance.report_runless_asset_event(event)
        return result

    def materialize(self, key: str):
        job = self.defs.resolve_implicit_global_asset_job_def()
        assert job.execute_in_process(instance=self.instance, asset_selection=[AssetKey(key)]).success

    def run_shard(self, shard: str, start_over: bool = False):
        job = self.defs.resolve_job_def("hidden_states_shard")
        # after re-tokenizing, a shard's committed samples are of the old inputs: redo it (extraction.on_mismatch)
        config = {"resources": {"gpu": {"config": {"on_mismatch": "start_over"}}}} if start_over else None
        assert job.execute_in_process(partition_key=shard, instance=self.instance, run_config=config).success

    def tick(self) -> set[str]:
        """One evaluation of the automation conditions, as the sensor's tick runs it; what it requests."""
        result = evaluate_automation_conditions(
            defs=self.defs, instance=self.instance, cursor=self.cursor, asset_selection=None
        )
        self.cursor = result.cursor
        return {key.to_user_string() for key in (DRAFTER,) if result.get_num_requested(key)}

    def stale(self) -> dict[str, StaleStatus]:
        """What the UI shows as stale (the webserver uses the same resolver)."""
        names = ["tokenized_dataset", "drafter_dataset", *SHARDS]
        keys = [(AssetKey("tokenized_dataset"), None), (DRAFTER, None)]
        keys += [(AssetKey("hidden_states"), shard) for shard in SHARDS]
        return dict(zip(names, stale_status(self.defs, self.instance, keys)))


@pytest.fixture
def project(tmp_path, small_inputs, demo_model_dir):
    inputs = tmp_path / "conversations.jsonl"
    inputs.write_bytes(small_inputs.read_bytes())
    settings = load_settings(project_settings(tmp_path, inputs, demo_model_dir))
    with instance_for_test() as instance:
        yield Project(instance, build_definitions(settings), inputs, tmp_path / "out")


@pytest.mark.slow  # runs the whole pipeline several times (minutes on a shared CPU)
def test_drafter_follows_once_every_shard_is_newer_and_an_edited_input_marks_everything_stale(project):
    assert project.tick() == set()  # nothing upstream yet
    project.observe()
    project.materialize("tokenized_dataset")
    project.run_shard("shard-00")
    assert project.tick() == set()  # shard-01 is missing
    project.run_shard("shard-01")
    assert project.tick() == {"drafter_dataset"}  # every shard in: the dataset follows
    assert project.tick() == set()  # requested once, not on every tick
    project.materialize("drafter_dataset")
    assert project.tick() == set()
    assert set(project.stale().values()) == {StaleStatus.FRESH}

    # Re-materializing an unchanged shard stays a no-op: the same chunks, nothing stale.
    before = read_index(project.out / "hidden_states" / "shard-00")
    project.run_shard("shard-00")
    assert read_index(project.out / "hidden_states" / "shard-00") == before
    assert project.stale()["drafter_dataset"] == StaleStatus.FRESH
    assert project.tick() == set()  # shard-01 is older than the dataset: not every shard is newer
    project.run_shard("shard-01")
    assert project.tick() == {"drafter_dataset"}
    project.materialize("drafter_dataset")

    # One input file edited: once observed, tokenized_dataset and everything after it are stale.
    lines = project.inputs.read_text().splitlines(keepends=True)
    project.inputs.write_text("".join(lines[:-1]))
    assert set(project.stale().values()) == {StaleStatus.FRESH}  # not observed yet
    project.observe()
    assert project.stale() == {
        "tokenized_dataset": StaleStatus.STALE,
        "shard-00": StaleStatus.STALE,
        "shard-01": StaleStatus.STALE,
        "drafter_dataset": StaleStatus.STALE,
    }
    project.materialize("tokenized_dataset")
    assert project.stale()["tokenized_dataset"] == StaleStatus.FRESH
    assert project.stale()["shard-00"] == StaleStatus.STALE
    project.run_shard("shard-00", start_over=True)
    assert project.tick() == set()  # one shard re-extracted, the other still from the old inputs
    project.run_shard("shard-01", start_over=True)
    assert project.tick() == {"drafter_dataset"}
    project.materialize("drafter_dataset")
    assert set(project.stale().values()) == {StaleStatus.FRESH}


@pytest.mark.slow  # tokenizes the inputs
def test_inputs_are_observed_without_runs_and_only_when_they_change(project):
    """The daemon's input sensor: an observation per changed input, recorded without a run; a skip naming the
    versions when nothing changed; an edited file marks tokenized_dataset stale."""
    first = project.sense_inputs()
    assert isinstance(first, SensorResult)
    assert {event.asset_key.to_user_string() for event in first.asset_events} == {"conversations", "target_model"}
    assert all(event.data_version for event in first.asset_events)
    again = project.sense_inputs()
    assert isinstance(again, SkipReason) and again.skip_message.startswith("inputs unchanged: conversations ")
    project.materialize("tokenized_dataset")
    assert project.stale()["tokenized_dataset"] == StaleStatus.FRESH
    lines = project.inputs.read_text().splitlines(keepends=True)
    project.inputs.write_text("".join(lines[:-1]))
    edited = project.sense_inputs()
    assert [event.asset_key.to_user_string() for event in edited.asset_events] == ["conversations"]
    assert project.stale()["tokenized_dataset"] == StaleStatus.STALE
    runs = project.instance.get_runs()
    assert [run.asset_selection for run in runs] == [{AssetKey("tokenized_dataset")}]  # no observation runs


@pytest.mark.slow
def test_a_failed_shard_check_holds_the_drafter_back(project):
    project.observe()
    project.materialize("tokenized_dataset")
    project.run_shard("shard-00")
    folder = project.out / "hidden_states" / "shard-01"
    project.run_shard("shard-01")
    project.tick()
    project.materialize("drafter_dataset")
    project.run_shard("shard-00")
    chunk = folder / read_index(folder)[0].chunk
    chunk.write_bytes(chunk.read_bytes()[:-1] + bytes([chunk.read_bytes()[-1] ^ 1]))
    job = project.defs.resolve_job_def("hidden_states_shard")
    result = job.execute_in_process(partition_key="shard-01", instance=project.instance, raise_on_error=False)
    assert not {e.check_name: e.passed for e in result.get_asset_check_evaluations()}["shard_integrity"]
    assert project.tick() == set()  # every shard is newer, but shard-01 failed its blocking check


def test_code_versions_follow_the_settings_that_shape_the_data(tmp_path, small_inputs, demo_model_dir):
    base = code_versions(load_settings(project_settings(tmp_path, small_inputs, demo_model_dir)))
    layers = code_versions(load_settings(project_settings(tmp_path, small_inputs, demo_model_dir, layers=[1, 5])))
    fp8 = code_versions(load_settings(project_settings(tmp_path, small_inputs, demo_model_dir, dtype="float8_e4m3")))
    for changed in (layers, fp8):  # the shards and the dataset made from them are out of date, not the tokens
        assert changed["tokenized_dataset"] == base["tokenized_dataset"]
        assert changed["hidden_states"] != base["hidden_states"]
        assert changed["drafter_dataset"] != base["drafter_dataset"]
    assert code_versions(load_settings(project_settings(tmp_path, small_inputs, demo_model_dir))) == base
    defs = build_definitions(load_settings(project_settings(tmp_path, small_inputs, demo_model_dir, layers=[1, 5])))
    graph = defs.resolve_asset_graph()
    assert graph.get(AssetKey("hidden_states")).code_version == layers["hidden_states"]
    assert graph.get(AssetKey("tokenized_dataset")).parent_keys == {AssetKey("conversations"), AssetKey("target_model")}
    assert graph.get(AssetKey("conversations")).is_observable and graph.get(AssetKey("target_model")).is_observable
