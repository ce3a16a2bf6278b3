"""Safety: nothing on the data path unpickles, the model's own code runs only when the settings allow
it, and the UI listens on the loopback interface only. (Keys that could lead a path out of
output_dir are refused in test_reliability_inputs.py.)"""

from __future__ import annotations

import pickle
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx_dagster import DrafterDataset, collate_drafter_batch
from hsx_dagster.core.dataset import assemble, check_coverage, check_integrity
from hsx_dagster.core.extraction import run_shard
from hsx_dagster_tests.support.helpers import shard_job, tokenize, write_settings
from hsx_dagster_tests.support.paths import REPO

PICKLE_PROTOCOL_MARK = b"\x80"  # the first byte of every pickle since protocol 2


@pytest.fixture(scope="module")
def few_inputs(small_inputs, tmp_path_factory) -> Path:
    """The 8 shortest of the small inputs: quick to extract."""
    path = tmp_path_factory.mktemp("few") / "few.jsonl"
    path.write_text("".join(line + "\n" for line in small_inputs.read_text().splitlines()[:8]))
    return path


def _refuse(*args, **kwargs):
    raise AssertionError("something on the data path tried to unpickle")


class _RefusingUnpickler:
    def __init__(self, *args, **kwargs) -> None:
        _refuse()


def test_nothing_on_the_data_path_unpickles(few_inputs, demo_model_dir, tmp_path, monkeypatch):
    for owner, name in [
        (pickle, "load"),
        (pickle, "loads"),
        (torch, "load"),
        (torch.serialization, "load"),
        (np, "load"),
    ]:
        monkeypatch.setattr(owner, name, _refuse)
    monkeypatch.setattr(pickle, "Unpickler", _RefusingUnpickler)

    summary = tokenize([few_inputs], demo_model_dir, tmp_path / "tokenized", shards=1, max_length=64)
    run_shard(
        shard_job(
            shard="shard-00",
            shard_index=0,
            tokenized_dir=tmp_path / "tokenized",
            output_dir=tmp_path / "hidden_states" / "shard-00",
            model_path=demo_model_dir,
            layer_ids=(1, 3),
            devices=("cpu",),
            batch_size=2,
            chunk_bytes=20_000,
        )
    )
    assemble(
        tmp_path / "tokenized",
        tmp_path / "hidden_states",
        ["shard-00"],
        tmp_path / "drafter",
        val_fraction=0.1,
        settings={},
    )
    assert (
        check_integrity(tmp_path / "drafter").passed
        and check_coverage(tmp_path / "drafter", tmp_path / "tokenized").passed
    )

    dataset = DrafterDataset(tmp_path / "drafter")
    # Forked DataLoader workers inherit the refusing pickle: they read the chunks without it too.
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, num_workers=2, collate_fn=collate_drafter_batch)
    assert sum(len(batch["sample_id"]) for batch in loader) == len(dataset) == summary.samples

    # Every file the pipeline wrote is JSON, Parquet or safetensors (or the empty lock file); no pickle.
    for path in sorted(p for p in tmp_path.rglob("*") if p.is_file()):
        head = path.read_bytes()[:16]
        if path.suffix == ".safetensors":
            assert head[8:9] == b"{", path  # 8-byte header length, then the JSON header
        elif path.suffix == ".parquet":
            assert head[:4] == b"PAR1", path
        elif path.suffix in (".json", ".jsonl"):
            assert head[:1] in (b"{", b"[") or path.stat().st_size == 0, path
        else:
            assert path.name == "shard.lock" and path.stat().st_size == 0, path
        assert not head.startswith(PICKLE_PROTOCOL_MARK), path


@pytest.fixture
def loaded_by_transformers(monkeypatch) -> list[tuple[str, object]]:
    """Every from_pretrained call of the pipeline, with the trust_remote_code it passed (models load through
    their concrete text-decoder class, whose from_pretrained is PreTrainedModel's)."""
    import transformers

    calls: list[tuple[str, object]] = []
    for name in ("AutoTokenizer", "AutoConfig", "AutoModel", "AutoModelForCausalLM", "PreTrainedModel"):
        cls = getattr(transformers, name)
        original = cls.from_pretrained.__func__

        def spy(cls_, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, kwargs.get("trust_remote_code", "not passed")))
            return _original(cls_, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    return calls


@pytest.mark.parametrize(
    "setting, expected",
    [({}, False), pytest.param({"trust_remote_code": True}, True, marks=pytest.mark.slow)],  # the quick loop: unset
    ids=["unset", "true"],
)
def test_trust_remote_code_is_off_unless_set_and_reaches_every_load(
    setting, expected, few_inputs, demo_model_dir, tmp_path, loaded_by_transformers
):
    from dagster import instance_for_test, materialize

    from hsx_dagster.core.dataset import check_parity
    from hsx_dagster.core.settings import load_settings
    from hsx_dagster.defs.assets.hidden_states import build_hidden_states
    from hsx_dagster.defs.assets.tokenized import tokenized_dataset
    from hsx_dagster.defs.partitions import shard_partitions
    from hsx_dagster.defs.resources import GpuResource, HsxSettings

    settings_file = write_settings(
        tmp_path / "hsx.yaml",
        dataset={"paths": [few_inputs], "max_length": 64},
        model={"path": demo_model_dir, "layers": [1, 3], **setting},
        shards=1,
        output_dir="out",
        extraction={"devices": ["cpu"]},
    )
    settings = load_settings(settings_file)
    assert settings.model.trust_remote_code is expected
    resources = {"settings": HsxSettings(path=str(settings_file)), "gpu": GpuResource.from_settings(settings)}
    hidden_states = build_hidden_states(shard_partitions(settings))
    with instance_for_test() as instance:
        assert materialize(
            [tokenized_dataset, hidden_states], resources=resources, partition_key="shard-00", instance=instance
        ).success
    out = tmp_path / "out"
    assemble(out / "tokenized", out / "hidden_states", ["shard-00"], out / "drafter", val_fraction=0.1, settings={})
    check_parity(out / "drafter", out / "tokenized", samples=1, trust_remote_code=settings.model.trust_remote_code)

    kinds = {name for name, _ in loaded_by_transformers}
    assert {"AutoTokenizer", "AutoConfig", "PreTrainedModel"} <= kinds  # tokenizer, config, extraction and parity
    assert {flag for _, flag in loaded_by_transformers} == {expected}, loaded_by_transformers


def test_the_ui_listens_on_loopback_only():
    completed = subprocess.run(["make", "-n", "ui"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    (command,) = [shlex.split(line) for line in completed.stdout.splitlines() if " dev " in f" {line} "]
    assert command[command.index("-h") + 1] == "127.0.0.1" and "0.0.0.0" not in completed.stdout
    assert "http://127.0.0.1:3000" in (REPO / "README.md").read_text()
