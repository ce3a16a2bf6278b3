"""Bad inputs: every one ends in a reject row (rejects.parquet: source, location, reason) or in an
error that names the file, line or key and says what to fix, before any model loads. Nothing is
dropped silently and nothing ends in a bare traceback.

The corpus is data/bad_inputs/, one file per case (the 1 MB message is generated here). Cases
already pinned elsewhere are not repeated: unknown settings keys, layer ids out of range and a
model without weights (test_settings.py), a tokenizer without a chat template (test_tokenization.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from hsx_dagster.core.inputs import (
    InputFileError,
    RejectReason,
    TemplateError,
    TokenizedDataError,
    read_tokenized_shard,
    tokenization,
)
from hsx_dagster.core.settings import SettingsError, load_settings
from hsx_dagster.core.shard_keys import check_shard_key
from hsx_dagster_tests.support.helpers import read_rejects, tokenize

CORPUS = Path(__file__).parent / "data" / "bad_inputs"
MAX_LENGTH = 64


@dataclass(frozen=True)
class RecordCase:
    file: str
    reason: str | None  # None: the record is fine and becomes a sample
    location: str = "line 1"
    detail: str = ""


RECORD_CASES = [
    RecordCase("invalid_json.jsonl", RejectReason.INVALID_JSON, detail="Expecting"),
    RecordCase("top_level_array.jsonl", RejectReason.NOT_AN_OBJECT, detail="record is a list, not an object"),
    RecordCase(
        "missing_conversation.jsonl", RejectReason.MISSING_CONVERSATION, detail="neither 'conversations' nor 'messages'"
    ),
    RecordCase(
        "conversation_not_a_list.json",
        RejectReason.MISSING_CONVERSATION,
        "item 0",
        "'conversations' is a str, not a list",
    ),
    RecordCase("message_not_an_object.jsonl", RejectReason.MALFORMED_MESSAGE, detail="messages[0] has no 'role'"),
    RecordCase("unknown_role.json", RejectReason.UNKNOWN_ROLE, "item 0", "conversations[1].from is 'bard'"),
    RecordCase(
        "non_string_content.jsonl", RejectReason.NON_TEXT_CONTENT, detail="messages[0].content is a int, not text"
    ),
    RecordCase("image_content.jsonl", RejectReason.NON_TEXT_CONTENT, detail="messages[0].content is a list, not text"),
    RecordCase("empty_conversation.jsonl", RejectReason.EMPTY_CONVERSATION, detail="'messages' is empty"),
    RecordCase("no_assistant_turn.jsonl", RejectReason.NO_ASSISTANT_TURN, detail="no assistant turn"),
    RecordCase("only_system_turns.jsonl", RejectReason.NO_ASSISTANT_TURN, detail="only system turns"),
    RecordCase("invalid_utf8.jsonl", RejectReason.INVALID_UTF8, detail="not UTF-8 at byte 46"),
    RecordCase(
        "lone_surrogate.jsonl", RejectReason.INVALID_UTF8, detail="messages[0].content holds '\\ud800' at character 4"
    ),
    RecordCase("deep_nesting.jsonl", RejectReason.INVALID_JSON, detail="nested too deeply"),
    RecordCase("duplicate.jsonl", RejectReason.DUPLICATE, "line 2", "duplicate.jsonl line 1"),
    RecordCase("control_token.jsonl", RejectReason.CONTROL_TOKEN_IN_CONTENT, detail="'<|im_start|>'"),
    RecordCase(
        "zero_loss_after_truncation.jsonl",
        RejectReason.TOO_FEW_LOSS_TOKENS,
        detail="0 supervised tokens after truncation to max_length",
    ),
    RecordCase(
        "messages_not_a_list.parquet", RejectReason.MISSING_CONVERSATION, "row 0", "'messages' is a str, not a list"
    ),
    RecordCase("huge_message.jsonl", RejectReason.TOO_FEW_LOSS_TOKENS, detail="after truncation to max_length"),
    RecordCase("byte_order_mark.jsonl", None),
]


@pytest.fixture(scope="module")
def huge_message(tmp_path_factory) -> Path:
    """A single 1 MB user message: truncation leaves none of the reply, so it is rejected, quickly."""
    path = tmp_path_factory.mktemp("huge") / "huge_message.jsonl"
    question = "Please read all of this. " + "lorem ipsum dolor sit amet " * (2**20 // 27)
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "Done."}]})
        + "\n"
    )
    assert path.stat().st_size > 2**20
    return path


def corpus_file(name: str, huge_message: Path) -> Path:
    return huge_message if name == huge_message.name else CORPUS / name


@pytest.fixture(scope="module")
def corpus_run(huge_message, demo_model_dir, tmp_path_factory):
    """Every record-level case tokenized in one run, as one dataset of many files."""
    paths = [corpus_file(case.file, huge_message) for case in RECORD_CASES]
    out = tmp_path_factory.mktemp("corpus") / "tokenized"
    summary = tokenize(paths, demo_model_dir, out, max_length=MAX_LENGTH, shards=1)
    return summary, read_rejects(out).to_pylist(), read_tokenized_shard(out, "shard-00").to_pylist()


@pytest.mark.parametrize("case", RECORD_CASES, ids=[case.file for case in RECORD_CASES])
def test_bad_record_becomes_a_reject_row_with_its_location_and_reason(case, corpus_run, huge_message):
    _, rejects, samples = corpus_run
    source = str(corpus_file(case.file, huge_message))
    mine = [row for row in rejects if row["source"] == source]
    if case.reason is None:
        assert mine == [] and [row["source_index"] for row in samples if row["source"] == source] == [0]
        return
    (row,) = mine
    assert (row["location"], row["reason"]) == (case.location, case.reason), row
    assert case.detail in row["detail"], row["detail"]


def test_every_record_of_the_corpus_is_a_sample_or_a_reject(corpus_run):
    summary, rejects, samples = corpus_run
    for entry in summary.inputs:
        rows = [r for r in rejects if r["source"] == entry.path] + [s for s in samples if s["source"] == entry.path]
        assert len(rows) == entry.records == entry.samples + entry.rejects, entry
        assert sorted(r["source_index"] for r in rows) == list(range(entry.records))  # each record once
    assert summary.samples == 2  # the first of the duplicates and the file with a byte-order mark


FILE_CASES = [
    ("empty.jsonl", "the file is empty"),
    (
        "wrong_schema.parquet",
        r"Parquet schema has no 'conversations' or 'messages' column \(columns: prompt, response\)",
    ),
    ("not_parquet.parquet", "not a readable Parquet file"),
    ("conversations.csv", r"unknown file type; use \.jsonl, \.json \(array or lines\) or \.parquet"),
    ("not_gzip.jsonl.gz", "not a readable gzip file"),
]


@pytest.mark.parametrize("name, message", FILE_CASES, ids=[name for name, _ in FILE_CASES])
def test_unreadable_file_is_named_before_the_tokenizer_loads(name, message, demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenization, "load_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was loaded"))
    path = CORPUS / name
    with pytest.raises(InputFileError, match=message) as failure:
        tokenize([CORPUS / "duplicate.jsonl", path], demo_model_dir, tmp_path / "out")
    assert str(failure.value).startswith(f"{path}: ")
    assert not (tmp_path / "out").exists()


DAMAGED_FILES = [
    ("broken_array.json", "invalid JSON after item 0: .*the rest of the array cannot be read"),
    ("deep_array.json", "item 0 is nested too deeply to be a conversation"),
    ("single_pretty_object.json", "line 1 is not a whole JSON record.*JSON array of records or one record per line"),
    (
        "truncated.jsonl.gz",
        r"the compressed file is truncated or corrupt \(after line \d+: .*replace it with a complete copy",
    ),
]


@pytest.mark.parametrize("name, message", DAMAGED_FILES, ids=[name for name, _ in DAMAGED_FILES])
def test_damage_found_while_reading_names_the_file_and_the_place(name, message, demo_model_dir, tmp_path):
    """A file that breaks part-way fails the whole tokenization (no partial dataset is kept)."""
    path = CORPUS / name
    with pytest.raises(InputFileError, match=message) as failure:
        tokenize([path], demo_model_dir, tmp_path / "out")
    assert str(failure.value).startswith(f"{path}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no staging folder left behind


@pytest.fixture
def project(tmp_path, demo_model_dir) -> Path:
    """A settings folder: one input file and a model directory of links to the demo model's files."""
    (tmp_path / "in.jsonl").write_bytes((CORPUS / "duplicate.jsonl").read_bytes())
    model = tmp_path / "model"
    model.mkdir()
    for source in demo_model_dir.iterdir():
        (model / source.name).symlink_to(source)
    return tmp_path


