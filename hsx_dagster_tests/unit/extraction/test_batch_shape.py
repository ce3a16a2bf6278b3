"""`batch_size: auto` and `max_batch_tokens: auto`: the probe that finds the batch shape.

First the probe on its own, driven by a simulated device whose speed depends on the batch shape
(deterministic, so the choices can be asserted); then real shard runs on the demo model: an auto run
stores what a fixed-shape run stores, resumes after a crash without losing or redoing a sample, and
reports its probe in the shard's metadata and in `python -m hsx_dagster.report`.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hsx_dagster.core.extraction import (
    BUDGET_FRACTION,
    WINDOW,
    Backbone,
    BatchShaper,
    Lap,
    LengthOrder,
    Shape,
    plan_batches,
    run_shard,
    start_shape,
)
from hsx_dagster.core.extraction.batch_shape_states import (
    TRANSITIONS,
    ShaperEvent,
    ShaperState,
    TransitionError,
    next_state,
)
from hsx_dagster.core.inputs import read_tokenized_shard
from hsx_dagster.core.settings import ExtractionSettings, parse_auto_or_positive
from hsx_dagster.core.storage import SHARD_INDEX_FILE
from hsx_dagster_tests.support.helpers import shard_job, write_settings
from hsx_dagster_tests.unit.extraction.test_engine import job_keys, make_job, reference_states, stored_samples

CPU = torch.device("cpu")
# Where the simulated devices below start unless a test says otherwise: the shape the probe of the token budget
# was first tuned from (its rows cap, budget // 32, never cuts these lengths). The devices' own starting shapes
# depend on their thread counts (start_shape); tests of the search itself start from a known point.
START = Shape(64, 2048)


def lognormal_lengths(count: int = 4000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(250), 0.8, count), 16, 4096).astype(np.int64)


def peaked_at(best_tokens: int, peak: float = 20_000.0, width: float = 3.0):
    """Tokens/s of a batch: highest when the batch computes about ``best_tokens``, falling off on both sides."""

    def rate(shape: Shape, batch) -> float:
        distance = math.log2(max(batch.computed_tokens, 1) / best_tokens)
        return peak * math.exp(-(distance**2) / (2 * width**2)) * batch.real_tokens / batch.computed_tokens

    return rate


def simulate(lengths, rate, batch_size="auto", max_batch_tokens="auto", device=CPU, start=START, **kwargs):
    """Run a whole shard through the shaper on a simulated device; returns the shaper and the batches."""
    order = LengthOrder(lengths)
    shaper = BatchShaper(
        batch_size, max_batch_tokens, device, order, log_line=lambda message: None, start=start, **kwargs
    )
    batches = []
    while len(order):
        shape, _measured = shaper.next_shape()
        batch = order.take(shape.batch_size, shape.max_batch_tokens)
        shaper.record(batch, Lap(seconds=batch.real_tokens / rate(shape, batch)))
        batches.append((shape, batch))
    return shaper, batches


def test_every_row_runs_exactly_once_and_shapes_are_respected():
    lengths = lognormal_lengths()
    _, batches = simulate(lengths, peaked_at(2048), budget_fraction=1.0)
    rows = [row for _, batch in batches for row in batch.rows]
    assert sorted(rows) == list(range(len(lengths)))
    for shape, batch in batches:
        assert len(batch.rows) <= shape.batch_size
        assert batch.computed_tokens <= shape.max_batch_tokens or len(batch.rows) == 1
    assert [b.longest for _, b in batches] == sorted((b.longest for _, b in batches), reverse=True)


@pytest.mark.parametrize("best", [512, 1024, 2048, 4096, 16384])
def test_the_probe_finds_the_fastest_token_budget(best):
    lengths = lognormal_lengths()
    rate = peaked_at(best)
    shaper, batches = simulate(lengths, rate)  # the default budget
    summary = shaper.summary()
    assert summary.mode == "auto" and summary.probes[0].reason == "start of the shard run"
    assert best // 2 <= summary.max_batch_tokens <= best * 2  # within one step of the fastest
    # the rows cap is an axis of its own: the batches of the bulk of the samples, whichever limit cuts them,
    # compute about the best number of tokens (this device's speed depends on nothing else)
    near = [b for s, b in batches[len(batches) // 10 :] if best // 4 <= b.computed_tokens <= best * 2]
    assert sum(b.real_tokens for b in near) >= 0.8 * sum(b.real_tokens for _, b in batches[len(batches) // 10 :])
    for probe in summary.probes:
        table = [row for row in summary.probe_table if row.probe == probe.probe]
        chosen = [row for row in table if row.chosen]
        assert len(chosen) == 1 and str(Shape(chosen[0].batch_size, chosen[0].max_batch_tokens)) == probe.chosen
    # the whole run, probes included, within 6% of running every batch at the best rate the device has
    seconds = sum(batch.real_tokens / rate(shape, batch) for shape, batch in batches)
    assert seconds <= 1.06 * int(lengths.sum()) / 20_000
    assert summary.probe_overhead_s <= summary.probe_budget_s


def test_the_probe_compares_shapes_on_alternating_batches():
    start = START.max_batch_tokens
    shaper, batches = simulate(np.full(4000, 300), peaked_at(start * 2), budget_fraction=1.0)
    probe = shaper.summary().probes[0]
    step = probe.steps[0]
    # the token budget is tried first (it cuts rows of 300 tokens); the rows cap stays, an axis of its own
    assert (step["incumbent"], step["candidate"]) == (str(START), str(Shape(START.batch_size, start * 2)))
    assert step["result"] == "moved" and step["ratio"] > 1
    # warm-up, then incumbent, candidate, candidate, incumbent: neighbours in the length order and in time
    assert [shape.max_batch_tokens for shape, _ in batches[:5]] == [start, start, 2 * start, 2 * start, start]
    assert probe.chosen == str(Shape(START.batch_size, start * 2))
    first = next(row for row in shaper.summary().probe_table if row.max_batch_tokens == start)
    a_side = step.get("batches_a_side", 2)  # 4 when the close call was run once more
    assert first.batches == 1 + a_side  # the warm-up batch is the starting shape's first measurement


def test_the_probe_cost_stays_within_its_budget():
    lengths = lognormal_lengths()
    shaper, _ = simulate(lengths, peaked_at(512), start=Shape(128, 4096))  # three steps from the best
    summary = shaper.summary()
    assert 0 < summary.probe_overhead_s <= summary.probe_budget_s
    # the budget is BUDGET_FRACTION of the run's estimated time
    total = sum(int(x) for x in lengths) / 20_000
    assert summary.probe_budget_s < 2 * BUDGET_FRACTION * total
    assert summary.probe_batches > 0 and summary.probe_s > summary.probe_overhead_s


@pytest.mark.parametrize("threads", [1, 2])
def test_a_tiny_budget_stops_the_probe_at_the_start_shape(threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    shaper, batches = simulate(lognormal_lengths(), peaked_at(512), budget_fraction=1e-6, start=None)
    summary = shaper.summary()
    assert summary.probes[0].ended == "time budget" and summary.probes[0].steps == ()
    tokens, rows = start_shape("cpu", threads)  # the device's own start
    assert {(shape.max_batch_tokens, shape.batch_size) for shape, _ in batches} == {(tokens, rows)}
    assert summary.probe_overhead_s == 0


def test_a_cpu_starts_with_a_share_of_tokens_and_rows_per_thread():
    """On a CPU a forward pass is split over the threads: each thread's share starts at 4K tokens in 8 rows (the
    1-thread landscape of the demo's hybrid in docs/benchmarks.md), so 2 threads start at 8,192 x 16, the best
    shape of the benchmark's sweep on two CPUs; within the CPU ladder. GPUs start large, with rows hardly capped."""
    assert start_shape("cpu", 1) == (4096, 8)
    assert start_shape("cpu", 2) == start_shape("cpu", 3) == (8192, 16)
    assert start_shape("cpu", 64) == (32768, 512)  # the CPU ladder ends at 32K tokens
    tokens, rows = start_shape("cuda", 2)
    assert tokens >= 32768 and rows == tokens // 32


