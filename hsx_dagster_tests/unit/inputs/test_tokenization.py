import json
import os
from pathlib import Path

import numpy as np
import pytest

from hsx_dagster.core.inputs import (
    InputFileError,
    RejectReason,
    TemplateError,
    TokenizedSummary,
    read_tokenized_shard,
    tokenization,
    workers,
)
from hsx_dagster.core.storage import SAMPLE_SCHEMA
from hsx_dagster_tests.support.helpers import read_rejects, tokenize
from hsx_dagster_tests.support.paths import SHARED_SAMPLE


def chat(*turns):
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]}


def write_jsonl(path: Path, records) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records))
    return path


def read_all(out: Path, shards: int):
    return [read_tokenized_shard(out, f"shard-{i:02d}") for i in range(shards)]


def test_every_reject_reason_is_recorded_with_its_location(tmp_path, demo_model_dir):
    good = [chat(f"question number {i}", f"a helpful answer number {i} with several words") for i in range(20)]
    bad = [
        b'{"messages": [',  # invalid_json
        b'{"messages": "\xff"}',  # invalid_utf8
        b"[1]",  # not_an_object
        {"prompt": "x"},  # missing_conversation_field
        {"messages": [1]},  # malformed_message
        {"conversations": [{"from": "narrator", "value": "x"}]},  # unknown_role
        {"messages": [{"role": "user", "content": {"a": 1}}]},  # non_text_content
        {"messages": []},  # empty_conversation
        {"messages": [{"role": "user", "content": "hi"}]},  # no_assistant_turn
        good[3],  # duplicate
        chat("hi <|im_start|>assistant\n", "ok then"),  # control_token_in_content
        chat("short question", "ok"),  # too_few_loss_tokens: "ok", the empty think block and <|im_end|>
    ]
    path = write_jsonl(tmp_path / "in.jsonl", good + bad)
    out = tmp_path / "tokenized"
    # Two workers: the lines are parsed in the worker processes, and every reject still comes back.
    summary = tokenize([path], demo_model_dir, out, min_loss_tokens=10, shards=2, workers=2)

    rejects = read_rejects(out).to_pylist()
    by_reason = {r["reason"]: r for r in rejects}
    expected = {
        RejectReason.INVALID_JSON,
        RejectReason.INVALID_UTF8,
        RejectReason.NOT_AN_OBJECT,
        RejectReason.MISSING_CONVERSATION,
        RejectReason.MALFORMED_MESSAGE,
        RejectReason.UNKNOWN_ROLE,
        RejectReason.NON_TEXT_CONTENT,
        RejectReason.EMPTY_CONVERSATION,
        RejectReason.NO_ASSISTANT_TURN,
        RejectReason.DUPLICATE,
        RejectReason.CONTROL_TOKEN_IN_CONTENT,
        RejectReason.TOO_FEW_LOSS_TOKENS,
    }
    assert set(by_reason) == expected and len(rejects) == len(bad)
    assert by_reason[RejectReason.DUPLICATE]["location"] == "line 30"
    assert f"{path} line 4" in by_reason[RejectReason.DUPLICATE]["detail"]
    assert "fewer than min_loss_tokens=10" in by_reason[RejectReason.TOO_FEW_LOSS_TOKENS]["detail"]
    assert all(r["source"] == str(path) for r in rejects)
    # Nothing is lost: every line is a sample or a reject.
    assert summary.samples + summary.rejected == len(good) + len(bad)
    assert summary.rejects == {reason: 1 for reason in sorted(expected)}
    assert summary.inputs[0].records == len(good) + len(bad)
    # In one process, the same rejects and samples, byte for byte.
    in_process = tokenize([path], demo_model_dir, tmp_path / "one", min_loss_tokens=10, shards=2, workers=1)
    assert in_process.workers == 1 and summary.workers == 2
    for name in ("rejects.parquet", "samples/shard-00.parquet", "samples/shard-01.parquet"):
        assert (tmp_path / "one" / name).read_bytes() == (out / name).read_bytes(), name


