"""What a person watching a long extraction reads: units (core/units.py), a running shard's progress
(core/extraction/progress.py) on the asset's partition and in the run log, the per-shard table with
totals (core/dataset/shard_overview.py, hsx_dagster/defs_support/shard_table.py), and the same figures in
`python -m hsx_dagster.report`."""

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from dagster import AssetKey, instance_for_test, materialize

import hsx_dagster.defs.assets.hidden_states as hidden_states_asset
from hsx_dagster.core.dataset import LOW_FORWARD_SHARE, ShardRow, low_forward_share_note
from hsx_dagster.core.extraction import BatchCostModel, LengthOrder, Progress, plan_batches
from hsx_dagster.core.settings import load_settings
from hsx_dagster.core.units import (
    format_bytes,
    format_count,
    format_duration,
    format_rate,
    format_share,
    parse_duration,
)
from hsx_dagster.defs.assets.hidden_states import build_hidden_states
from hsx_dagster.defs.assets.tokenized import tokenized_dataset
from hsx_dagster.defs.partitions import shard_partitions
from hsx_dagster.defs.resources import GpuResource, HsxSettings
from hsx_dagster.report import summary_lines
from hsx_dagster_tests.support.helpers import write_settings
from hsx_dagster_tests.support.paths import REPO


@pytest.fixture
def small_settings_file(tmp_path, small_inputs, demo_model_dir):
    """28 conversations in two shards (conftest's small_inputs and demo model)."""
    return write_settings(
        tmp_path / "small.yaml",
        dataset={"paths": [small_inputs], "max_length": 1024},
        model={"path": demo_model_dir, "layers": [1, 4]},
        shards=2,
        output_dir="out",
        extraction={"devices": ["cpu"], "batch_size": 4},
    )


def progress_eta_rows(home: Path, out: Path) -> list[dict]:
    """What `python -m benchmarks.cpu.progress_eta --home HOME` finds per shard in an instance: its rows."""
    command = [sys.executable, "-m", "benchmarks.cpu.progress_eta", "--home", str(home), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("*-progress-eta.json")
    return json.loads(path.read_text())["shards"]


@pytest.mark.parametrize(
    ("value", "text"),
    [(999, "999 B"), (229_892_108, "229.9 MB"), (459_784_216, "459.8 MB"), (999_960, "1.0 MB"), (3.2e15, "3.2 PB")],
)
def test_sizes_are_decimal_with_one_unit(value, text):
    assert format_bytes(value) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(4.26, "4.3 s"), (59.6, "1 min 00 s"), (452.46, "7 min 32 s"), (20912, "5 h 48 min"), (200_000, "2 d 07 h")],
)
def test_durations_read_in_hours_and_minutes(seconds, text):
    assert format_duration(seconds) == text


def test_counts_rates_and_shares():
    assert format_count(1_181_848) == "1,181,848" and format_count(1380, "samples") == "1,380 samples"
    assert format_rate(2611.7, "tokens") == "2,612 tokens/s" and format_rate(3.25, "samples") == "3.2 samples/s"
    assert format_share(0.0438) == "4.4%"
    assert format_duration(math.inf) == "unknown"


def test_the_eta_is_weighted_by_tokens_not_samples():
    """Longest first: a tenth of the samples done can be half of the tokens; the ETA follows the tokens."""
    progress = Progress(
        shard="shard-00",
        samples_done=100,
        samples_total=1000,
        tokens_done=50_000,
        tokens_total=100_000,
        bytes_written=10**8,
        elapsed_s=100.0,
        forward_s=40.0,
        device="cuda:0",
    )
    assert progress.tokens_per_s == 500 and progress.eta_s == pytest.approx(100.0)
    assert progress.forward_share == pytest.approx(0.4)
    line = progress.line()
    assert line.endswith("about 1 min 40 s left.") and "100 of 1,000 samples" in line and "100.0 MB committed" in line
    shown = progress.metadata()
    assert shown["time left"] == "1 min 40 s" and shown["progress"] == "50.0% of tokens" and shown["device"] == "cuda:0"


