"""Shard-level checks: the core functions on good and damaged shard folders, and the blocking checks
on each `hidden_states` partition through the `hidden_states_shard` job on a real instance, with the
retry sensor treating a shard that fails its check as failed."""

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dagster import AssetKey, DagsterInstance, build_sensor_context, instance_for_test, materialize
from safetensors import safe_open
from safetensors.torch import save

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.dataset import DrafterDataset, check_shard
from hsx_dagster.core.dataset.shard_checks import integrity_outcome, numerics_outcome, scan_shard
from hsx_dagster.core.settings import load_settings
from hsx_dagster.core.storage import read_index
from hsx_dagster.defs.assets.drafter import drafter_dataset
from hsx_dagster.defs.assets.tokenized import tokenized_dataset
from hsx_dagster.defs.build import build_definitions
from hsx_dagster.defs.checks import SHARD_CHECKS
from hsx_dagster.defs.resources import HsxSettings
from hsx_dagster.defs_support.asset_keys import HIDDEN_STATES
from hsx_dagster_tests.support.dagster_internals import backfill_partitions
from hsx_dagster_tests.support.helpers import write_settings


# One check at a time, as the tests read them (the pipeline runs all three from one read: `check_shard`).
def check_shard_coverage(shard_dir: Path, tokenized_dir: Path, shard: str) -> CheckOutcome:
    return check_shard(shard_dir, tokenized_dir, shard)["shard_coverage"]


def check_shard_integrity(shard_dir: Path) -> CheckOutcome:
    return integrity_outcome(scan_shard(shard_dir))


def check_shard_numerics(shard_dir: Path) -> CheckOutcome:
    return numerics_outcome(scan_shard(shard_dir))


@pytest.fixture(scope="module")
def settings_file(tmp_path_factory, small_inputs, dense_model_dir) -> Path:
    """28 conversations, two shards, small chunks (several per shard), fp8 storage with the final state; the dense
    tiny model (the checks read bytes, whichever model made them; it makes them faster than the hybrid)."""
    return write_settings(
        tmp_path_factory.mktemp("shard-checks") / "hsx.yaml",
        dataset={"paths": [small_inputs], "max_length": 1024},
        model={"path": dense_model_dir, "layers": [1, 4], "include_final": True},
        shards=2,
        output_dir="out",
        extraction={
            "devices": ["cpu"],
            "batch_size": 8,
            "max_batch_tokens": 4096,
            "chunk_mb": 0.1,
            "storage_dtype": "float8_e4m3",
        },
        operations={"max_retries": 2},
    )


@dataclass
class Extracted:
    settings_file: Path
    instance: DagsterInstance
    defs: object
    out: Path

    def run_shard(self, shard: str, **tags):
        job = self.defs.resolve_job_def("hidden_states_shard")
        return job.execute_in_process(partition_key=shard, instance=self.instance, tags=tags, raise_on_error=False)

    def evaluations(self, result) -> dict:
        return {e.check_name: e for e in result.get_asset_check_evaluations()}


@pytest.fixture(scope="module")
def extracted(settings_file):
    """Both shards extracted once through the shard job; each test copies what it damages."""
    defs = build_definitions(load_settings(settings_file))
    with instance_for_test() as instance:
        resources = {"settings": HsxSettings(path=str(settings_file))}
        assert materialize([tokenized_dataset], resources=resources, instance=instance).success
        pipeline = Extracted(settings_file, instance, defs, settings_file.parent / "out")
        for shard in ("shard-00", "shard-01"):
            result = pipeline.run_shard(shard)
            assert result.success
            evaluations = pipeline.evaluations(result)
            assert set(evaluations) == set(SHARD_CHECKS)
            assert all(e.passed for e in evaluations.values()), {k: e.description for k, e in evaluations.items()}
            assert {e.partition for e in evaluations.values()} == {shard}  # evaluated for the run's partition
            # what checking cost, in words beside the extraction's time (one read for the three checks)
            times = {e.metadata["checks time"].value for e in evaluations.values()}
            (words,) = times
            # one hash per byte: the run's own chunks are not read again (written.jsonl), their bytes not hashed twice
            chunks = len(read_index(pipeline.out / "hidden_states" / shard))
            assert re.fullmatch(rf".+ to read 0 B; the extraction took .+ \(.+% of it\); {chunks} chunks \(.+\) "
                                "written by this run, checksums as its writer computed them, not read again",
                                words), words  # fmt: skip
            # the checks' own CPU time per GB the run stored: the last part of the run's host CPU per GB
            assert evaluations["shard_integrity"].metadata["checks_cpu_s_per_gb"].value > 0
        yield pipeline