def settings_text(extra: str = "", paths: str = "[in.jsonl]") -> str:
    return f"dataset:\n  paths: {paths}\nmodel:\n  path: model\n  layers: [1, 3]\nshards: 2\noutput_dir: out\n{extra}"


def test_settings_problems_name_the_file_and_key_before_anything_loads(project):
    file = project / "hsx.yaml"
    cases = [
        (
            settings_text(paths="[in.jsonl, ./in.jsonl]"),
            r"key `dataset.paths\[1\]`: .*in.jsonl is already listed as dataset.paths\[0\]",
        ),
        (
            settings_text("extraction:\n  on_mismatch: overwrite\n"),
            r"key `extraction.on_mismatch`: Input should be 'refuse' or 'start_over' \(got 'overwrite'\)",
        ),
        (settings_text("extraction:\n  nan_polcy: fail\n"), r"key `extraction.nan_polcy`: unknown key"),
    ]
    for text, message in cases:
        file.write_text(text)
        with pytest.raises(SettingsError, match=message) as failure:
            load_settings(file)
        assert str(failure.value).startswith(f"{file}: ")


def test_sharded_checkpoint_missing_a_weight_file_is_named(project):
    model = project / "model"
    (model / "model.safetensors").unlink()
    weight_map = {
        "embed_tokens.weight": "model-00001-of-00002.safetensors",
        "norm.weight": "model-00002-of-00002.safetensors",
    }
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")
    (project / "hsx.yaml").write_text(settings_text())
    with pytest.raises(
        SettingsError,
        match=r"key `model.path`: .* lacks weight files its index names: model-00002-of-00002.safetensors; "
        r"finish downloading",
    ):
        load_settings(project / "hsx.yaml")

    from hsx_dagster.core.model import ModelDirError, check_model_dir

    with pytest.raises(ModelDirError, match="lacks weight files its index names: model-00002-of-00002"):
        check_model_dir(model)  # what a shard run checks before loading the model