def test_the_eta_prices_a_fixed_cost_per_batch_and_runs_to_the_materialization():
    """One row per batch, each 0.5 s plus 1 ms per token: the short batches at the end of a longest-first shard
    are mostly that fixed part, which a rate per token leaves out. The first batch (warm-up) is not measured;
    the time after the last batch (writing, the shard table, the materialization event) is added."""
    costs = BatchCostModel()
    costs.add(1000, 1000**2, 60.0)
    for tokens in (900, 700):
        costs.add(tokens, tokens**2, 0.5 + 0.001 * tokens)
    assert costs.seconds_left(10, 1000, 10 * 100**2) is None  # too few batches measured to price the rest
    costs.add(500, 500**2, 1.0)
    assert costs.costs() == pytest.approx([0.5, 0.001, 0.0], abs=1e-9)
    assert costs.seconds_left(10, 1000, 10 * 100**2) == pytest.approx(6.0)
    rate_only = Progress(
        shard="shard-00",
        samples_done=4,
        samples_total=14,
        tokens_done=3100,
        tokens_total=4100,
        bytes_written=0,
        elapsed_s=62.6,
        forward_s=60.0,
        device="cpu",
    )
    priced = replace(rate_only, loop_left_s=costs.seconds_left(10, 1000, 10 * 100**2), after_loop_s=2.5)
    assert not rate_only.estimated and rate_only.eta_s == pytest.approx(1000 * 62.6 / 3100)
    assert priced.estimated and priced.eta_s == pytest.approx(8.5) and priced.metadata()["time left"] == "8.5 s"


def test_long_rows_cost_more_per_token_when_batches_fill_a_token_budget():
    """Batches of 8,192 tokens whose rows get shorter: a cost per token and per token of row length (attention)
    prices the short rows left at what they cost, where the rate so far (long rows) would overstate it."""
    costs = BatchCostModel()
    measured = (4096, 2048, 1024, 512, 256)
    for length in (4096, *measured):  # the first one warms up
        costs.add(8192, 8192 * length, 8192 * (1e-3 + 1e-6 * length))
    left = costs.seconds_left(4, 4 * 8192, 4 * 8192 * 128)
    assert left == pytest.approx(4 * 8192 * (1e-3 + 1e-6 * 128))
    rate_so_far = sum(8192 * (1e-3 + 1e-6 * length) for length in measured) / (len(measured) * 8192)
    assert left < 0.6 * 4 * 8192 * rate_so_far


def test_costs_that_cannot_be_told_apart_fall_back_to_the_rate_or_a_single_part():
    alike = BatchCostModel()  # rows of one length: nothing tells a batch's fixed part from its tokens'
    for tokens in (4096, 4000, 4096, 4050, 4096):
        alike.add(tokens, tokens * 4096, tokens / 2000)
    assert alike.costs() == pytest.approx([0.0, 1 / 2000, 0.0])
    flat = BatchCostModel()  # smaller batches took no less time: all of it is per batch
    for tokens, seconds in ((5000, 9.0), (4000, 2.0), (2000, 2.2), (1000, 2.4)):
        flat.add(tokens, tokens**2, seconds)
    assert flat.costs() == pytest.approx([2.2, 0.0, 0.0])


def test_the_batches_left_follow_the_shape():
    lengths = [100] * 4 + [10] * 8  # two rows of 100 tokens fit 200; four rows of 10 meet the rows cap
    order = LengthOrder(lengths)
    assert order.batches_left(4, 200) == len(plan_batches(lengths, 4, 200)) == 4
    order.take(4, 200)
    assert order.batches_left(4, 200) == 3 and order.batches_left(1, 200) == 10


@pytest.mark.parametrize("seconds", [0.4, 9.96, 42, 452.46, 20912, 200_000, math.inf])
def test_a_shown_duration_reads_back_to_its_precision(seconds):
    shown = format_duration(seconds)
    assert parse_duration(shown) == pytest.approx(seconds, rel=0.02, abs=0.05)
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("12 parsecs")


