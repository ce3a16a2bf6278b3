"""Existing output under changed settings, and damaged output.

- A shard folder made with another model, layers or storage dtype is refused, with how to start over
  (`extraction.on_mismatch: start_over`), unless the user asks for it: then the old chunks are
  deleted (logged with their sample count) and the shard is redone. Also through Dagster run config.
- The shard count changed under an existing output: a shard the tokenized dataset lacks, shards
  made from an earlier tokenization (stale) and leftover shard folders are each named with what to do.
- A damaged chunk (truncated, missing, replaced, bad header) is named by the integrity check and by
  the reader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dagster import AssetKey, instance_for_test, materialize

from hsx_dagster import DrafterDataset
from hsx_dagster.core.dataset import AssemblyError, DatasetError, assemble, check_coverage, check_integrity
from hsx_dagster.core.extraction import ShardJob, run_shard
from hsx_dagster.core.inputs import TokenizedDataError, TokenizedSummary
from hsx_dagster.core.storage import SHARD_INDEX_FILE, StoreError, read_index
from hsx_dagster_tests.support.helpers import shard_job, tokenize, write_settings

LAYERS = (1, 3)


def job(root: Path, shard: str, model: Path, **overrides) -> ShardJob:
    settings = dict(
        shard=shard,
        shard_index=int(shard[-2:]),
        tokenized_dir=root / "tokenized",
        output_dir=root / "hidden_states" / shard,
        model_path=model,
        layer_ids=LAYERS,
        devices=("cpu",),
        storage_dtype="bfloat16",
        batch_size=8,
        max_batch_tokens=4096,
        chunk_bytes=40_000,
    )
    settings.update(overrides)
    return shard_job(**settings)


def tokenize_into(root: Path, inputs: Path, model: Path, shards: int) -> TokenizedSummary:
    return tokenize([inputs], model, root / "tokenized", shards=shards, max_length=64)


@pytest.fixture(scope="module")
def few_inputs(small_inputs, tmp_path_factory) -> Path:
    """The 8 shortest of the small inputs: enough for 3 shards, quick to extract."""
    path = tmp_path_factory.mktemp("few") / "few.jsonl"
    path.write_text("".join(line + "\n" for line in small_inputs.read_text().splitlines()[:8]))
    return path


def shard_keys(count: int) -> list[str]:
    return [f"shard-{k:02d}" for k in range(count)]


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_changed_model_or_storage_dtype_is_refused_and_start_over_redoes_the_shard(
    few_inputs, demo_model_dir, tmp_path
):
    root = tmp_path
    tokenize_into(root, few_inputs, demo_model_dir, shards=1)
    first = run_shard(job(root, "shard-00", demo_model_dir))
    folder = root / "hidden_states" / "shard-00"
    before = files_of(folder)

    other_model = tmp_path / "other-model"  # the same weights under another config: another model
    other_model.mkdir()
    for source in demo_model_dir.iterdir():
        (other_model / source.name).symlink_to(source)
    config = json.loads((demo_model_dir / "config.json").read_text())
    (other_model / "config.json").unlink()
    (other_model / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))

    refusals = [
        (dict(storage_dtype="float32"), r"storage_dtype: 'bfloat16' -> 'float32' \(extraction.storage_dtype\)"),
        (dict(model_path=other_model), r"config_sha256: .* \(the model's config.json changed\)"),
        (dict(layer_ids=(1, 2)), r"layer_ids: \[1, 3\] -> \[1, 2\] \(model.layers\)"),
    ]
    for change, what in refusals:
        with pytest.raises(StoreError, match=what) as refused:
            run_shard(job(root, "shard-00", demo_model_dir, **change))
        message = str(refused.value)
        assert str(folder) in message and "Refusing to mix them" in message
        assert "set extraction.on_mismatch: start_over" in message and "resources.gpu.config.on_mismatch" in message
        assert files_of(folder) == before  # nothing was touched

    (folder / "notes.txt").write_text("the user's own file")  # start_over deletes only what the shard wrote
    logged: list[str] = []
    redone = run_shard(
        job(root, "shard-00", demo_model_dir, storage_dtype="float32", on_mismatch="start_over"), log_line=logged.append
    )
    chunks = len(first.totals.chunks)
    assert any(
        f"deleted {chunks} chunks holding {first.totals.samples} samples" in line and "storage_dtype" in line
        for line in logged
    ), logged
    assert redone.report.samples_skipped == 0 and redone.totals.samples == first.totals.samples
    assert json.loads((folder / "shard.json").read_text())["storage_dtype"] == "float32"
    assert (folder / "notes.txt").read_text() == "the user's own file"
    assert redone.totals.bytes > first.totals.bytes  # every chunk is float32 now: none of the old ones is left
    # start_over only acts on a mismatch: the same settings again resume (nothing to do).
    again = run_shard(job(root, "shard-00", demo_model_dir, storage_dtype="float32", on_mismatch="start_over"))
    assert again.report.samples == 0 and again.report.samples_skipped == first.totals.samples


def test_a_changed_description_is_recorded_not_refused(few_inputs, demo_model_dir, tmp_path):
    """shard.json's descriptive keys (the model's description, the preset name) do not define the states: a
    shard written before they existed, or the same ids named by preset instead of as a list, resumes."""
    tokenize_into(tmp_path, few_inputs, demo_model_dir, shards=1)
    folder = tmp_path / "hidden_states" / "shard-00"
    first = run_shard(job(tmp_path, "shard-00", demo_model_dir))
    provenance = json.loads((folder / "shard.json").read_text())
    older = {key: value for key, value in provenance.items() if key not in ("model", "layer_preset")}
    (folder / "shard.json").write_text(json.dumps(older))
    before = files_of(folder)

    again = run_shard(job(tmp_path, "shard-00", demo_model_dir, layer_preset="eagle3"))
    assert again.report.samples == 0 and again.report.samples_skipped == first.totals.samples
    recorded = json.loads((folder / "shard.json").read_text())
    assert recorded["layer_preset"] == "eagle3" and recorded["model"] == provenance["model"]
    assert {name: stamp for name, stamp in files_of(folder).items() if name.startswith("chunk-")} == {
        name: stamp for name, stamp in before.items() if name.startswith("chunk-")
    }


def test_masks_changed_under_the_same_ids_are_refused(few_inputs, demo_model_dir, tmp_path):
    """Chunks store the loss mask beside the states: a re-tokenization that changes only masks (another
    thinking policy, another template) must not leave old masks passing as current."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hsx_dagster.core.dataset import shard_status
    from hsx_dagster.core.storage import tokenized_shard_file

    tokenize_into(tmp_path, few_inputs, demo_model_dir, shards=1)
    run_shard(job(tmp_path, "shard-00", demo_model_dir))
    assert shard_status(tmp_path / "hidden_states", ["shard-00"], tmp_path / "tokenized") == {"shard-00": "complete"}
    file = tokenized_shard_file(tmp_path / "tokenized", "shard-00")
    table = pq.read_table(file)
    masks = table.column("loss_mask").to_pylist()
    masks[0] = [0] * len(masks[0])  # same ids, nothing supervised in the first sample any more
    position = table.schema.get_field_index("loss_mask")
    pq.write_table(table.set_column(position, "loss_mask", pa.array(masks, pa.list_(pa.uint8()))), file)

    assert shard_status(tmp_path / "hidden_states", ["shard-00"], tmp_path / "tokenized") == {"shard-00": "stale"}
    with pytest.raises(StoreError, match=r"tokenized_sha256: .*re-tokenized"):
        run_shard(job(tmp_path, "shard-00", demo_model_dir))


