"""Agentic and reasoning conversations as they really come (OpenAI tool calling, reasoning_content, null
content, text parts, ShareGPT's tool-use variant) reach the chat template unchanged.

For every sample, the ids must equal ``tokenizer.apply_chat_template(messages, tools=tools)`` of the
source record as read here from the file (not through the parser under test), and the supervised tokens
must decode exactly to the assistant turns, computed here from the Qwen3 template's documented rules.
The same holds under a tokenizer that marks the reasoning and tool tags as special tokens, and with
several worker processes (byte-identical output).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from hsx_dagster.core.inputs import (
    Conversation,
    Message,
    RejectReason,
    SampleRejected,
    TemplateMarkers,
    TokenizedSummary,
    iter_records,
    render,
)
from hsx_dagster.core.storage import tokenized_shard_file
from hsx_dagster.demo.build import AGENTIC_PATH, AGENTIC_SHAREGPT_PATH
from hsx_dagster_tests.support.helpers import read_rejects, tokenize
from hsx_dagster_tests.support.paths import REPO
from hsx_dagster_tests.support.sweeps import densities, every_nth

REAL_SHAREGPT = Path("/work/shared/data/sharegpt_dummy_conversation.json")
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


# --- the source records, read independently of the parser ------------------------------------------
def source_records(path: Path) -> list[dict]:
    """Records by position (line or array item); a line that is not JSON is None (the parser rejects it)."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            records.append(None)
    return records


def openai_form(record: dict) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools a record gives apply_chat_template. OpenAI records as they are (the key
    ``reasoning`` is the documented alias of ``reasoning_content``); ShareGPT's tool-use variant mapped
    onto OpenAI roles by LLaMA-Factory's rules."""
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    if "messages" in record:
        messages = []
        for message in record["messages"]:
            message = dict(message)
            if "reasoning" in message and "reasoning_content" not in message:
                message["reasoning_content"] = message.pop("reasoning")
            messages.append(message)
        return messages, tools
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for turn in record["conversations"]:
        role = turn["from"]
        if role == "function_call":
            calls = json.loads(turn["value"])
            calls = calls if isinstance(calls, list) else [calls]
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                        for c in calls
                    ],
                }
            )
        else:
            mapped = {"human": "user", "gpt": "assistant", "observation": "tool", "system": "system"}[role]
            messages.append({"role": mapped, "content": turn["value"]})
    return messages, tools


def text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def qwen3_assistant_turns(messages: list[dict], thinking: str) -> list[str]:
    """Each assistant turn as Qwen3's template writes it, with its end-of-turn token; for
    exclude_from_loss, without the leading reasoning block and the whitespace after it."""
    last_query = max(
        i
        for i, m in enumerate(messages)
        if m["role"] == "user"
        and not (
            text_of(m["content"]).startswith("<tool_response>") and text_of(m["content"]).endswith("</tool_response>")
        )
    )
    turns = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        content, reasoning = text_of(message["content"]), ""
        if thinking != "strip" and isinstance(message.get("reasoning_content"), str):
            reasoning = message["reasoning_content"]
        elif "</think>" in content:
            if thinking != "strip":
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        calls = ""
        for number, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function", call)
            arguments = function["arguments"]
            written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            calls += ("\n" if (number == 0 and content) or number > 0 else "") + (
                '<tool_call>\n{"name": "' + function["name"] + '", "arguments": ' + written + "}\n</tool_call>"
            )
        if index > last_query and (index == len(messages) - 1 or reasoning):
            think = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
            answer = content.lstrip("\n") + calls + "<|im_end|>"
            turns.append(answer.lstrip(" \n") if thinking == "exclude_from_loss" else think + answer)
        else:
            turns.append(content + calls + "<|im_end|>")
    return turns


def supervised_runs(tokenizer, ids, mask) -> list[str]:
    runs, current = [], []
    for token, flag in zip(ids, mask):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False) for run in runs]


def template_ids(tokenizer, messages, tools) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"])


def samples_of(out: Path, summary: TokenizedSummary) -> list[dict]:
    rows = []
    for entry in summary.shards:
        rows += pq.read_table(tokenized_shard_file(out, entry.shard)).to_pylist()
    return rows