@pytest.fixture
def shard_copy(extracted, tmp_path) -> Path:
    folder = tmp_path / "shard-00"
    shutil.copytree(extracted.out / "hidden_states" / "shard-00", folder)
    return folder


def test_checks_pass_on_good_shards_and_report_per_layer_statistics(extracted):
    tokenized = extracted.out / "tokenized"
    for shard in ("shard-00", "shard-01"):
        folder = extracted.out / "hidden_states" / shard
        assert len(read_index(folder)) > 1  # several chunks: the checks walk all of them
        coverage = check_shard_coverage(folder, tokenized, shard)
        assert coverage.passed, coverage.description
        assert coverage.metadata["committed"] + coverage.metadata["quarantined"] == 14
        integrity = check_shard_integrity(folder)
        assert integrity.passed, integrity.description
        numerics = check_shard_numerics(folder)
        assert numerics.passed, numerics.description
        assert [row["layer"] for row in numerics.metadata["per_layer"]] == ["layer 1", "layer 4", "final"]
        assert all(row["std"] > 0 for row in numerics.metadata["per_layer"])


def test_a_flipped_byte_fails_integrity_naming_the_chunk(shard_copy):
    record = read_index(shard_copy)[1]
    path = shard_copy / record.chunk
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    outcome = check_shard_integrity(shard_copy)
    assert not outcome.passed
    assert f"{path}: checksum differs" in outcome.description
    assert outcome.metadata["problems"] == 1


def _rewrite(path: Path, change) -> None:
    """Apply `change` to a chunk's tensors and save it (the index still records the old checksum)."""
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a mapping)
        metadata = handle.metadata()
    change(tensors)
    path.write_bytes(save(tensors, metadata=metadata))


def test_a_header_of_another_layout_fails_integrity_even_with_its_checksum_recorded(shard_copy):
    index = shard_copy / "index.jsonl"
    first = read_index(shard_copy)[0]
    path = shard_copy / first.chunk
    _rewrite(path, lambda t: t.pop("final_hidden_states_scales"))
    import hashlib

    lines = index.read_text().splitlines()
    entry = json.loads(lines[0])
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    lines[0] = json.dumps(entry)
    index.write_text("\n".join(lines) + "\n")
    outcome = check_shard_integrity(shard_copy)
    assert not outcome.passed
    assert "final_hidden_states_scales is missing" in outcome.description


def test_nan_states_fail_numerics_naming_the_sample(shard_copy):
    record = read_index(shard_copy)[0]

    def poison(tensors):
        scales = tensors["hidden_states_scales"].clone()
        scales[0, 1, 0] = float("nan")  # the first sample's first token, layer 4
        tensors["hidden_states_scales"] = scales

    _rewrite(shard_copy / record.chunk, poison)
    outcome = check_shard_numerics(shard_copy)
    assert not outcome.passed
    assert f"NaN or Inf in 1 samples: [{record.sample_ids[0]}]" in outcome.description


def test_a_sample_lost_or_doubled_fails_coverage(extracted, shard_copy):
    tokenized = extracted.out / "tokenized"
    index = shard_copy / "index.jsonl"
    lines = index.read_text().splitlines()
    lost = json.loads(lines[-1])["sample_ids"]
    index.write_text("\n".join(lines[:-1]) + "\n")  # the last chunk's samples are no longer committed
    outcome = check_shard_coverage(shard_copy, tokenized, "shard-00")
    assert not outcome.passed
    assert f"{len(lost)} samples neither committed nor quarantined" in outcome.description

    index.write_text("\n".join(lines) + "\n")
    first = json.loads(lines[0])["sample_ids"][0]
    (shard_copy / "quarantine.jsonl").write_text(json.dumps({"sample_id": first, "reason": "x", "detail": ""}) + "\n")
    outcome = check_shard_coverage(shard_copy, tokenized, "shard-00")
    assert not outcome.passed
    assert f"1 samples committed or quarantined more than once (e.g. [{first}])" in outcome.description