def test_the_shard_table_reads_summaries_not_tokenized_ids(few_inputs, demo_model_dir, tmp_path, monkeypatch):
    """Each shard's state comes from summary.json's digest of its tokenized file (taken when it was written, with
    the file's size, mtime and inode) and each complete shard's complete.json: the table reads no tokenized id,
    however many samples the shards hold. A summary without digests (tokenized before) is still read right."""
    import pyarrow.parquet as pq

    from hsx_dagster.core.dataset import shard_rows
    from hsx_dagster.core.inputs import read_tokenized_shard, tokenized_digest
    from hsx_dagster.core.storage import TOKENIZED_SUMMARY_FILE

    summary = tokenize_into(tmp_path, few_inputs, demo_model_dir, shards=2)
    for load in summary.shards:  # the digest a shard run records, of the file as written
        assert load.sha256 == tokenized_digest(read_tokenized_shard(tmp_path / "tokenized", load.shard))
    run_shard(job(tmp_path, "shard-00", demo_model_dir))
    sizes = [load.samples for load in summary.shards]

    def no_reads(*args, **kwargs):
        raise AssertionError("the shard table read a tokenized shard file")

    def table() -> list[tuple]:
        rows = shard_rows(tmp_path / "hidden_states", ["shard-00", "shard-01"], tmp_path / "tokenized")
        return [(row.shard, row.state, row.samples, row.samples_total, row.tokens > 0) for row in rows]

    with monkeypatch.context() as patched:
        patched.setattr(pq, "read_table", no_reads)
        patched.setattr(pq, "ParquetFile", no_reads)
        assert table() == [
            ("shard-00", "complete", sizes[0], sizes[0], True),
            ("shard-01", "not started", 0, sizes[1], False),
        ]

    summary_file = tmp_path / "tokenized" / TOKENIZED_SUMMARY_FILE
    data = json.loads(summary_file.read_text())
    for entry in data["shards"]:
        del entry["sha256"], entry["file"]
    summary_file.write_text(json.dumps(data))  # as tokenized before summaries recorded digests: read instead
    assert table() == [
        ("shard-00", "complete", sizes[0], sizes[0], True),
        ("shard-01", "not started", 0, sizes[1], False),
    ]