def test_a_low_forward_share_is_said_in_words():
    busy = ShardRow("shard-00", "complete", 10, 10, 100, 1000, forward_share=0.93)
    idle = ShardRow("shard-01", "complete", 10, 10, 100, 1000, forward_share=0.07)
    assert low_forward_share_note([busy]) is None
    note = low_forward_share_note([busy, idle])
    assert note is not None and "shard-01 7.0%" in note and "shard-00" not in note
    assert 0.07 < LOW_FORWARD_SHARE < 0.93


@pytest.mark.slow  # tokenizes and extracts a shard
def test_a_running_shard_shows_its_progress_on_its_partition_and_in_the_log(small_settings_file, monkeypatch, tmp_path):
    """Observations of the running shard's partition, carrying its progress and ETA, every
    operations.progress_every_s; the same sentence in the run log; the table of every shard on the
    materialization; and the report's table with the same units."""
    monkeypatch.setenv("HSX_OPERATIONS__PROGRESS_EVERY_S", "0.001")
    settings = load_settings(small_settings_file)
    assert settings.operations.progress_every_s == 0.001
    resources = {"settings": HsxSettings(path=str(small_settings_file)), "gpu": GpuResource.from_settings(settings)}
    hidden_states = build_hidden_states(shard_partitions(settings))
    with instance_for_test() as instance:
        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        result = materialize([hidden_states], resources=resources, partition_key="shard-01", instance=instance)
        assert result.success
        records = instance.fetch_observations(AssetKey("hidden_states"), limit=100).records
        assert records, "no progress observation"
        observations = [r.asset_observation for r in records]
        assert {o.partition for o in observations} == {"shard-01"}
        first = observations[-1].metadata  # records come newest first
        assert first["state"].value == "running" and first["device"].value == "cpu"
        assert " of " in first["samples"].value and first["time left"].value != "unknown"
        logged = [e.user_message for e in instance.all_logs(result.run_id) if e.user_message.endswith("left.")]
        assert len(logged) == len(observations) and logged[0].startswith("shard-01: ")
        # what `python -m benchmarks.cpu.progress_eta` reads back: each update's time left against the real time left
        (row,) = progress_eta_rows(Path(instance.root_directory), tmp_path / "progress-eta")
        assert (row["shard"], row["run_id"], len(row["updates"])) == ("shard-01", result.run_id, len(observations))
        assert all(update["real_s"] >= 0 and update["eta_s"] >= 0 for update in row["updates"])

        metadata = instance.get_latest_materialization_event(AssetKey("hidden_states")).asset_materialization.metadata
        table = metadata["shards"].value
        assert "| shard\u201101 | complete |" in table and "| shard\u201100 | not\u00a0started |" in table

    report = "\n".join(summary_lines(str(small_settings_file)))
    assert re.search(r"shard-01 +complete +14/14", report) and re.search(r"shard-00 +not started +0/14", report)
    size = re.search(r"[\d.]+ [KMGT]?B", metadata["shard"].value).group(0)
    assert size in report  # the same size, the same unit, in the UI and the report


@pytest.mark.slow  # tokenizes and extracts a shard
def test_the_first_update_comes_early_and_the_next_after_the_interval(small_settings_file, monkeypatch):
    """A person who launched a shard sees its time left after FIRST_UPDATE_AFTER_S, not a whole interval."""
    monkeypatch.setenv("HSX_OPERATIONS__PROGRESS_EVERY_S", "3600")
    monkeypatch.setattr(hidden_states_asset, "FIRST_UPDATE_AFTER_S", 0.001)
    settings = load_settings(small_settings_file)
    resources = {"settings": HsxSettings(path=str(small_settings_file)), "gpu": GpuResource.from_settings(settings)}
    with instance_for_test() as instance:
        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        hidden_states = build_hidden_states(shard_partitions(settings))
        assert materialize([hidden_states], resources=resources, partition_key="shard-01", instance=instance).success
        records = instance.fetch_observations(AssetKey("hidden_states"), limit=100).records
        assert len(records) == 1 and records[0].asset_observation.metadata["state"].value == "running"
