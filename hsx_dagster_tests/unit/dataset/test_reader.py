"""The assembled dataset read back through `DrafterDataset` against a reference forward pass, and
each data-quality check shown to pass on a good dataset and fail on a deliberately broken one."""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hsx_dagster import DrafterDataset, collate_drafter_batch
from hsx_dagster.core.dataset import (
    DatasetError,
    assemble,
    check_coverage,
    check_integrity,
    check_numerics,
    check_parity,
    split_of,
)
from hsx_dagster.core.storage import SHARD_INDEX_FILE as SHARD_INDEX
from hsx_dagster_tests.support.helpers import build_drafter_dataset
from hsx_dagster_tests.support.sweeps import sweep

LAYERS = (1, 4, 7)  # 7 is the demo model's last layer: its raw output, not Hugging Face's normed one
SHARDS = ("shard-00", "shard-01")


@pytest.fixture(scope="module")
def dataset_root(small_inputs, demo_model_dir, tmp_path_factory) -> Path:
    return build_drafter_dataset(
        [small_inputs],
        demo_model_dir,
        tmp_path_factory.mktemp("pipeline"),
        layer_ids=LAYERS,
        shards=SHARDS,
        include_final=True,
        devices=("cpu",),
        storage_dtype="float32",
        batch_size=6,
    )


@pytest.fixture
def broken_copy(dataset_root, tmp_path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(dataset_root, copy)
    return copy


def reference(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    captured = {}
    model.model.layers[7].register_forward_hook(
        lambda m, i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o)
    )

    def states(input_ids):
        with torch.inference_mode():
            out = model(input_ids=input_ids.unsqueeze(0), output_hidden_states=True)
        layers = [out.hidden_states[i + 1][0] for i in LAYERS[:-1]] + [captured["last"][0]]
        return torch.stack(layers, dim=1), out.hidden_states[-1][0]

    return states


def test_every_sample_reads_back_equal_to_the_reference(dataset_root, demo_model_dir, small_inputs):
    ds = DrafterDataset(dataset_root / "drafter")
    assert len(ds) == 28 == ds.manifest["totals"]["samples"]
    assert ds.manifest["layers"] == {
        "ids": list(LAYERS),
        "convention": ds.manifest["layers"]["convention"],
        "include_final": True,
        "preset": None,  # an explicit list of ids
        "num_hidden_layers": 8,
    }
    assert (ds.num_hidden_layers, ds.hidden_size, ds.architecture) == (8, 64, "Qwen3_5ForCausalLM")
    assert "hidden_states[i + 1]" in ds.manifest["layers"]["convention"]
    states = reference(demo_model_dir)
    ids = []
    for i in range(len(ds)):
        sample = ds[i]
        ids.append(sample["sample_id"])
        assert sample["input_ids"].dtype == torch.int64 and set(sample["loss_mask"].tolist()) <= {0, 1}
        expected_layers, expected_final = states(sample["input_ids"])
        assert sample["hidden_states"].shape == (len(sample["input_ids"]), 3, 64)
        torch.testing.assert_close(sample["hidden_states"], expected_layers, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sample["final_hidden_states"], expected_final, rtol=1e-4, atol=1e-4)
    assert ids == sorted(ids)


def test_splits_are_a_function_of_the_sample_id(dataset_root):
    train = DrafterDataset(dataset_root / "drafter", split="train")
    val = DrafterDataset(dataset_root / "drafter", split="val")
    assert len(train) + len(val) == 28 and len(val) > 0
    assert not set(train.sample_ids) & set(val.sample_ids)
    assert all(split_of(s, 0.25) == "val" for s in val.sample_ids)
    with pytest.raises(ValueError, match="split must be"):
        DrafterDataset(dataset_root / "drafter", split="test")


def test_the_index_equals_the_one_built_sample_by_sample(dataset_root):
    """The index assembled from numpy columns (flat memory) holds exactly the rows the per-sample Python loop it
    replaced made: every committed sample of every chunk, at its position, with its token counts and split."""
    from hsx_dagster.core.inputs import read_tokenized_shard
    from hsx_dagster.core.storage import DRAFTER_INDEX_SCHEMA, read_index

    manifest = json.loads((dataset_root / "drafter" / "manifest.json").read_text())
    rows: dict[str, list] = {name: [] for name in DRAFTER_INDEX_SCHEMA.names}
    for shard in SHARDS:
        folder = dataset_root / "hidden_states" / shard
        table = read_tokenized_shard(dataset_root / "tokenized", shard, ["sample_id", "num_loss_tokens"])
        loss = dict(zip(table.column("sample_id").to_pylist(), table.column("num_loss_tokens").to_pylist()))
        for record in read_index(folder):
            with safe_open(str(folder / record.chunk), framework="pt") as chunk:
                offsets = chunk.get_tensor("offsets").tolist()
            for position, sample_id in enumerate(record.sample_ids):
                values = (shard, f"hidden_states/{shard}/{record.chunk}", position)
                values += (offsets[position + 1] - offsets[position], loss[sample_id], split_of(sample_id, 0.25))
                rows["sample_id"].append(sample_id)
                for name, value in zip(DRAFTER_INDEX_SCHEMA.names[1:], values):
                    rows[name].append(value)
    expected = pa.table(rows, schema=DRAFTER_INDEX_SCHEMA).sort_by("sample_id")
    assert manifest["splits"]["val_fraction"] == 0.25 and expected.num_rows == manifest["totals"]["samples"]
    assert manifest["splits"]["val"] == sum(split == "val" for split in rows["split"])
    assert pq.read_table(dataset_root / "drafter" / "index.parquet").equals(expected)


def test_dataloader_with_workers_and_collate(dataset_root):
    ds = DrafterDataset(dataset_root / "drafter")
    loader = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2, collate_fn=collate_drafter_batch)
    seen = []
    for batch in loader:
        lengths = batch["attention_mask"].sum(dim=1)
        assert batch["hidden_states"].shape[:2] == batch["input_ids"].shape
        assert batch["final_hidden_states"].shape[:2] == batch["input_ids"].shape
        for row, sample_id in enumerate(batch["sample_id"].tolist()):
            direct = ds[ds.sample_ids.index(sample_id)]
            n = int(lengths[row])
            assert n == len(direct["input_ids"])
            assert torch.equal(batch["hidden_states"][row, :n], direct["hidden_states"])
            assert torch.all(batch["hidden_states"][row, n:] == 0) and torch.all(batch["loss_mask"][row, n:] == 0)
            seen.append(sample_id)
    assert sorted(seen) == sorted(ds.sample_ids)