def test_shard_count_changed_under_existing_output(few_inputs, demo_model_dir, tmp_path):
    root = tmp_path
    tokenize_into(root, few_inputs, demo_model_dir, shards=2)
    for shard in shard_keys(2):
        run_shard(job(root, shard, demo_model_dir))
    assemble(root / "tokenized", root / "hidden_states", shard_keys(2), root / "drafter", val_fraction=0.1, settings={})

    # `shards: 3` in the settings, tokenized_dataset not materialized again.
    with pytest.raises(AssemblyError, match=r"tokenized dataset in .* has 2 shards, the settings 3 \(key `shards`\)"):
        assemble(
            root / "tokenized", root / "hidden_states", shard_keys(3), root / "drafter", val_fraction=0.1, settings={}
        )
    with pytest.raises(
        TokenizedDataError,
        match=r"shard-02.parquet not found: the tokenized dataset was made with 2 shards \(shard-00 .. "
        r"shard-01\).*materialize tokenized_dataset again",
    ):
        run_shard(job(root, "shard-02", demo_model_dir))
    assert not (root / "hidden_states" / "shard-02").exists()  # refused before anything was written

    # Now re-tokenized into 3 shards: every sample keeps its shard (stable membership), the new shard is empty
    # until new samples come, and no committed sample is extracted again.
    before = {p.name: p.read_bytes() for p in (root / "hidden_states").glob("shard-0[01]/chunk-*")}
    summary = tokenize_into(root, few_inputs, demo_model_dir, shards=3)
    assert [(s.shard, s.added, s.removed) for s in summary.shards][2] == ("shard-02", 0, 0)
    with pytest.raises(AssemblyError, match=r"shards not ready: shard-02 \(missing\)"):  # 00 and 01 hold the same
        assemble(
            root / "tokenized", root / "hidden_states", shard_keys(3), root / "drafter", val_fraction=0.1, settings={}
        )
    reruns = [run_shard(job(root, shard, demo_model_dir)) for shard in shard_keys(3)]
    assert [result.report.samples for result in reruns] == [0, 0, 0]
    assert {p.name: p.read_bytes() for p in (root / "hidden_states").glob("shard-0[01]/chunk-*")} == before
    (root / "hidden_states" / "shard-07").mkdir()  # a leftover of some earlier, larger shard count
    summary = assemble(
        root / "tokenized", root / "hidden_states", shard_keys(3), root / "drafter", val_fraction=0.1, settings={}
    )
    assert summary.ignored_folders == ["shard-07"]
    coverage = check_coverage(root / "drafter", root / "tokenized")
    assert coverage.passed, coverage.description  # every sample of the new tokenization, exactly once


@pytest.mark.slow  # four Dagster runs (the quick loop tests on_mismatch on the core)
def test_on_mismatch_from_dagster_run_config(few_inputs, demo_model_dir, tmp_path):
    from hsx_dagster.core.settings import load_settings
    from hsx_dagster.defs.assets.hidden_states import build_hidden_states
    from hsx_dagster.defs.assets.tokenized import tokenized_dataset
    from hsx_dagster.defs.partitions import shard_partitions
    from hsx_dagster.defs.resources import GpuResource, HsxSettings

    settings_file = write_settings(
        tmp_path / "hsx.yaml",
        dataset={"paths": [few_inputs], "max_length": 64},
        model={"path": demo_model_dir, "layers": [1, 3]},
        shards=2,
        output_dir="out",
        extraction={"devices": ["cpu"], "chunk_mb": 0.05},
    )
    settings = load_settings(settings_file)
    hidden_states = build_hidden_states(shard_partitions(settings))
    resources = {"settings": HsxSettings(path=str(settings_file)), "gpu": GpuResource.from_settings(settings)}

    def extract(gpu_config: dict):
        return materialize(
            [hidden_states],
            resources=resources,
            partition_key="shard-01",
            instance=instance,
            raise_on_error=False,
            run_config={"resources": {"gpu": {"config": gpu_config}}} if gpu_config else None,
        )

    with instance_for_test() as instance:
        assert materialize(
            [tokenized_dataset, hidden_states], resources=resources, partition_key="shard-01", instance=instance
        ).success
        refused = extract({"storage_dtype": "float32"})
        assert not refused.success
        error = refused.get_step_failure_events()[0].event_specific_data.error.to_string()
        assert "Refusing to mix them" in error and "extraction.on_mismatch: start_over" in error
        redone = extract({"storage_dtype": "float32", "on_mismatch": "start_over"})
        assert redone.success
        metadata = instance.get_latest_materialization_event(AssetKey("hidden_states")).asset_materialization.metadata
        assert metadata["dtypes"].value.endswith("float32 storage") and "resumed" not in metadata["this run"].value
        logs = [event.message for event in instance.all_logs(redone.run_id)]
        assert any("extraction.on_mismatch is start_over: deleted" in message for message in logs)


