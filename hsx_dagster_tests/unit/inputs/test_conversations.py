import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsx_dagster.core.inputs import (
    Conversation,
    InputFileError,
    Message,
    Reject,
    RejectReason,
    check_input_file,
    iter_records,
)
from hsx_dagster_tests.support.paths import SHARED_SAMPLE

GOOD_SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
GOOD_OPENAI = {
    "messages": [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
}


def jsonl(tmp_path: Path, lines: list, name: str = "in.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(
        b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines) + b"\n"
    )
    return path


def test_sharegpt_and_openai_are_normalised(tmp_path):
    path = jsonl(tmp_path, [GOOD_SHAREGPT, GOOD_OPENAI])
    first, second = list(iter_records(path))
    assert first == Conversation(str(path), 0, "line 1", (Message("user", "hi"), Message("assistant", "hello")))
    assert [m.role for m in second.messages] == ["system", "user", "assistant"]
    assert second.location == "line 2"


def test_json_array_parquet_and_gzip_read_the_same(tmp_path):
    array = tmp_path / "dump.json"
    array.write_text(json.dumps([GOOD_SHAREGPT, GOOD_OPENAI]))
    parquet = tmp_path / "dump.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"messages": GOOD_OPENAI["messages"]}, {"messages": GOOD_OPENAI["messages"][1:]}]),
        parquet,
    )
    compressed = tmp_path / "dump.jsonl.gz"
    with gzip.open(compressed, "wt") as handle:
        handle.write(json.dumps(GOOD_SHAREGPT) + "\n")

    from_array = list(iter_records(array))
    assert [r.location for r in from_array] == ["item 0", "item 1"]
    assert all(isinstance(r, Conversation) for r in from_array)
    from_parquet = list(iter_records(parquet))
    assert [r.location for r in from_parquet] == ["row 0", "row 1"]
    assert from_parquet[1].messages == (Message("user", "hi"), Message("assistant", "hello"))
    assert next(iter(iter_records(compressed))).messages == from_array[0].messages


def test_openai_text_parts_are_joined(tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"},
        ]
    }
    (conversation,) = iter_records(jsonl(tmp_path, [record]))
    assert conversation.messages[0].content == "ab"


@pytest.mark.parametrize(
    "line, reason, detail",
    [
        (b'{"messages": [', RejectReason.INVALID_JSON, "column"),
        (b'{"messages": "\xff\xfe"}', RejectReason.INVALID_UTF8, "not UTF-8"),
        ([1, 2], RejectReason.NOT_AN_OBJECT, "list"),
        ({"text": "hi"}, RejectReason.MISSING_CONVERSATION, "neither"),
        ({"messages": "hi"}, RejectReason.MISSING_CONVERSATION, "not a list"),
        ({"messages": []}, RejectReason.EMPTY_CONVERSATION, "empty"),
        ({"messages": ["hi"]}, RejectReason.MALFORMED_MESSAGE, "messages[0] has no 'role'"),
        ({"conversations": [{"from": "narrator", "value": "x"}]}, RejectReason.UNKNOWN_ROLE, "'narrator'"),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, RejectReason.NON_TEXT_CONTENT, "dict, not text"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, RejectReason.NON_TEXT_CONTENT, "list"),
        ({"messages": [{"role": "user", "content": None}]}, RejectReason.NON_TEXT_CONTENT, "NoneType"),
        (
            {"messages": [{"role": "user", "content": "only a question"}]},
            RejectReason.NO_ASSISTANT_TURN,
            "no assistant",
        ),
        ({"messages": [{"role": "system", "content": "s"}]}, RejectReason.NO_ASSISTANT_TURN, "only system"),
    ],
)
def test_every_parse_reject_reason_names_the_line(tmp_path, line, reason, detail):
    path = jsonl(tmp_path, [GOOD_OPENAI, line])
    records = list(iter_records(path))
    assert isinstance(records[0], Conversation)
    reject = records[1]
    assert isinstance(reject, Reject)
    assert (reject.source, reject.source_index, reject.location, reject.reason) == (str(path), 1, "line 2", reason)
    assert detail in reject.detail


def test_blank_lines_are_not_records(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(GOOD_OPENAI) + "\n\n   \n" + json.dumps(GOOD_SHAREGPT) + "\n")
    assert [r.location for r in iter_records(path)] == ["line 1", "line 4"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", b"", "the file is empty"),
        ("spaces.json", b"  \n ", "the file is empty"),
        ("data.csv", b"a,b", "unknown file type"),
        ("broken.json", b'[{"messages": []}, {"mess', "invalid JSON after item 0"),
        ("nothing.json", b"[]", "holds no records"),
        ("fake.parquet", b"not parquet", "not a readable Parquet file"),
    ],
)
def test_file_level_problems_name_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InputFileError, match=message) as caught:
        list(iter_records(path))
    assert str(path) in str(caught.value)


def test_parquet_with_wrong_schema_is_refused_up_front(tmp_path):
    path = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "response": ["b"]}), path)
    with pytest.raises(InputFileError, match=r"no 'conversations' or 'messages' column \(columns: prompt, response\)"):
        check_input_file(path)


def test_reads_a_json_array_lazily(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps([GOOD_SHAREGPT] * 3) + "garbage")  # trailing garbage: found only at the end
    records = iter_records(path)
    assert isinstance(next(records), Conversation)  # the first item arrives before the file is parsed
    with pytest.raises(InputFileError):
        list(records)