def test_stored_ids_that_differ_from_the_tokenized_ones_fail_coverage(extracted, shard_copy):
    record = read_index(shard_copy)[0]

    def shift(tensors):
        tensors["input_ids"] = tensors["input_ids"] + torch.ones_like(tensors["input_ids"])

    _rewrite(shard_copy / record.chunk, shift)
    outcome = check_shard_coverage(shard_copy, extracted.out / "tokenized", "shard-00")
    assert not outcome.passed
    assert f"{record.samples} samples' stored ids or loss mask differ" in outcome.description


def _age_chunks(folder: Path, seconds: float = 60.0) -> dict[str, int]:
    """Chunk files dated ``seconds`` back (as chunks extracted a while before the checks are); their mtimes."""
    stamp = time.time_ns() - int(seconds * 1e9)
    for path in folder.glob("chunk-*"):
        os.utime(path, ns=(stamp, stamp))
    return {path.name: path.stat().st_mtime_ns for path in folder.glob("chunk-*")}


def test_verified_unchanged_chunks_are_not_read_again_and_damage_since_is_caught(extracted, shard_copy):
    """#33: the checks hash only chunks new or changed since they last verified them (size, mtime, inode in
    verified.json) and say how much they skipped; a byte flipped in a chunk since, and a chunk gone since, are
    still caught; coverage compares no ids while neither a chunk nor the tokenized shard changed."""
    tokenized = extracted.out / "tokenized"
    records = read_index(shard_copy)
    _age_chunks(shard_copy)
    first = check_shard(shard_copy, tokenized, "shard-00")  # a copy: other inodes, so everything is read
    assert all(o.passed for o in first.values())
    total = sum(r.bytes for r in records)
    assert (first["shard_integrity"].metadata["chunks_hashed"], first["shard_integrity"].metadata["scan_bytes"]) == (
        len(records),
        total,
    )

    again = check_shard(shard_copy, tokenized, "shard-00")
    assert all(o.passed for o in again.values()), {k: o.description for k, o in again.items()}
    for outcome in again.values():  # every check says what the one scan read and skipped
        figures = {k: outcome.metadata[k] for k in ("chunks_hashed", "chunks_skipped", "scan_bytes", "bytes_skipped")}
        assert figures == {"chunks_hashed": 0, "chunks_skipped": len(records), "scan_bytes": 0, "bytes_skipped": total}
    assert again["shard_coverage"].metadata["chunks_compared"] == 0
    assert "verified before and unchanged since" in again["shard_integrity"].description

    flipped, gone = records[1], records[-1]
    _flip_a_byte(shard_copy / flipped.chunk)
    (shard_copy / gone.chunk).unlink()
    after = check_shard(shard_copy, tokenized, "shard-00")
    integrity = after["shard_integrity"]
    assert not integrity.passed
    assert f"{shard_copy / flipped.chunk}: checksum differs" in integrity.description
    assert f"{shard_copy / gone.chunk}: missing" in integrity.description
    assert integrity.metadata["chunks_skipped"] == len(records) - 2
    assert integrity.metadata["chunks_hashed"] == 2
    assert not after["shard_numerics"].passed  # the flipped chunk's states are read and named


def test_a_chunk_changed_within_the_second_it_was_verified_is_read_again(extracted, shard_copy):
    """File times are coarser than nanoseconds: a chunk modified right after its verification can keep the mtime
    recorded. A chunk verified within RACY_NS of its last modification is therefore not trusted next time."""
    tokenized = extracted.out / "tokenized"
    record = read_index(shard_copy)[0]
    path = shard_copy / record.chunk
    fresh = time.time_ns()
    os.utime(path, ns=(fresh, fresh))  # modified just now, then verified
    assert check_shard(shard_copy, tokenized, "shard-00")["shard_integrity"].passed
    _flip_a_byte(path)
    os.utime(path, ns=(fresh, fresh))  # the same mtime, as a write within the same clock tick leaves it
    integrity = check_shard(shard_copy, tokenized, "shard-00")["shard_integrity"]
    assert not integrity.passed and f"{path}: checksum differs" in integrity.description