@pytest.fixture(scope="module")
def assembled(small_inputs, demo_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("assembled")
    tokenize_into(root, small_inputs, demo_model_dir, shards=1)
    run_shard(job(root, "shard-00", demo_model_dir))
    assemble(root / "tokenized", root / "hidden_states", ["shard-00"], root / "drafter", val_fraction=0.1, settings={})
    assert len(read_index(root / "hidden_states" / "shard-00")) >= 3
    return root


def _truncate_data(path: Path, chunks: list[Path]) -> None:
    path.write_bytes(path.read_bytes()[:-100])  # the header is intact, the last tensor is cut short


def _remove(path: Path, chunks: list[Path]) -> None:
    path.unlink()


def _replace_with_another_chunk(path: Path, chunks: list[Path]) -> None:
    path.write_bytes(chunks[1].read_bytes())  # a whole, valid chunk, but not this one


def _garble_header(path: Path, chunks: list[Path]) -> None:
    data = bytearray(path.read_bytes())
    data[8:16] = b"\x00garble\x00"
    path.write_bytes(bytes(data))


DAMAGE = [
    (_truncate_data, "checksum differs", "not a readable safetensors chunk"),
    (_remove, "missing", "chunk file is missing"),
    (_replace_with_another_chunk, "checksum differs", "does not hold sample"),
    (_garble_header, "checksum differs", "not a readable safetensors chunk"),
]


@pytest.mark.parametrize("damage, check_says, reader_says", DAMAGE, ids=[d[0].__name__.strip("_") for d in DAMAGE])
def test_damaged_chunk_is_named_by_the_integrity_check_and_the_reader(
    damage, check_says, reader_says, assembled, tmp_path
):
    root = tmp_path / "copy"
    shutil.copytree(assembled, root)
    folder = root / "hidden_states" / "shard-00"
    chunks = [folder / record.chunk for record in read_index(folder)]
    damaged = chunks[0]
    damage(damaged, chunks)

    outcome = check_integrity(root / "drafter")
    assert not outcome.passed and f"{damaged}: {check_says}" in outcome.description, outcome.description

    dataset = DrafterDataset(root / "drafter")
    first_record_ids = set(read_index(folder)[0].sample_ids)
    index = next(i for i, sample_id in enumerate(dataset.sample_ids) if sample_id in first_record_ids)
    with pytest.raises(DatasetError, match=reader_says) as failure:
        dataset[index]
    assert str(damaged) in str(failure.value)
    # Samples of undamaged chunks still read.
    healthy = next(i for i, sample_id in enumerate(dataset.sample_ids) if sample_id not in first_record_ids)
    assert dataset[healthy]["hidden_states"].shape[1] == len(LAYERS)


def test_index_line_garbled_is_named_with_its_line(assembled, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(assembled, root)
    index = root / "hidden_states" / "shard-00" / SHARD_INDEX_FILE
    lines = index.read_text().splitlines(keepends=True)
    index.write_text(lines[0] + "{not json\n" + "".join(lines[2:]))
    with pytest.raises(StoreError, match=f"{index}: line 2 is not JSON"):
        read_index(index.parent)


def test_reader_refuses_chunk_paths_that_leave_the_dataset(assembled, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "copy"
    shutil.copytree(assembled, root)
    index_file = root / "drafter" / "index.parquet"
    table = pq.read_table(index_file)
    chunks = table.column("chunk").to_pylist()
    chunks[0] = "../../../../etc/passwd"
    pq.write_table(table.set_column(table.schema.get_field_index("chunk"), "chunk", pa.array(chunks)), index_file)
    with pytest.raises(DatasetError, match=f"{index_file}: chunk path '../../../../etc/passwd' leaves the dataset"):
        DrafterDataset(root / "drafter")[0]