def test_fixed_numbers_win_and_are_never_probed():
    lengths = lognormal_lengths()
    shaper, batches = simulate(lengths, peaked_at(512), batch_size=16, max_batch_tokens=8192)
    assert shaper.summary().mode == "fixed" and shaper.summary().probes == ()
    planned = plan_batches(lengths, 16, 8192)
    assert [b.rows for _, b in batches] == [b.rows for b in planned]


def test_a_fixed_row_cap_probes_only_the_token_budget():
    shaper, batches = simulate(lognormal_lengths(), peaked_at(1024), batch_size=8, budget_fraction=1.0)
    summary = shaper.summary()
    assert summary.mode == "auto max_batch_tokens"
    assert {shape.batch_size for shape, _ in batches} == {8}
    assert summary.batch_size == 8


def test_a_fixed_token_budget_probes_only_the_row_cap():
    # 16K tokens fixed; the simulated device prefers ~2K-token batches, which only a row cap can give
    shaper, batches = simulate(lognormal_lengths(), peaked_at(2048), max_batch_tokens=16384, budget_fraction=1.0)
    summary = shaper.summary()
    assert summary.mode == "auto batch_size"
    assert {shape.max_batch_tokens for shape, _ in batches} == {16384}
    assert summary.batch_size < 16384 // 32  # fewer rows than the start: smaller batches