def test_unchanged_chunks_are_compared_again_with_a_changed_tokenized_shard(extracted, shard_copy, tmp_path):
    tokenized = tmp_path / "tokenized"
    shutil.copytree(extracted.out / "tokenized", tokenized)
    records = read_index(shard_copy)
    _age_chunks(shard_copy)
    assert all(o.passed for o in check_shard(shard_copy, tokenized, "shard-00").values())
    file = tokenized / "samples" / "shard-00.parquet"
    table = pq.read_table(file)
    masks = table.column("loss_mask").to_pylist()
    sample = records[0].sample_ids[0]
    row = table.column("sample_id").to_pylist().index(sample)
    masks[row] = [1 - m for m in masks[row]]
    position = table.schema.get_field_index("loss_mask")
    pq.write_table(table.set_column(position, "loss_mask", pa.array(masks, pa.list_(pa.uint8()))), file)
    outcomes = check_shard(shard_copy, tokenized, "shard-00")
    assert outcomes["shard_integrity"].passed and outcomes["shard_integrity"].metadata["chunks_skipped"] == len(records)
    coverage = outcomes["shard_coverage"]
    assert not coverage.passed and coverage.metadata["chunks_compared"] == len(records)
    assert f"(e.g. [{sample}])" in coverage.description


def _flip_a_byte(path: Path) -> None:
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    path.write_bytes(bytes(damaged))


@pytest.mark.slow  # per damage: two shard runs and two ticks, then the drafter dataset
@pytest.mark.parametrize(
    ("shard", "damage", "reason"), [("shard-01", _flip_a_byte, "checksum"), ("shard-00", Path.unlink, "missing")]
)
def test_damage_is_healed_by_the_retry_sensor_alone(extracted, shard, damage, reason):
    """Done-when of #24: a flipped byte or a deleted chunk fails the shard's blocking check, which sets the chunk
    aside; the retry sensor's run re-extracts exactly its samples; the checks pass; the dataset assembles; every
    other chunk is untouched."""
    defs, instance = extracted.defs, extracted.instance
    sensor = defs.resolve_sensor_def("retry_failed_shards")

    def tick():
        context = build_sensor_context(instance=instance, repository_def=defs.get_repository_def())
        return sensor.evaluate_tick(context)

    assert tick().skip_message == "no failed hidden_states shard"
    folder = extracted.out / "hidden_states" / shard
    record = read_index(folder)[-1]
    others = {p.name: p.read_bytes() for p in folder.glob("chunk-*") if p.name != record.chunk}
    damage(folder / record.chunk)

    result = extracted.run_shard(shard)  # nothing to extract: the run re-checks the shard
    integrity = extracted.evaluations(result)["shard_integrity"]
    assert not integrity.passed and integrity.partition == shard
    assert (
        "set aside 1 chunks" in integrity.description
        and f"their {record.samples} samples are pending" in integrity.description
    )
    (removed,) = [json.loads(line) for line in (folder / "removed_chunks.jsonl").read_text().splitlines()][-1:]
    assert (removed["chunk"], removed["reason"]) == (record.chunk, reason)
    assert (folder / removed["kept_as"]).is_file() == (reason != "missing")  # moved aside, never deleted
    assert record.chunk not in {r.chunk for r in read_index(folder)}

    (request,) = tick().run_requests  # the sensor alone: its backfill, run as the daemon would run it
    assert backfill_partitions(request, HIDDEN_STATES) == [shard]
    retried = extracted.run_shard(shard, **request.tags)
    assert all(e.passed for e in extracted.evaluations(retried).values())
    metadata = instance.get_latest_materialization_event(AssetKey("hidden_states")).asset_materialization.metadata
    assert metadata["samples_this_run"].value == record.samples  # exactly the set-aside chunk's samples
    assert sorted(i for r in read_index(folder)[-1:] for i in r.sample_ids) == sorted(record.sample_ids)
    assert {p.name: p.read_bytes() for p in folder.glob("chunk-*") if p.name in others} == others
    assert tick().skip_message == "no failed hidden_states shard"
    resources = {"settings": HsxSettings(path=str(extracted.settings_file))}
    assert materialize([drafter_dataset], resources=resources, instance=instance).success
    assert len(DrafterDataset(extracted.out / "drafter")) == 28


def test_the_shard_job_runs_every_shard_check(extracted):
    defs = extracted.defs
    job_graph = defs.resolve_job_def("hidden_states_shard").asset_layer.asset_graph
    assert {key.name for key in job_graph.asset_check_keys} == set(SHARD_CHECKS)  # every shard run checks its shard