def test_one_worker_is_one_core_and_the_environment_is_restored(tmp_path, demo_model_dir, monkeypatch):
    """The fast tokenizer reads TOKENIZERS_PARALLELISM at every batch call: off while the in-process
    pass tokenises (one worker is one core, as in each worker process), the user's value after it."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    during = []
    real = workers.tokenize_rendered

    def spy(*args, **kwargs):
        during.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return real(*args, **kwargs)

    monkeypatch.setattr(workers, "tokenize_rendered", spy)
    path = write_jsonl(tmp_path / "in.jsonl", [chat(f"question {i}", f"an answer to question {i}") for i in range(5)])
    tokenize([path], demo_model_dir, tmp_path / "out", workers=1)
    assert during and set(during) == {"false"}
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    tokenize([path], demo_model_dir, tmp_path / "out", workers=1)
    assert "TOKENIZERS_PARALLELISM" not in os.environ


def test_auto_workers_are_every_core_but_one_per_256_kb_of_input(tmp_path, demo_model_dir, monkeypatch):
    """Starting a worker costs about as much as tokenising 100-200 KB: a small input runs in-process."""
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert workers.resolve_workers(None) == 8  # size unknown: every core
    assert workers.resolve_workers(3, input_bytes=10) == 3  # a number given wins
    kb = 1024
    assert [workers.resolve_workers(None, n * kb) for n in (0, 255, 256, 600, 768, 10_000)] == [1, 1, 1, 2, 3, 8]
    small = write_jsonl(tmp_path / "small.jsonl", [chat(f"question {i}", f"answer {i}") for i in range(40)])
    assert tokenize([small], demo_model_dir, tmp_path / "small").workers == 1
    # 2 cores offered and 600 KB of input: two workers.
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1})
    padding = "words of a long answer " * 60
    large = write_jsonl(tmp_path / "large.jsonl", [chat(f"q {i}", f"{padding}{i}") for i in range(450)])
    assert 512 * kb < large.stat().st_size < 768 * kb
    assert tokenize([large], demo_model_dir, tmp_path / "large").workers == 2


@pytest.mark.slow  # the whole demo corpus (the quick loop tokenizes parts of it: agentic records, 28 chats)
def test_layout_schema_and_shard_balance_on_the_demo(demo_paths, demo_model_dir, tmp_path):
    out = tmp_path / "tokenized"
    summary = tokenize(demo_paths, demo_model_dir, out, max_length=4096, shards=4)
    tables = read_all(out, 4)
    assert all(t.schema.equals(SAMPLE_SCHEMA) for t in tables)
    assert sorted(p.name for p in (out / "samples").iterdir()) == [f"shard-{i:02d}.parquet" for i in range(4)]
    assert summary.samples == sum(t.num_rows for t in tables) >= 2000
    ids = np.concatenate([t.column("sample_id").to_numpy() for t in tables])
    assert len(np.unique(ids)) == len(ids)
    for index, table in enumerate(tables):
        assert set(table.column("shard").to_pylist()) == {f"shard-{index:02d}"}
        lengths = table.column("input_ids").combine_chunks().value_lengths().to_numpy()
        assert np.array_equal(lengths, table.column("num_tokens").to_numpy())
        masks = table.column("loss_mask").combine_chunks().flatten().to_numpy()
        assert set(np.unique(masks)) <= {0, 1}
    loads = [s.tokens for s in summary.shards]
    assert summary.imbalance == pytest.approx(max(loads) / np.mean(loads), abs=1e-5)
    assert summary.imbalance < 1.01
    assert sum(loads) == summary.tokens
    assert 300 <= summary.tokens / summary.samples <= 400
    assert sum(b.samples for b in summary.histogram) == summary.samples
    assert summary.histogram[-1].max >= 2000
    assert TokenizedSummary.read(out) == summary
    # The demo's deliberately flawed records are all accounted for.
    assert summary.rejected >= 5


@pytest.mark.slow  # the whole demo corpus through several passes
def test_sample_ids_are_stable_across_runs_and_file_order(demo_paths, demo_model_dir, tmp_path):
    first = tokenize(demo_paths, demo_model_dir, tmp_path / "a", shards=2)
    second = tokenize(list(reversed(demo_paths)), demo_model_dir, tmp_path / "b", shards=2)
    assert first.samples == second.samples

    def by_id(out):
        rows = {}
        for table in read_all(out, 2):
            for row in table.select(["sample_id", "input_ids", "shard"]).to_pylist():
                rows[row["sample_id"]] = row
        return rows

    a, b = by_id(tmp_path / "a"), by_id(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(a[k]["input_ids"] == b[k]["input_ids"] for k in a)
    assert all(a[k]["shard"] == b[k]["shard"] for k in a)  # balance depends on lengths, not order


@pytest.mark.slow  # the whole demo corpus through several passes
def test_rerun_replaces_atomically_and_a_crash_keeps_the_old_output(demo_paths, demo_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "tokenized"
    tokenize(demo_paths, demo_model_dir, out, shards=2)
    before = {p.name: p.read_bytes() for p in (out / "samples").iterdir()}

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing shards")

    monkeypatch.setattr(tokenization, "write_shards", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        tokenize(demo_paths, demo_model_dir, out, shards=3)
    assert {p.name: p.read_bytes() for p in (out / "samples").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenized"]  # no temporaries left behind


def test_bad_files_fail_before_the_tokenizer_loads(tmp_path, demo_model_dir, monkeypatch):
    good = write_jsonl(tmp_path / "good.jsonl", [chat("a", "b")])
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    monkeypatch.setattr(tokenization, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer loaded"))
    with pytest.raises(InputFileError, match=f"{empty}: the file is empty"):
        tokenize([good, empty], demo_model_dir, tmp_path / "out")


def test_tokenizer_without_template_is_an_error_naming_the_model(tmp_path, demo_model_dir):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(demo_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in model.glob("chat_template.*"):
        extra.unlink()
    good = write_jsonl(tmp_path / "good.jsonl", [chat("a", "b")])
    with pytest.raises(TemplateError, match=f"tokenizer at {model} has no chat template"):
        tokenize([good], model, tmp_path / "out")


@pytest.mark.parametrize("workers", [1, 2])  # in this process, and in worker processes (the setting reaches them)
def test_loss_mask_all_supervises_every_token(tmp_path, demo_model_dir, workers):
    records = [chat("a question", "its answer", f"a follow-up {i}", "another answer") for i in range(6)]
    path = write_jsonl(tmp_path / "in.jsonl", records)
    assistant = tokenize([path], demo_model_dir, tmp_path / "a", workers=workers)
    everything = tokenize([path], demo_model_dir, tmp_path / "e", workers=workers, loss_mask="all")
    assert everything.tokens == assistant.tokens
    assert everything.loss_tokens == everything.tokens > assistant.loss_tokens
    (table,) = read_all(tmp_path / "e", 1)
    (reference,) = read_all(tmp_path / "a", 1)
    assert table.column("input_ids").to_pylist() == reference.column("input_ids").to_pylist()
    assert all(all(mask) for mask in table.column("loss_mask").to_pylist())
    # the summary records the choice: a dataset tokenized the other way is not mistaken for this one
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert summary["options"]["loss_mask"] == "all"


@pytest.mark.slow  # the whole demo corpus through several passes
def test_truncation_and_thinking_policy(demo_paths, demo_model_dir, tmp_path):
    short = tokenize(demo_paths, demo_model_dir, tmp_path / "s", max_length=256, shards=1)
    table = read_tokenized_shard(tmp_path / "s", "shard-00")
    assert max(table.column("num_tokens").to_pylist()) <= 256
    assert short.truncated > 0
    keep = tokenize(demo_paths, demo_model_dir, tmp_path / "k", shards=1)
    excluded = tokenize(demo_paths, demo_model_dir, tmp_path / "e", shards=1, thinking="exclude_from_loss")
    stripped = tokenize(demo_paths, demo_model_dir, tmp_path / "x", shards=1, thinking="strip")
    assert excluded.tokens == keep.tokens and excluded.loss_tokens < keep.loss_tokens
    assert stripped.tokens < keep.tokens


@pytest.mark.skipif(not SHARED_SAMPLE.is_file(), reason="shared ShareGPT sample not present")
def test_real_sharegpt_dump_tokenizes_completely(demo_model_dir, tmp_path):
    summary = tokenize([SHARED_SAMPLE], demo_model_dir, tmp_path / "t", shards=2)
    # A clean real-world dump written by someone else: all 500 records become samples.
    assert (summary.samples, summary.rejects) == (500, {})
    assert 0 < summary.loss_tokens < summary.tokens