def check_every_sample(tokenizer, model_dir: Path, paths: list[Path], out: Path, thinking: str, workers: int = 1):
    """Tokenise ``paths`` and check every sample against the template and the expected turns."""
    summary = tokenize(paths, model_dir, out, max_length=1_000_000, thinking=thinking, workers=workers)
    records = {str(path): source_records(path) for path in paths}
    rows = samples_of(out, summary)
    assert len(rows) == summary.samples == sum(len(r) for r in records.values()), read_rejects(out).to_pylist()[:3]
    for row in rows:
        messages, tools = openai_form(records[row["source"]][row["source_index"]])
        if thinking == "strip":
            for message in messages:
                if message["role"] == "assistant":
                    message.pop("reasoning_content", None)
                    if isinstance(message["content"], str) and "</think>" in message["content"]:
                        message["content"] = message["content"].split("</think>")[-1].lstrip("\n")
        where = f"{row['source']} {row['source_index']}"
        assert row["input_ids"] == template_ids(tokenizer, messages, tools), where
        got = supervised_runs(tokenizer, row["input_ids"], row["loss_mask"])
        assert got == qwen3_assistant_turns(messages, thinking), where
    return summary, rows


@pytest.fixture(scope="module")
def agentic_paths(demo_root) -> list[Path]:
    return [demo_root / AGENTIC_PATH, demo_root / AGENTIC_SHAREGPT_PATH]


@pytest.fixture
def agentic_samples(agentic_paths, every, tmp_path) -> list[Path]:
    """The agentic corpus, or every ``every``-th record of it (same files and formats)."""
    return every_nth(agentic_paths, every, tmp_path / "corpus")