def test_model_directory_without_a_tokenizer_says_what_is_missing(project, tmp_path):
    (project / "model" / "tokenizer.json").unlink()
    with pytest.raises(
        TemplateError, match=r"model: cannot load the tokenizer \(.*\); the model directory needs .*tokenizer.json"
    ):
        tokenize([project / "in.jsonl"], project / "model", tmp_path / "out")


def test_a_folder_that_is_not_a_tokenized_dataset_is_never_replaced(project, demo_model_dir):
    target = project / "out" / "tokenized"
    target.mkdir(parents=True)
    (target / "my-notes.txt").write_text("not ours")
    with pytest.raises(
        TokenizedDataError, match=f"{target} exists and is not a tokenized dataset.*refusing to replace it"
    ):
        tokenize([project / "in.jsonl"], demo_model_dir, target)
    assert (target / "my-notes.txt").read_text() == "not ours"


@pytest.mark.parametrize("key", ["../etc", "/tmp/x", "shard-1/../../x", "shard-", "", "Shard-00"])
def test_keys_that_could_leave_the_output_folder_are_refused(key, project):
    (project / "hsx.yaml").write_text(settings_text())
    settings = load_settings(project / "hsx.yaml")
    with pytest.raises(SettingsError, match="is not a shard key"):
        check_shard_key(key)
    with pytest.raises(SettingsError, match="is not a shard key"):
        settings.shard_dir(key)
    with pytest.raises(SettingsError, match="is not a shard key"):
        read_tokenized_shard(project / "out" / "tokenized", key)


def test_a_partition_that_is_not_a_shard_names_the_shards_key(project):
    (project / "hsx.yaml").write_text(settings_text())
    settings = load_settings(project / "hsx.yaml")
    assert settings.shard_dir("shard-01") == project / "out" / "hidden_states" / "shard-01"
    with pytest.raises(
        SettingsError, match=r"partition 'shard-02' is not one of the 2 shards of key `shards` \(shard-00 .. shard-01\)"
    ):
        settings.shard_index("shard-02")
