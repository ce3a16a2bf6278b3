"""The trainer exports from the pipeline's side (no trainer installed): what speculators' and SpecForge's folders
hold, row for row against `DrafterDataset`; bad input refused before anything is written; an interrupted export
never complete-looking and finished by a re-run; the Dagster assets and their metadata. What the trainers' own code
reads from these folders: hsx_dagster_tests/end_to_end/trainers/."""

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from dagster import AssetKey, instance_for_test, materialize
from safetensors.torch import load_file

from hsx_dagster import DrafterDataset
from hsx_dagster.core.export import (
    ARROW_FILE,
    ExportError,
    export_specforge,
    export_speculators,
    file_pool,
    row_groups,
    sample_file,
    specforge as specforge_module,
    specforge_mapping,
    speculators as speculators_module,
    speculators_mapping,
)
from hsx_dagster.core.inputs import read_tokenized_shard
from hsx_dagster.core.model import resolve_layers
from hsx_dagster.defs.assets.exports import specforge_dataset, speculators_dataset
from hsx_dagster.defs.resources import HsxSettings
from hsx_dagster_tests.support.helpers import build_drafter_dataset, write_settings

LAYERS = [1, 3, 4, 7]  # the `speculators` preset for the demo model (8 layers)


@pytest.fixture(scope="module")
def out(small_inputs, demo_model_dir, tmp_path_factory) -> Path:
    return build_drafter_dataset(
        [small_inputs], demo_model_dir, tmp_path_factory.mktemp("export"), layer_ids=LAYERS, include_final=True
    )


def arrow_rows(folder: Path) -> pa.Table:
    with pa.memory_map(str(folder / ARROW_FILE)) as source:
        return pa.ipc.open_stream(source).read_all()