@pytest.fixture(scope="module")
def special_tags_model(demo_model_dir, tmp_path_factory) -> Path:
    """The demo tokenizer with the reasoning and tool tags marked special (as several families ship them)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("special-tags")
    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": list(TAGS)}, replace_extra_special_tokens=False)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    shutil.copy(demo_model_dir / "config.json", out / "config.json")
    return out


@densities()
def test_demo_corpus_covers_every_agentic_form(agentic_samples):
    openai_records = source_records(agentic_samples[0])
    messages = [m for r in openai_records for m in r["messages"]]
    calls = [c for m in messages for c in m.get("tool_calls") or []]
    assert all(r["tools"] for r in openai_records)
    assert any(isinstance(c["function"]["arguments"], str) for c in calls)
    assert any(isinstance(c["function"]["arguments"], dict) for c in calls)
    assert any(m["role"] == "assistant" and m["content"] is None for m in messages)
    assert any(isinstance(m["content"], list) for m in messages)
    assert any("reasoning_content" in m for m in messages) and any("reasoning" in m for m in messages)
    assert any(m["role"] == "assistant" and "<think>" in text_of(m["content"]) for m in messages)
    assert any(
        a["role"] == b["role"] == "tool" for r in openai_records for a, b in zip(r["messages"], r["messages"][1:])
    )
    # Multi-turn with reasoning on an earlier turn (the template drops it from the text).
    assert any(
        sum(m["role"] == "user" for m in r["messages"]) > 1
        and any(m.get("reasoning_content") for m in r["messages"][:3])
        for r in openai_records
    )
    sharegpt = source_records(agentic_samples[1])
    roles = {t["from"] for r in sharegpt for t in r["conversations"]}
    assert {"function_call", "observation"} <= roles
    assert {type(r["tools"]) for r in sharegpt} == {str, list}


@densities()
@pytest.mark.parametrize("thinking", ["keep", "strip", "exclude_from_loss"])
def test_every_agentic_sample_is_the_templates_own_rendering(
    agentic_samples, demo_model_dir, demo_tokenizer, tmp_path, thinking
):
    summary, rows = check_every_sample(demo_tokenizer, demo_model_dir, agentic_samples, tmp_path / "out", thinking)
    assert summary.rejects == {} and summary.ignored_fields == {}
    if thinking == "keep":
        # The tools block is in the ids (unsupervised), and tool-call blocks are supervised.
        first = next(r for r in rows if r["source"] == str(agentic_samples[0]) and r["source_index"] == 0)
        ids, mask = np.asarray(first["input_ids"]), np.asarray(first["loss_mask"], dtype=bool)
        assert "<tools>" in demo_tokenizer.decode(ids[~mask].tolist())
        supervised = "".join(supervised_runs(demo_tokenizer, first["input_ids"], first["loss_mask"]))
        assert "<tool_call>" in supervised and "<tools>" not in supervised and "<tool_response>" not in supervised


@densities()
def test_agentic_samples_exact_when_the_tags_are_special_tokens(agentic_samples, special_tags_model, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(special_tags_model))
    assert {"<think>", "<tool_call>"} <= set(tokenizer.all_special_tokens)
    summary, _ = check_every_sample(tokenizer, special_tags_model, agentic_samples, tmp_path / "out", "keep")
    assert summary.rejects == {}
    # The tags are accepted, but the turn structure is still guarded.
    assert not set(TAGS) & set(summary.tokenizer["control_strings"])
    assert "<|im_start|>" in summary.tokenizer["control_strings"]


@pytest.mark.slow  # the whole demo corpus through several passes
def test_plain_chat_and_real_sharegpt_still_exact_with_workers(demo_paths, demo_model_dir, demo_tokenizer, tmp_path):
    paths = list(demo_paths)
    if REAL_SHAREGPT.is_file():
        paths.append(REAL_SHAREGPT)
    one = tokenize(paths, demo_model_dir, tmp_path / "one", max_length=1_000_000, workers=1)
    two = tokenize(paths, demo_model_dir, tmp_path / "two", max_length=1_000_000, workers=2)
    assert two.workers == 2 and one.workers == 1
    for entry in one.shards:
        first, second = (
            tokenized_shard_file(d, entry.shard).read_bytes() for d in (tmp_path / "one", tmp_path / "two")
        )
        assert hashlib.sha256(first).digest() == hashlib.sha256(second).digest()
    assert (tmp_path / "one" / "rejects.parquet").read_bytes() == (tmp_path / "two" / "rejects.parquet").read_bytes()
    # Plain chat: ids are the template's rendering of the record (ShareGPT roles mapped), as before.
    records = {str(p): source_records(p) for p in paths}
    for row in samples_of(tmp_path / "one", one)[::7]:
        record = records[row["source"]][row["source_index"]]
        messages, tools = openai_form(record)
        assert row["input_ids"] == template_ids(demo_tokenizer, messages, tools)


@pytest.mark.slow  # two passes over the agentic corpus (the quick loop compares workers on every reject reason)
def test_agentic_output_identical_with_two_workers(agentic_paths, demo_model_dir, tmp_path):
    one = tokenize(agentic_paths, demo_model_dir, tmp_path / "one", workers=1)
    two = tokenize(agentic_paths, demo_model_dir, tmp_path / "two", workers=2)
    assert one.samples == two.samples > 0
    for entry in one.shards:
        files = [tokenized_shard_file(d, entry.shard).read_bytes() for d in (tmp_path / "one", tmp_path / "two")]
        assert files[0] == files[1]


# --- unsafe content is still refused, wherever it hides ---------------------------------------------------
def conversation(*messages: Message, tools=None) -> Conversation:
    return Conversation("mem", 0, "line 1", tuple(messages), tools)


@pytest.mark.parametrize(
    "sneaky",
    [
        conversation(Message("user", "q"), Message("assistant", "a", reasoning_content="x<|im_end|>y")),
        conversation(
            Message("user", "q"),
            Message(
                "assistant",
                "",
                tool_calls=({"type": "function", "function": {"name": "f", "arguments": '{"a": "<|im_start|>"}'}},),
                null_content=True,
            ),
        ),
        conversation(Message("user", "q"), Message("assistant", "a"), tools=({"name": "<|im_start|>system"},)),
        conversation(Message("user", "q <|endoftext|>"), Message("assistant", "a")),
    ],
)
def test_structural_markers_anywhere_are_rejected(demo_tokenizer, sneaky):
    with pytest.raises(SampleRejected) as caught:
        render(sneaky, demo_tokenizer, TemplateMarkers.probe(demo_tokenizer), "keep")
    assert caught.value.reason == RejectReason.CONTROL_TOKEN_IN_CONTENT


def test_reasoning_and_tool_tags_in_content_are_accepted(special_tags_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(special_tags_model))
    markers = TemplateMarkers.probe(tokenizer)
    tagged = conversation(
        Message("user", "What does <tool_call> mean in <think> blocks?"),
        Message("assistant", "<think>\nThe user asks about tags.\n</think>\n\nThey are markup."),
    )
    rendered = render(tagged, tokenizer, markers, "keep")
    assert rendered.text == tokenizer.apply_chat_template(tagged.as_chat(), tokenize=False)


# --- fields the pipeline does not understand are counted -------------------------------------------------
def test_ignored_fields_counted_per_reason(tmp_path, demo_model_dir):
    path = tmp_path / "extra.jsonl"
    records = [
        {
            "source": "web",
            "messages": [{"role": "user", "content": "a", "weight": 0}, {"role": "assistant", "content": "b"}],
        },
        {
            "messages": [
                {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d", "weight": 1, "refusal": None},
            ]
        },
        {"id": "x", "messages": [{"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = tokenize([path], demo_model_dir, tmp_path / "out", workers=1)
    # Counted per conversation; null fields carry nothing and identifiers are not template input.
    assert summary.ignored_fields == {"message_field:weight": 2, "record_field:source": 1}
    assert summary.samples == 3


# --- provenance: the tokenizer class and the library versions ----------------------------------------------
def test_same_files_as_another_tokenizer_class_are_recorded_and_reported(demo_model_dir, tmp_path):
    import transformers

    models = {}
    for model_type in ("qwen2", "gpt2"):
        folder = tmp_path / model_type
        folder.mkdir()
        shutil.copy(demo_model_dir / "tokenizer.json", folder / "tokenizer.json")
        config = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
        config.pop("tokenizer_class", None)  # transformers then picks the class from config.json's model_type
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        models[model_type] = folder
    inputs = tmp_path / "chat.jsonl"
    inputs.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
    )
    out = tmp_path / "out"
    first = tokenize([inputs], models["qwen2"], out, workers=1)
    assert first.tokenizer["class"] == "Qwen2Tokenizer"
    assert first.tokenizer["transformers_version"] == transformers.__version__
    messages: list[str] = []
    second = tokenize([inputs], models["gpt2"], out, workers=1, progress=messages.append)
    assert second.tokenizer["class"] == "GPT2Tokenizer"
    assert second.tokenizer["files_sha256"] == first.tokenizer["files_sha256"]
    assert "class 'Qwen2Tokenizer' -> 'GPT2Tokenizer'" in second.tokenizer["changed"]
    assert second.tokenizer["previous"]["class"] == "Qwen2Tokenizer"
    assert any("tokenizer differs" in m and "Qwen2Tokenizer" in m for m in messages)
    assert TokenizedSummary.read(out).tokenizer["class"] == "GPT2Tokenizer"


def test_parsed_agentic_records_keep_every_field(agentic_paths):
    records = source_records(agentic_paths[0])
    parsed = [r for r in iter_records(agentic_paths[0]) if isinstance(r, Conversation)]
    assert len(parsed) == len(records)
    for record, conversation in zip(records, parsed):
        messages, tools = openai_form(record)
        assert conversation.as_chat(content_parts=True) == messages
        assert conversation.chat_tools() == tools
        assert np.all([m.role in ("system", "user", "assistant", "tool") for m in conversation.messages])


def test_every_example_record_in_the_docs_is_accepted_and_exact(demo_model_dir, demo_tokenizer, tmp_path):
    docs = (REPO / "docs" / "data-format.md").read_text(encoding="utf-8")
    section = docs.split("## Accepted conversation forms", 1)[1]
    examples = [
        line for block in section.split("```json\n")[1:] for line in block.split("```", 1)[0].splitlines() if line
    ]
    assert len(examples) == 6
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(examples) + "\n", encoding="utf-8")
    summary = tokenize([path], demo_model_dir, tmp_path / "out", workers=1)
    assert summary.samples == 6 and summary.rejects == {} and summary.ignored_fields == {}
    for row in samples_of(tmp_path / "out", summary):
        messages, tools = openai_form(json.loads(examples[row["source_index"]]))
        assert row["input_ids"] == template_ids(demo_tokenizer, messages, tools)
        assert supervised_runs(demo_tokenizer, row["input_ids"], row["loss_mask"]) == qwen3_assistant_turns(
            messages, "keep"
        )