def test_all_checks_pass_on_a_good_dataset(dataset_root):
    drafter = dataset_root / "drafter"
    for outcome in (
        check_coverage(drafter, dataset_root / "tokenized"),
        check_integrity(drafter),
        check_numerics(drafter),
        check_parity(drafter, dataset_root / "tokenized", samples=6),
    ):
        assert outcome.passed, outcome.description
    numerics = check_numerics(drafter)
    assert [row["layer"] for row in numerics.metadata["per_layer"]] == ["layer 1", "layer 4", "layer 7", "final"]


@pytest.mark.parametrize("held_in_a_cycle", sweep([False, True], quick=[False]))  # True: a full collection
def test_the_parity_reference_is_freed_before_the_check_returns(dataset_root, monkeypatch, held_in_a_cycle):
    """The reference model is released on return; a full garbage collection (about a second in a large
    process) runs only when a reference cycle still holds it."""
    import gc
    import weakref

    from hsx_dagster.core.extraction import backbone

    loaded_models = []
    real_load = backbone.load_text_decoder

    def load_and_watch(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        if held_in_a_cycle:
            loaded.model.__dict__["cycle"] = loaded.model  # what the first import of a model class leaves
        loaded_models.append(weakref.ref(loaded.model))
        return loaded

    collections = []
    real_collect = gc.collect
    monkeypatch.setattr(backbone, "load_text_decoder", load_and_watch)
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or real_collect(*args))
    outcome = check_parity(dataset_root / "drafter", dataset_root / "tokenized", samples=1)
    assert outcome.passed, outcome.description
    assert len(loaded_models) == 1 and loaded_models[0]() is None
    assert len(collections) == (1 if held_in_a_cycle else 0)