def test_the_speculators_preset_is_what_speculators_captures():
    # speculators' default target layers [2, N//2, N-3] are inputs of those decoder layers (vLLM's numbering),
    # i.e. our ids one lower, plus the last decoder layer's raw output for its last slot
    for n in (8, 32, 36, 64):
        assert resolve_layers("speculators", n) == sorted({2 - 1, n // 2 - 1, n - 3 - 1, n - 1})
    mapping = speculators_mapping(LAYERS, 8)
    assert mapping.trainer_aux_ids == (2, 4, 5) and mapping.aux_positions == (0, 1, 2) and mapping.last_position == 3


def test_speculators_folder_row_for_row(out, tmp_path):
    dest = tmp_path / "speculators"
    result = export_speculators(out / "drafter", out / "tokenized", dest, files=True)
    dataset = DrafterDataset(out / "drafter")
    train = sorted(DrafterDataset(out / "drafter", split="train").sample_ids)
    val = sorted(DrafterDataset(out / "drafter", split="val").sample_ids)
    rows = arrow_rows(dest)
    assert rows.column("sample_id").to_pylist() == train + val and result.train_rows == len(train)
    assert json.loads((dest / "state.json").read_text())["_format_type"] == "torch"
    index_of = {sid: i for i, sid in enumerate(dataset.sample_ids)}
    expected_freq: Counter[int] = Counter()
    for row, sid in enumerate(train + val):
        sample = dataset[index_of[sid]]
        assert rows.column("input_ids")[row].as_py() == sample["input_ids"].tolist()
        assert rows.column("loss_mask")[row].as_py() == sample["loss_mask"].tolist()
        assert rows.column("seq_len")[row].as_py() == len(sample["input_ids"])
        expected_freq.update(sample["input_ids"][sample["loss_mask"].bool()].tolist())
        stored = load_file(dest / "hidden_states" / f"hs_{row}.safetensors")
        assert torch.equal(stored["token_ids"], sample["input_ids"])
        assert torch.equal(stored["hidden_states"], sample["hidden_states"])  # aux 1, 3, 4 then the raw layer 7
    assert torch.load(dest / "token_freq.pt", weights_only=True) == dict(expected_freq)
    export = json.loads((dest / "hsx_export.json").read_text())
    assert export["mapping"]["trainer_aux_ids"] == [2, 4, 5] and "--hidden-states-backend file" in export["command"]
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_specforge_files_have_the_layout_its_reader_takes(out, tmp_path):
    dataset = DrafterDataset(out / "drafter")
    for layout in ("eagle3", "dflash"):
        result = export_specforge(out / "drafter", tmp_path / layout, layout=layout)
        order = json.loads((tmp_path / layout / "hsx_export.json").read_text())["sample_ids"]
        files = sorted((tmp_path / layout).rglob("*.ckpt"))
        assert len(files) == result.rows == len(dataset) and files[0].relative_to(tmp_path / layout) == Path(
            sample_file(0)
        )
        index_of = {sid: i for i, sid in enumerate(dataset.sample_ids)}
        for row in (0, len(files) - 1):
            data = torch.load(files[row], weights_only=True)  # tensors only
            # the file holds its own tensors' bytes, not the storage of the chunk they were read from
            payload = sum(t.numel() * t.element_size() for t in data.values())
            assert files[row].stat().st_size < payload + 4096, (files[row].stat().st_size, payload)
            sample = dataset[index_of[order[row]]]
            assert data["input_ids"].dtype == torch.int64 and torch.equal(data["input_ids"], sample["input_ids"])
            assert torch.equal(data["loss_mask"], sample["loss_mask"].to(torch.int64))
            if layout == "eagle3":
                assert set(data) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
                assert torch.equal(data["hidden_state"][0], sample["final_hidden_states"])  # after the final norm
                assert torch.equal(data["aux_hidden_state"][0], sample["hidden_states"][:, :3].flatten(1))
            else:
                assert set(data) == {"input_ids", "loss_mask", "hidden_states"}
                assert torch.equal(data["hidden_states"][0], sample["hidden_states"].flatten(1))


def test_bad_input_fails_before_writing_naming_the_setting(tmp_path):
    with pytest.raises(ExportError, match=r"add 7 to model.layers.*model.layers: speculators"):
        speculators_mapping([1, 3, 4], 8)
    with pytest.raises(ExportError, match=r"asks for 4 auxiliary layers but the dataset stores 3"):
        speculators_mapping(LAYERS, 8, aux_layers=4)
    with pytest.raises(ExportError, match=r"model.include_final: true"):
        specforge_mapping(LAYERS, 8, False, "eagle3")
    with pytest.raises(ExportError, match=r"exactly three auxiliary layers"):
        specforge_mapping([1, 7], 8, True, "eagle3")


def test_interrupted_export_is_never_complete_and_a_rerun_finishes(out, tmp_path, monkeypatch):
    """Killed in its third batch of files: the two batches before are whole under their names, nothing else is;
    the re-run writes only the rest (a temporary a hard kill left is written again) and renames the folder."""
    dest = tmp_path / "specforge"
    monkeypatch.setattr(file_pool, "ROWS_PER_BATCH", 4)
    real = specforge_module.SpecForgeRows.write
    calls = []

    def killed_in_the_third_batch(self, sample, handle):
        calls.append(sample["sample_id"])
        if len(calls) > 10:
            raise KeyboardInterrupt("killed")
        real(self, sample, handle)

    monkeypatch.setattr(specforge_module.SpecForgeRows, "write", killed_in_the_third_batch)
    with pytest.raises(KeyboardInterrupt):
        export_specforge(out / "drafter", dest, pool="inline")
    assert not dest.exists()  # nothing a trainer would take as complete
    partial = tmp_path / ".specforge.partial"
    survivors = {p: p.stat().st_mtime_ns for p in partial.rglob("*.ckpt")}
    assert sorted(p.relative_to(partial) for p in survivors) == [Path(sample_file(row)) for row in range(8)]
    assert not [p for p in partial.rglob("*") if p.name.endswith(".tmp")]  # the unfinished batch left nothing
    torn = partial / Path(sample_file(9)).with_name(f".{Path(sample_file(9)).name}.tmp")
    torn.write_bytes(b"half a file")  # what a hard kill (no cleanup) leaves
    monkeypatch.setattr(specforge_module.SpecForgeRows, "write", real)
    written = []
    monkeypatch.setattr(file_pool, "_durable", lambda paths: written.extend(paths))
    result = export_specforge(out / "drafter", dest, pool="inline")
    assert not partial.exists() and len(list(dest.rglob("*.ckpt"))) == result.rows
    assert len(written) == result.rows - 8  # only the missing files, the torn one among them
    kept = {dest / p.relative_to(partial): t for p, t in survivors.items()}
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())  # finished, not redone
    assert not [p for p in dest.rglob("*") if p.name.endswith(".tmp")]
    data = torch.load(dest / sample_file(9), weights_only=True)
    order = json.loads((dest / "hsx_export.json").read_text())["sample_ids"]
    dataset = DrafterDataset(out / "drafter")
    assert torch.equal(data["input_ids"], dataset[dataset.sample_ids.index(order[9])]["input_ids"])


@pytest.mark.parametrize("pool", ["process", "thread"])
def test_a_pool_of_workers_writes_the_same_files(out, tmp_path, pool):
    inline = export_specforge(out / "drafter", tmp_path / "inline", pool="inline")
    pooled = export_specforge(out / "drafter", tmp_path / pool, pool=pool, workers=2)
    assert pooled.rows == inline.rows
    for row in range(inline.rows):
        ours = torch.load(tmp_path / pool / sample_file(row), weights_only=True)
        reference = torch.load(tmp_path / "inline" / sample_file(row), weights_only=True)
        assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)