@pytest.mark.skipif(not SHARED_SAMPLE.is_file(), reason="shared ShareGPT sample not present")
def test_real_sharegpt_dump_parses():
    records = list(iter_records(SHARED_SAMPLE))
    assert len(records) == 500
    conversations = [r for r in records if isinstance(r, Conversation)]
    rejects = [r for r in records if isinstance(r, Reject)]
    assert len(conversations) == 500 and not rejects  # a clean real-world dump: nothing to reject
    assert all(any(m.role == "assistant" for m in c.messages) for c in conversations)
    assert conversations[0].messages[0] == Message("user", "Who are you?")


# --- everything a chat template can render is kept ----------------------------------------------------------
CALL_OBJECT = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": "é"}}}
CALL_STRING = {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"y":  2}'}}


def one(tmp_path: Path, record: dict) -> Conversation | Reject:
    (item,) = list(iter_records(jsonl(tmp_path, [record])))
    return item


def test_openai_tool_calling_record_kept_as_given(tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    record = {
        "tools": tools,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "plan",
                "tool_calls": [CALL_OBJECT, CALL_STRING],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "r1"},
            {"role": "tool", "tool_call_id": "c2", "content": "r2"},
            {"role": "assistant", "reasoning": "done thinking", "content": "answer"},
        ],
    }
    conversation = one(tmp_path, record)
    assert isinstance(conversation, Conversation)
    chat = conversation.as_chat(content_parts=True)
    assert chat[0]["content"] == record["messages"][0]["content"]
    assert conversation.as_chat()[0]["content"] == "ab"  # joined for templates that only take strings
    assert chat[1] == record["messages"][1]  # null content, reasoning, both calls exactly as given
    assert chat[1]["tool_calls"][1]["function"]["arguments"] == '{"y":  2}'  # the string, not re-encoded
    assert chat[2] == record["messages"][2] and chat[3] == record["messages"][3]
    assert chat[4] == {"role": "assistant", "content": "answer", "reasoning_content": "done thinking"}
    assert conversation.chat_tools() == tools
    assert conversation.ignored == ()


def test_sharegpt_tool_use_variant(tmp_path):
    tools = [{"name": "f", "parameters": {}}]
    record = {
        "system": "sys",
        "tools": json.dumps(tools),
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "function_call", "value": json.dumps({"name": "f", "arguments": {"x": 1}})},
            {"from": "observation", "value": "42"},
            {
                "from": "function_call",
                "value": json.dumps([{"name": "f", "arguments": "{}"}, {"name": "f", "arguments": {}}]),
            },
            {"from": "observation", "value": "43"},
            {"from": "gpt", "value": "done"},
        ],
    }
    conversation = one(tmp_path, record)
    assert isinstance(conversation, Conversation)
    assert [m["role"] for m in conversation.as_chat()] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert conversation.messages[0].content == "sys"
    assert conversation.as_chat()[2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert [c["function"]["arguments"] for c in conversation.as_chat()[4]["tool_calls"]] == ["{}", {}]
    assert conversation.chat_tools() == tools
    record["tools"] = tools  # a list works too
    assert one(tmp_path, record).chat_tools() == tools


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": None, "tool_calls": "f()"},
                ]
            },
            RejectReason.MALFORMED_MESSAGE,
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "tool_calls": [{"function": {"arguments": "{}"}}]},
                ]
            },
            RejectReason.MALFORMED_MESSAGE,
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q", "tool_calls": [CALL_OBJECT]},
                    {"role": "assistant", "content": "a"},
                ]
            },
            RejectReason.MALFORMED_MESSAGE,
        ),
        (
            {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}]},
            RejectReason.NON_TEXT_CONTENT,
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                    {"role": "assistant", "content": "a"},
                ]
            },
            RejectReason.NON_TEXT_CONTENT,
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "reasoning_content": 3},
                ]
            },
            RejectReason.MALFORMED_MESSAGE,
        ),
        (
            {
                "tools": "not json",
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            },
            RejectReason.MALFORMED_TOOLS,
        ),
        (
            {"tools": [1, 2], "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            RejectReason.MALFORMED_TOOLS,
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f(x)"}]},
            RejectReason.MALFORMED_MESSAGE,
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "function_call", "value": '{"arguments": {}}'},
                ]
            },
            RejectReason.MALFORMED_MESSAGE,
        ),
    ],
)
def test_malformed_agentic_records_are_rejected_with_a_reason(tmp_path, record, reason):
    item = one(tmp_path, record)
    assert isinstance(item, Reject) and item.reason == reason, item


def test_unknown_fields_are_reported_not_dropped_silently(tmp_path):
    record = {
        "id": "x",
        "source": "web",
        "messages": [
            {"role": "user", "content": "q", "weight": 1, "refusal": None},
            {
                "role": "assistant",
                "content": "a",
                "reasoning_content": "r",
                "reasoning": "other",
                "function_call": {"name": "f"},
            },
        ],
    }
    conversation = one(tmp_path, record)
    assert isinstance(conversation, Conversation)
    assert sorted(conversation.ignored) == [
        "message_field:function_call",
        "message_field:reasoning",
        "message_field:weight",
        "record_field:source",
    ]


def test_plain_messages_stay_plain(tmp_path):
    conversation = one(tmp_path, GOOD_OPENAI)
    assert all(m.is_plain for m in conversation.messages)
    assert conversation.as_chat() == GOOD_OPENAI["messages"]