def rewrite_chunk(root: Path, shard: str, chunk: str, change) -> None:
    """Apply `change` to a chunk's tensors, save it, and record the new checksum as if written so."""
    import hashlib

    path = root / "hidden_states" / shard / chunk
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        metadata = handle.metadata()
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)
    index = root / "hidden_states" / shard / SHARD_INDEX
    records = [json.loads(line) for line in index.read_text().splitlines()]
    for record in records:
        if record["chunk"] == chunk:
            record["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
            record["sample_ids"] = tensors["sample_ids"].tolist()
    index.write_text("".join(json.dumps(r) + "\n" for r in records))


def first_chunk(root: Path) -> str:
    return json.loads((root / "hidden_states" / "shard-00" / SHARD_INDEX).read_text().splitlines()[0])["chunk"]


def test_dropped_sample_fails_coverage(broken_copy):
    index = pq.read_table(broken_copy / "drafter" / "index.parquet")
    dropped = index.column("sample_id")[3].as_py()
    pq.write_table(pa.concat_tables([index.slice(0, 3), index.slice(4)]), broken_copy / "drafter" / "index.parquet")
    outcome = check_coverage(broken_copy / "drafter", broken_copy / "tokenized")
    assert not outcome.passed and f"1 tokenized samples are missing (e.g. [{dropped}])" in outcome.description


def test_duplicated_sample_fails_coverage(broken_copy):
    index = pq.read_table(broken_copy / "drafter" / "index.parquet")
    pq.write_table(pa.concat_tables([index, index.slice(5, 1)]), broken_copy / "drafter" / "index.parquet")
    outcome = check_coverage(broken_copy / "drafter", broken_copy / "tokenized")
    assert not outcome.passed and "appear more than once" in outcome.description


def test_coverage_reads_no_chunk_the_shard_checks_verified_and_still_places_every_sample(broken_copy):
    """#33: after the shard checks verified every chunk (and found its ids and masks equal to the tokenized shard),
    the dataset's coverage reads none of them: each chunk's index record says what it holds. Rows of the index
    swapped between two places of a chunk are still caught."""
    import os
    import time

    from hsx_dagster.core.dataset import check_shard

    stamp = time.time_ns() - 60 * 10**9  # chunks written a while before their checks
    for shard in SHARDS:
        folder = broken_copy / "hidden_states" / shard
        for chunk in folder.glob("chunk-*"):
            os.utime(chunk, ns=(stamp, stamp))
        assert all(o.passed for o in check_shard(folder, broken_copy / "tokenized", shard).values())
    outcome = check_coverage(broken_copy / "drafter", broken_copy / "tokenized")
    assert outcome.passed and outcome.metadata["chunks_compared"] == 0, outcome.description

    index_file = broken_copy / "drafter" / "index.parquet"
    index = pq.read_table(index_file)
    chunks, positions = index.column("chunk").to_pylist(), index.column("position").to_pylist()
    first, second = [row for row, chunk in enumerate(chunks) if chunk == chunks[0]][:2]
    positions[first], positions[second] = positions[second], positions[first]
    pq.write_table(index.set_column(3, "position", pa.array(positions, pa.int32())), index_file)
    outcome = check_coverage(broken_copy / "drafter", broken_copy / "tokenized")
    assert not outcome.passed and "2 samples differ from the tokenized dataset or sit at the wrong place" in (
        outcome.description
    )
    assert outcome.metadata["chunks_compared"] == 0


def test_flipped_byte_fails_integrity_naming_the_chunk(broken_copy):
    chunk = broken_copy / "hidden_states" / "shard-00" / first_chunk(broken_copy)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the states: only a checksum can notice
    chunk.write_bytes(bytes(data))
    outcome = check_integrity(broken_copy / "drafter")
    assert not outcome.passed and f"{chunk}: checksum differs" in outcome.description
    assert check_coverage(
        broken_copy / "drafter", broken_copy / "tokenized"
    ).passed  # ids untouched: only integrity sees it


def test_garbled_index_line_fails_integrity_naming_the_line(broken_copy):
    index = broken_copy / "hidden_states" / "shard-01" / SHARD_INDEX
    index.write_text("{not json\n" + index.read_text())
    outcome = check_integrity(broken_copy / "drafter")
    assert not outcome.passed and f"{index}: line 1 is not JSON" in outcome.description


def test_nan_fails_numerics_naming_the_sample(broken_copy):
    name = first_chunk(broken_copy)

    def poison(tensors):
        start = int(tensors["offsets"][1])
        tensors["hidden_states"][start + 2, 1, 5] = float("nan")

    rewrite_chunk(broken_copy, "shard-00", name, poison)
    with safe_open(str(broken_copy / "hidden_states" / "shard-00" / name), framework="pt") as handle:
        poisoned_id = handle.get_tensor("sample_ids")[1].item()
    assert check_integrity(broken_copy / "drafter").passed  # a well-formed file with a bad value
    outcome = check_numerics(broken_copy / "drafter")
    assert not outcome.passed and f"NaN or Inf in 1 samples: [{poisoned_id}]" in outcome.description


def test_swapped_pair_fails_coverage_and_parity(broken_copy):
    name = first_chunk(broken_copy)

    def swap_labels(tensors):
        ids = tensors["sample_ids"]
        ids[[0, 1]] = ids[[1, 0]]

    rewrite_chunk(broken_copy, "shard-00", name, swap_labels)
    assemble(
        broken_copy / "tokenized",
        broken_copy / "hidden_states",
        SHARDS,
        broken_copy / "drafter",
        val_fraction=0.25,
        settings={},
    )
    assert check_integrity(broken_copy / "drafter").passed
    coverage = check_coverage(broken_copy / "drafter", broken_copy / "tokenized")
    assert not coverage.passed and "2 samples differ from the tokenized dataset" in coverage.description
    parity = check_parity(broken_copy / "drafter", broken_copy / "tokenized", samples=28)
    assert not parity.passed and "2 of 28 re-extracted samples differ" in parity.description


def test_truncated_chunk_is_named_by_the_reader(broken_copy):
    chunk = broken_copy / "hidden_states" / "shard-00" / first_chunk(broken_copy)
    chunk.write_bytes(chunk.read_bytes()[:50])
    ds = DrafterDataset(broken_copy / "drafter")
    position = next(i for i in range(len(ds)) if ds.locate(i)[0].endswith(f"shard-00/{chunk.name}"))
    with pytest.raises(DatasetError, match=f"{chunk}: not a readable safetensors chunk"):
        ds[position]
    assert not check_integrity(broken_copy / "drafter").passed