def _speculators_rows_as_before(tokenized: Path, shards: list[str], order: list[int], batch_rows: int):
    """The Arrow stream and token_freq.pt as the export wrote them before it streamed (every id a Python object,
    the frequencies a Counter): the reference the streamed export must equal byte for byte."""
    by_id = {}
    for shard in shards:
        table = read_tokenized_shard(tokenized, shard, ["sample_id", "input_ids", "loss_mask"])
        for sid, ids, mask in zip(*(table.column(c).to_pylist() for c in ("sample_id", "input_ids", "loss_mask"))):
            by_id[sid] = (ids, mask)
    ids_col, mask_col = [by_id[s][0] for s in order], [by_id[s][1] for s in order]
    table = pa.table(
        {
            "input_ids": pa.array(ids_col, pa.list_(pa.int64())),
            "loss_mask": pa.array(mask_col, pa.list_(pa.int64())),
            "seq_len": pa.array([len(ids) for ids in ids_col], pa.int64()),
            "sample_id": pa.array(order, pa.int64()),
        }
    ).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": speculators_module.FEATURES}})})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    counts: Counter[int] = Counter()
    for ids, mask in zip(ids_col, mask_col):
        counts.update(token for token, keep in zip(ids, mask) if keep)
    buffer = io.BytesIO()
    torch.save(dict(counts), buffer)
    return sink.getvalue().to_pybytes(), buffer.getvalue()


@pytest.mark.parametrize("group", [None, 8])
def test_streamed_speculators_rows_equal_the_old_export(out, tmp_path, monkeypatch, group):
    """The same rows in the same record batches, schema and metadata as the export built from Python lists (byte for
    byte in one group), and token_freq.pt byte for byte (same counts, same key order as the Counter); ``group`` 8:
    groups of 8 rows and record batches of 4, so the 28 rows span four groups drawn from both shards."""
    batch_rows = 1000
    if group:
        batch_rows = 4
        monkeypatch.setattr(row_groups, "MIN_GROUP_ROWS", group)
        monkeypatch.setattr(row_groups, "ALIGN", batch_rows)
        monkeypatch.setattr(speculators_module, "ROWS_PER_RECORD_BATCH", batch_rows)
        assert row_groups.group_rows(28) == 8
    dest = tmp_path / "speculators"
    export_speculators(out / "drafter", out / "tokenized", dest)
    order, _ = speculators_module.row_order(out / "drafter")
    shards = DrafterDataset(out / "drafter").record.shard_keys
    arrow, freq = _speculators_rows_as_before(out / "tokenized", shards, order.tolist(), batch_rows)
    ours, before = pa.ipc.open_stream(pa.py_buffer((dest / ARROW_FILE).read_bytes())), pa.ipc.open_stream(arrow)
    assert ours.schema.equals(before.schema, check_metadata=True)
    ours_batches, old_batches = list(ours), list(before)
    assert [b.num_rows for b in ours_batches] == [b.num_rows for b in old_batches] and len(old_batches) > (
        group or 0
    ) // 4
    assert pa.Table.from_batches(ours_batches).equals(pa.Table.from_batches(old_batches))
    if group is None:
        assert (dest / ARROW_FILE).read_bytes() == arrow
    assert (dest / "token_freq.pt").read_bytes() == freq
    assert not (dest / ".row-groups").exists()


def test_a_sample_missing_from_the_tokenized_shards_is_named(out, tmp_path):
    order, _ = speculators_module.row_order(out / "drafter")
    shards = DrafterDataset(out / "drafter").record.shard_keys
    with pytest.raises(FileNotFoundError, match=r"samples \[12345\] of the drafter dataset are not tokenized"):
        list(row_groups.rows_in_order(out / "tokenized", shards, np.append(order, 12345), tmp_path / "scratch"))
    assert not (tmp_path / "scratch").exists()


def test_token_counts_are_a_counter_in_first_seen_order():
    rng = np.random.default_rng(0)
    counts, reference = row_groups.TokenCounts(), Counter()
    for size in (0, 5, 300, 2000):
        tokens = rng.integers(0, 50 + size, size)
        counts.add(tokens)
        reference.update(tokens.tolist())
    assert list(counts.as_dict().items()) == list(dict(reference).items())


def test_assets_materialize_with_mapping_and_command(out, tmp_path, demo_model_dir, small_inputs):
    settings = write_settings(
        tmp_path / "hsx.yaml",
        dataset={"paths": [small_inputs]},
        model={"path": demo_model_dir, "layers": "speculators", "include_final": True},
        shards=2,
        output_dir=out,
    )
    with instance_for_test() as instance:
        result = materialize(
            [speculators_dataset, specforge_dataset],
            resources={"settings": HsxSettings(path=str(settings))},
            instance=instance,
        )
        assert result.success
        meta = instance.get_latest_materialization_event(AssetKey("speculators_dataset")).asset_materialization
        assert meta.metadata["rows"].value == 28 and meta.metadata["hidden_states_backend"].value == "hsx"
        assert "| aux[0] | 2 | 1 |" in meta.metadata["layer_mapping"].value
        assert "--hidden-states-backend hsx" in meta.metadata["how_to_train"].value
        forge = instance.get_latest_materialization_event(AssetKey("specforge_dataset")).asset_materialization
        assert forge.metadata["rows"].value == 28 and forge.metadata["layout"].value == "eagle3"
    assert (out / "speculators" / "token_freq.pt").is_file() and not (out / "speculators" / "hidden_states").exists()
    assert len(list((out / "specforge").rglob("*.ckpt"))) == 28