def few_rows_best(best_tokens: int = 8192, most_rows: int = 16, peak: float = 20_000.0):
    """A device like a 2-core CPU: fastest at about ``best_tokens`` computed tokens, but slower beyond
    ``most_rows`` rows (many short rows run out of cache), so its best shape is off the budget // 32 line."""

    def rate(shape: Shape, batch) -> float:
        distance = math.log2(max(batch.computed_tokens, 1) / best_tokens)
        rows = len(batch.rows)
        too_many = math.exp(-(math.log2(rows / most_rows) ** 2) / 4) if rows > most_rows else 1.0
        return peak * math.exp(-(distance**2) / 8) * too_many * batch.real_tokens / batch.computed_tokens

    return rate


def fixed_seconds(lengths, rate, rows: int, tokens: int) -> float:
    return sum(b.real_tokens / rate(Shape(rows, tokens), b) for b in plan_batches(lengths, rows, tokens))


def test_the_rows_cap_is_probed_where_the_rows_are_short():
    lengths = lognormal_lengths()
    rate = few_rows_best()
    budgets = [2**k for k in range(9, 16)]
    grid = {
        (rows, tokens): fixed_seconds(lengths, rate, rows, tokens) for tokens in budgets for rows in (4, 16, 64, 256)
    }
    on_the_line = min(fixed_seconds(lengths, rate, tokens // 32, tokens) for tokens in budgets)
    best = min(grid.values())
    assert grid[(16, 8192)] == best and best < 0.93 * on_the_line  # only a probe of the rows cap gets there
    shaper, batches = simulate(lengths, rate)
    summary = shaper.summary()
    seconds = sum(batch.real_tokens / rate(shape, batch) for shape, batch in batches)
    assert seconds <= 1.05 * best < on_the_line  # probes included
    assert summary.batch_size <= 32 < START.batch_size
    rows_steps = [
        s for p in summary.probes for s in p.steps if s["candidate"].split(" x ")[1] != s["incumbent"].split(" x ")[1]
    ]
    assert rows_steps and all(s["candidate"].split(" x ")[0] == s["incumbent"].split(" x ")[0] for s in rows_steps)


def test_a_rows_cap_is_not_probed_on_a_few_long_rows():
    """At the head of a shard a rows cap below the rows the token budget takes would cut the long rows as a smaller
    budget does, and then the short rows of the bulk into batches as small: there the token budget moves instead."""

    def fewer_is_faster(shape, batch):
        return 20_000.0 / len(batch.rows) ** 0.5

    shaper, _ = simulate(np.full(200, 3000), fewer_is_faster, start=Shape(16, 8192), budget_fraction=1.0)
    summary = shaper.summary()
    steps = [step for probe in summary.probes for step in probe.steps]
    assert steps and all(step["candidate"].endswith("x 16 rows") for step in steps)
    assert summary.batch_size == 16 and summary.max_batch_tokens < 8192
    assert "rows cap: the token budget fits fewer than 8 rows" in summary.probes[0].ended


@pytest.mark.parametrize("gain, extended, moved", [(1.3, False, True), (1.05, True, True), (1.0, True, False)])
def test_a_close_comparison_is_run_once_more(gain, extended, moved):
    candidate_budget = 2 * START.max_batch_tokens

    def rate(shape, batch):
        return 20_000.0 * (gain if shape.max_batch_tokens == candidate_budget else 1.0)

    shaper, batches = simulate(np.full(4000, 300), rate, budget_fraction=1.0)
    step = shaper.summary().probes[0].steps[0]
    assert step["candidate"] == str(Shape(START.batch_size, candidate_budget))
    assert step["ratio"] == pytest.approx(gain) and (step["result"] == "moved") == moved
    assert step.get("batches_a_side") == (4 if extended else None)
    # warm-up, then I C C I, and once more I C C I when the call was close
    schedule = [shape.max_batch_tokens == candidate_budget for shape, _ in batches[1 : 9 if extended else 5]]
    assert schedule == [False, True, True, False] * (2 if extended else 1)


def test_the_head_of_a_shard_cannot_spend_the_budget_of_its_bulk():
    """60 long rows (2% of the tokens), then 20,000 short ones; every shape but the start is 30% slower. The first
    probe tries the start's neighbours once (the start is a guess); the probe when the longest row halves decides for
    the next 30 rows only, so it may not spend what the bulk's probe then uses, though the run's budget has room."""
    lengths = np.concatenate([np.full(30, 4000), np.full(30, 2000), np.full(20_000, 200)])
    shaper, _ = simulate(lengths, lambda shape, batch: 20_000.0 * (1.0 if shape == START else 0.7))
    summary = shaper.summary()
    assert summary.probes[0].steps  # the start's neighbours, tried once
    assert summary.probes_skipped_for_budget == 1  # at 2,000 tokens: 30 rows are not worth a step
    assert summary.probe_overhead_s < 0.2 * summary.probe_budget_s  # not for want of the run's budget
    bulk = next(probe for probe in summary.probes if probe.longest_tokens == 200)
    assert len(bulk.steps) >= 3 and all(step["result"] == "stayed" for step in bulk.steps)


def test_a_drop_in_throughput_triggers_another_probe():
    lengths = np.full(6000, 300)  # one length: only the drop can trigger a re-probe
    slow_after = {"tokens": 0}
    base = peaked_at(2048)

    def rate(shape, batch):
        slow_after["tokens"] += batch.real_tokens
        slowdown = 0.4 if slow_after["tokens"] > 600_000 else 1.0  # e.g. the device throttles
        # once slowed, smaller batches are the better ones
        return base(shape, batch) * slowdown * (1.5 if slowdown < 1 and shape.max_batch_tokens <= 1024 else 1.0)

    shaper, _ = simulate(lengths, rate, budget_fraction=1.0)
    probes = shaper.summary().probes
    assert len(probes) >= 2
    assert "throughput dropped" in probes[1].reason
    assert shaper.summary().max_batch_tokens <= 1024


def test_shorter_samples_trigger_another_probe():
    lengths = np.concatenate([np.full(300, 2000), np.full(4000, 150)])
    shaper, _ = simulate(lengths, peaked_at(4096), budget_fraction=1.0)
    probes = shaper.summary().probes
    assert len(probes) == 2 and "longest sample left is 150 tokens" in probes[1].reason


def test_out_of_memory_lowers_the_budget_for_the_rest_of_the_run():
    lengths = lognormal_lengths()
    order = LengthOrder(lengths)
    shaper = BatchShaper("auto", "auto", CPU, order, budget_fraction=1.0, log_line=lambda m: None)
    rate = peaked_at(32768)  # larger is faster, but the device fits only 6,000 computed tokens
    used = []
    while len(order):
        shape, _ = shaper.next_shape()
        batch = order.peek(shape.batch_size, shape.max_batch_tokens)
        if batch.computed_tokens > 6000 and len(batch.rows) > 1:
            cap = shaper.out_of_memory(batch, shape)
            assert cap <= 6000 or cap < shape.max_batch_tokens
            continue  # the engine would run the split pieces; here they simply run later
        order.take(shape.batch_size, shape.max_batch_tokens)
        shaper.record(batch, Lap(seconds=batch.real_tokens / rate(shape, batch)))
        used.append(batch)
    summary = shaper.summary()
    assert summary.token_cap_reason == "out of memory" and summary.token_cap <= 6000
    assert summary.max_batch_tokens <= 6000
    assert max(b.computed_tokens for b in used if len(b.rows) > 1) <= 6000


def test_a_window_of_slow_batches_is_needed_before_reprobing():
    lengths = np.full(3000, 300)
    calls = {"n": 0}

    def one_slow_batch(shape, batch):
        calls["n"] += 1
        return 200.0 if calls["n"] == 60 else 20_000.0

    shaper, _ = simulate(lengths, one_slow_batch, budget_fraction=1.0)
    assert WINDOW > 1 and len(shaper.summary().probes) == 1  # one slow batch is noise, not a drop


def test_the_shaper_moves_only_along_its_transition_table():
    """Warm-up, then a probe comparing shapes, then the chosen shape runs; a fixed shape runs from the start. An
    event the table (batch_shape_states.TRANSITIONS) has no entry for in the current state is refused by name."""
    order = LengthOrder(lognormal_lengths(2000))
    shaper = BatchShaper("auto", "auto", CPU, order, log_line=lambda m: None, start=START)
    assert shaper.state is ShaperState.WARMUP
    shape, measured = shaper.next_shape()
    batch = order.take(shape.batch_size, shape.max_batch_tokens)
    shaper.record(batch, Lap(seconds=batch.real_tokens / peaked_at(8192)(shape, batch)))
    assert measured and shaper.state is ShaperState.COMPARE
    while len(order):
        shape, _ = shaper.next_shape()
        batch = order.take(shape.batch_size, shape.max_batch_tokens)
        shaper.record(batch, Lap(seconds=batch.real_tokens / peaked_at(8192)(shape, batch)))
    assert shaper.state is ShaperState.RUN and shaper.summary().probes
    fixed = BatchShaper(32, 4096, CPU, LengthOrder(lognormal_lengths(100)), log_line=lambda m: None)
    assert fixed.state is ShaperState.RUN
    with pytest.raises(TransitionError, match=r"WARMUP_RECORDED .*cannot happen in state RUN; allowed there: REPROBE"):
        next_state(ShaperState.RUN, ShaperEvent.WARMUP_RECORDED)
    assert {state for state, _ in TRANSITIONS} == set(ShaperState)  # each state has a way on


@pytest.mark.parametrize("value, expected", [("auto", None), ("AUTO", None), (None, None), (64, 64), ("64", 64)])
def test_parse_auto_or_positive(value, expected):
    assert parse_auto_or_positive(value) == expected


def test_settings_default_to_auto_and_numbers_win(monkeypatch):
    assert (ExtractionSettings().batch_size, ExtractionSettings().max_batch_tokens) == ("auto", "auto")
    assert ExtractionSettings(batch_size=64, max_batch_tokens="32768").max_batch_tokens == 32768
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        ExtractionSettings(batch_size=0)
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        ExtractionSettings(max_batch_tokens="lots")


def test_auto_and_numbers_reach_the_gpu_resource_from_every_entry_point(tmp_path, monkeypatch, demo_root):
    """The settings file, HSX_EXTRACTION__*, and run config of the `gpu` resource (a Dagster Any field
    generated from `int | Literal['auto']`), validated by the settings model."""
    from dagster import RunConfig, validate_run_config

    from hsx_dagster.core.settings import load_settings
    from hsx_dagster.defs.build import build_definitions
    from hsx_dagster.defs.resources import GpuResource

    settings_file = write_settings(
        tmp_path / "hsx.yaml",
        dataset={"paths": [demo_root / "conversations" / "demo_openai.jsonl"]},
        model={"path": demo_root / "models" / "tiny-qwen3_5"},
        extraction={"max_batch_tokens": 4096},
    )
    gpu = build_definitions(load_settings(settings_file)).resources["gpu"]
    assert (gpu.batch_size, gpu.max_batch_tokens) == ("auto", 4096)  # file, and the default
    monkeypatch.setenv("HSX_EXTRACTION__BATCH_SIZE", "48")
    monkeypatch.setenv("HSX_EXTRACTION__MAX_BATCH_TOKENS", "auto")
    gpu = build_definitions(load_settings(settings_file)).resources["gpu"]
    assert (gpu.batch_size, gpu.max_batch_tokens) == (48, "auto")  # the environment wins over the file
    validated = gpu.validated()
    assert (validated.batch_size, validated.max_batch_tokens) == (48, "auto")

    # run config goes through Dagster's config system: numbers and "auto" both pass, anything else is named
    defs = build_definitions(load_settings(settings_file))
    job = defs.get_implicit_global_asset_job_def()
    for value in (64, "auto"):
        config = RunConfig(resources={"gpu": {"config": {"batch_size": value, "max_batch_tokens": value}}})
        resolved = validate_run_config(job, config.to_config_dict())["resources"]["gpu"]["config"]
        assert GpuResource(**resolved).validated().batch_size == value
    from hsx_dagster.core.settings import SettingsError

    with pytest.raises(SettingsError, match=r"resource `gpu` config: `batch_size`: .*positive integer or 'auto'"):
        GpuResource(batch_size="many").validated()


# --- real shard runs on the demo model -----------------------------------------------------------


def auto_keys(tokenized, out, model, layers, **overrides) -> dict:
    fields = {"batch_size": "auto", "max_batch_tokens": "auto", "probe_budget": 1.0}  # 1.0: always probe
    return job_keys(tokenized, out, model, layers, **{**fields, **overrides})


def auto_job(tokenized, out, model, layers, **overrides):
    return shard_job(**auto_keys(tokenized, out, model, layers, **overrides))


def test_an_auto_run_stores_what_a_fixed_shape_run_stores(tokenized, demo_model_dir, tmp_path):
    layers = (1, 3, 4)
    messages: list[str] = []
    auto = run_shard(auto_job(tokenized, tmp_path / "auto", demo_model_dir, layers), log_line=messages.append)
    run_shard(make_job(tokenized, tmp_path / "fixed", demo_model_dir, layers, batch_size=8))
    shape = auto.report.batch_shape
    assert shape.mode == "auto" and shape.probes[0].reason == "start of the shard run"
    assert len({(r.batch_size, r.max_batch_tokens) for r in shape.probe_table}) >= 2
    assert shape.probe_batches >= 3 and shape.probe_s > 0
    assert auto.report.final_max_batch_tokens == shape.max_batch_tokens
    assert any("batch shape probe 0 (start of the shard run)" in m and "tokens/s ->" in m for m in messages)

    reference = reference_states(demo_model_dir, tokenized)
    stored_auto, stored_fixed = stored_samples(tmp_path / "auto"), stored_samples(tmp_path / "fixed")
    assert stored_auto.keys() == stored_fixed.keys() == reference.keys()
    for sample_id, sample in stored_auto.items():
        expected = torch.stack([reference[sample_id][i + 1] for i in layers], dim=1)
        torch.testing.assert_close(sample["hidden_states"], expected, rtol=1e-4, atol=1e-4)  # parity tolerance
        torch.testing.assert_close(
            sample["hidden_states"], stored_fixed[sample_id]["hidden_states"], rtol=1e-4, atol=1e-4
        )
        assert torch.equal(sample["input_ids"], stored_fixed[sample_id]["input_ids"])
        assert torch.equal(sample["loss_mask"], stored_fixed[sample_id]["loss_mask"])


def test_a_crashed_auto_run_resumes_without_losing_or_redoing_a_sample(
    tokenized, demo_model_dir, tmp_path, monkeypatch
):
    layers = (1, 4)
    out = tmp_path / "out"
    calls = {"n": 0}
    original = Backbone.forward

    ran_rows: list[int] = []

    def crash_during_the_probe(self, input_ids, attention_mask):
        calls["n"] += 1
        if calls["n"] == 3:  # the warm-up and the incumbent's first batch ran: crash in the candidate's
            raise RuntimeError("simulated crash: the node went away")
        ran_rows.append(int(input_ids.shape[0]))
        return original(self, input_ids, attention_mask)

    monkeypatch.setattr(Backbone, "forward", crash_during_the_probe)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_shard(auto_job(tokenized, out, demo_model_dir, layers, chunk_bytes=1))
    committed = [json.loads(line) for line in (out / SHARD_INDEX_FILE).read_text().splitlines()]
    committed_samples = sum(record["samples"] for record in committed)
    assert committed_samples == sum(ran_rows) < 28  # the two batches that ran were committed
    assert len(committed) == committed_samples  # chunk_bytes=1: a chunk per sample
    mtimes = {r["chunk"]: (out / r["chunk"]).stat().st_mtime_ns for r in committed}

    monkeypatch.setattr(Backbone, "forward", original)
    seen_rows: list[int] = []

    def counting(self, input_ids, attention_mask):
        seen_rows.append(int(input_ids.shape[0]))
        return original(self, input_ids, attention_mask)

    monkeypatch.setattr(Backbone, "forward", counting)
    resumed = run_shard(auto_job(tokenized, out, demo_model_dir, layers, chunk_bytes=1))
    # the resumed run (probe included) computed exactly the samples that were not committed
    assert resumed.report.samples_skipped == committed_samples
    assert resumed.report.samples == sum(seen_rows) == 28 - committed_samples
    assert resumed.report.batch_shape.probes  # it probed again, on its own pending samples
    assert all((out / chunk).stat().st_mtime_ns == mtime for chunk, mtime in mtimes.items())
    stored = stored_samples(out)  # asserts that no sample is stored twice
    table = read_tokenized_shard(tokenized, "shard-00")
    assert sorted(stored) == sorted(table.column("sample_id").to_pylist())
    reference = reference_states(demo_model_dir, tokenized)
    for sample_id, sample in stored.items():
        expected = torch.stack([reference[sample_id][i + 1] for i in layers], dim=1)
        torch.testing.assert_close(sample["hidden_states"], expected, rtol=1e-4, atol=1e-4)


def test_out_of_memory_during_the_probe_is_remembered(tokenized, demo_model_dir, tmp_path, monkeypatch):
    original = Backbone.forward

    def small_device(self, input_ids, attention_mask):
        if input_ids.numel() > 3000:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return original(self, input_ids, attention_mask)

    monkeypatch.setattr(Backbone, "forward", small_device)
    result = run_shard(auto_job(tokenized, tmp_path / "out", demo_model_dir, (1, 4)))
    shape = result.report.batch_shape
    assert result.report.oom_splits > 0 and shape.token_cap_reason == "out of memory"
    assert shape.token_cap <= 3000 and result.report.final_max_batch_tokens <= 3000
    assert all(row.max_batch_tokens <= 4096 for row in shape.probe_table)
    stored = stored_samples(tmp_path / "out")
    assert sorted(stored) == sorted(read_tokenized_shard(tokenized, "shard-00").column("sample_id").to_pylist())


def test_the_probe_is_in_the_metadata_and_the_report(tokenized, demo_model_dir, tmp_path):
    from dagster import MetadataValue

    from hsx_dagster.core.extraction import ExtractionReport
    from hsx_dagster.defs.assets.hidden_states import hidden_states_metadata
    from hsx_dagster.report import batch_shape_lines

    job = auto_job(tokenized, tmp_path / "out", demo_model_dir, (1, 4))
    result = run_shard(job)
    metadata = hidden_states_metadata(result, job)
    shape = result.report.batch_shape
    assert metadata["batch settings"] == "batch_size auto, max_batch_tokens auto"  # the settings
    assert f"shape {shape.max_batch_tokens:,} tokens x {shape.batch_size} rows (auto)" in metadata["batches"]
    assert "probing" in metadata["probes"] and f"of the run (budget {job.probe_budget:.1%})" in metadata["probes"]
    assert isinstance(metadata["probe table"], type(MetadataValue.md("")))
    text = metadata["probe table"].value
    assert "| probe | tokens\u00a0×\u00a0rows |" in text and "tokens/s" in text and "**chosen**" in text
    for row in shape.probe_table:
        assert f"| {row.max_batch_tokens:,}\u00a0×\u00a0{row.batch_size:,} |" in text

    last_run = json.loads((tmp_path / "out" / "complete.json").read_text())["last_run"]
    lines = batch_shape_lines(ExtractionReport.from_dict(last_run))
    assert lines[0].strip().startswith(f"batch shape {shape.max_batch_tokens:,} tokens x {shape.batch_size} rows")
    assert "probe" in lines[0] and any("tokens/s" in line for line in lines[1:])

    fixed_job = make_job(tokenized, tmp_path / "fixed", demo_model_dir, (1, 4))
    fixed = hidden_states_metadata(run_shard(fixed_job), fixed_job)
    assert "shape 4,096 tokens x 8 rows (fixed)" in fixed["batches"] and "probes" not in fixed


@pytest.mark.slow
def test_an_auto_run_killed_during_the_probe_resumes_without_losing_or_duplicating(tokenized, demo_model_dir, tmp_path):
    """SIGKILL in the middle of a probe's candidate batch (a real process, see shard_child.py); the
    re-run probes again on what is left and never redoes a committed sample."""
    import multiprocessing
    import signal

    from hsx_dagster.core.storage import read_index
    from hsx_dagster_tests.support import shard_child

    out = tmp_path / "shard-00"
    job = auto_keys(tokenized, out, demo_model_dir, (1, 3), chunk_bytes=1)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["hsx_dagster_tests.support.shard_child"])
    child = context.Process(target=shard_child.run_and_kill, args=(job, "forward", 3))  # warm-up, I, then C
    child.start()
    child.join(timeout=300)
    assert child.exitcode == -signal.SIGKILL
    committed = sum(record.samples for record in read_index(out))
    assert len(read_index(out)) == committed and 0 < committed < 28  # chunk_bytes=1: a chunk per sample

    result = run_shard(shard_job(**job))
    assert result.report.samples_skipped == committed and result.report.samples == 28 - committed
    assert result.report.batch_shape.mode == "auto"
    stored = stored_samples(out)  # asserts no sample is stored twice
    reference = reference_states(demo_model_dir, tokenized)
    assert stored.keys() == reference.keys()
    for sample_id, sample in stored.items():
        expected = torch.stack([reference[sample_id][i + 1] for i in (1, 3)], dim=1)
        torch.testing.assert_close(sample["hidden_states"], expected, rtol=1e-4, atol=1e-4)
