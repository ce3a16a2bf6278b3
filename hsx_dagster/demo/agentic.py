"""Agentic demo conversations: tool schemas, tool calls (arguments as objects and as JSON strings),
tool responses, reasoning as a field or inline, in the OpenAI form and in ShareGPT's tool-use variant."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hsx_dagster.core.inputs import THINK_CLOSE, THINK_OPEN
from hsx_dagster.demo.conversations import SYSTEM_RATE
from hsx_dagster.demo.text import TextGenerator
from hsx_dagster.demo.words import plural

# Tool schemas in the OpenAI form (what `tools=` of apply_chat_template takes).
DEMO_TOOLS: tuple[dict[str, Any], ...] = tuple(
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": kind, "description": text} for key, kind, text in params},
                "required": [params[0][0]],
            },
        },
    }
    for name, description, params in (
        (
            "search_files",
            "Search the repository for files matching a query.",
            [("query", "string", "What to find"), ("limit", "integer", "Most results")],
        ),
        ("read_file", "Read a file of the repository.", [("path", "string", "Path of the file")]),
        (
            "run_sql",
            "Run a read-only SQL query on the warehouse.",
            [("query", "string", "The SQL"), ("timeout_s", "number", "Seconds")],
        ),
        (
            "get_weather",
            "Current weather for a city.",
            [("city", "string", "City name"), ("unit", "string", "celsius or fahrenheit")],
        ),
    )
)
AGENTIC_RATE_LIST_CONTENT = 0.1  # user turns given as a list of text parts


def _tool_arguments(gen: TextGenerator, tool: dict[str, Any]) -> dict[str, Any]:
    r = gen.rng
    out: dict[str, Any] = {}
    for key, spec in tool["function"]["parameters"]["properties"].items():
        if key != tool["function"]["parameters"]["required"][0] and r.random() < 0.4:
            continue
        if spec["type"] == "integer":
            out[key] = r.randint(1, 50)
        elif spec["type"] == "number":
            out[key] = round(r.uniform(0.5, 30.0), 1)
        elif key == "path":
            out[key] = f"src/{gen.noun()}/{gen.ident()}.py"
        elif key == "city":
            out[key] = r.choice(("Zürich", "Kraków", "Lisbon", "東京", "Austin"))
        elif key == "unit":
            out[key] = r.choice(("celsius", "fahrenheit"))
        elif key == "query" and tool["function"]["name"] == "run_sql":
            out[key] = f"SELECT {gen.noun()}, COUNT(*) FROM {plural(gen.noun())} GROUP BY 1"
        else:
            out[key] = f"{gen.adj()} {gen.noun()}"
    return out


def generate_agentic_conversations(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` agentic records in the OpenAI form: ``{"id", "messages", "tools"}``.

    Every record has tool schemas and at least one assistant turn that calls tools; across the set:
    tool calls with arguments as an object and as a JSON string, ``content: null`` on calling turns,
    several calls in one turn (so several tool responses in a row, with ``tool_call_id`` and ``name``),
    reasoning as ``reasoning_content`` (sometimes under the key ``reasoning``) or inline ``<think>``,
    multi-turn chats whose earlier turns carry reasoning, and user turns given as lists of text parts.
    """
    gen = TextGenerator(random.Random(seed))
    return [_agentic_record(gen, number) for number in range(n)]


def _agentic_record(gen: TextGenerator, number: int) -> dict[str, Any]:
    """One record; every draw from the one ``gen.rng``, in a fixed order (the demo reproduces byte for byte)."""
    rng = gen.rng
    tools = rng.sample(DEMO_TOOLS, rng.randint(1, len(DEMO_TOOLS)))
    form = rng.choice(("field", "field", "inline", "none"))
    key = "reasoning" if rng.random() < 0.15 else "reasoning_content"
    messages: list[dict[str, Any]] = []
    if rng.random() < SYSTEM_RATE:
        messages.append({"role": "system", "content": gen.system_prompt()})
    for _ in range(rng.choices((1, 2, 3), weights=(50, 35, 15))[0]):
        messages.append(_user_turn(gen))
        for _ in range(rng.choices((0, 1, 2), weights=(15, 60, 25))[0]):
            calls = [_tool_call(gen, rng.choice(tools)) for _ in range(rng.choices((1, 2, 3), weights=(55, 30, 15))[0])]
            preamble = None if rng.random() < 0.5 else gen.tool_call_message(False)
            messages.append(_assistant(gen, preamble, calls, form, key))
            for call in calls:
                name = call["function"]["name"]
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "name": name, "content": gen.tool_output()}
                )
        messages.append(_assistant(gen, gen.assistant_message(False), None, form, key))
    if not any(m.get("tool_calls") for m in messages):  # every record calls a tool at least once
        tool = rng.choice(tools)
        call = {
            "id": "call_last",
            "type": "function",
            "function": {"name": tool["function"]["name"], "arguments": _tool_arguments(gen, tool)},
        }
        messages[-1:] = [
            _assistant(gen, None, [call], form, key),
            {"role": "tool", "tool_call_id": "call_last", "content": gen.tool_output()},
            messages[-1],
        ]
    return {"id": f"agentic-{number:05d}", "tools": tools, "messages": messages}


def _user_turn(gen: TextGenerator) -> dict[str, Any]:
    question = gen.user_message()
    if gen.rng.random() < AGENTIC_RATE_LIST_CONTENT:
        head, _, tail = question.partition(" ")
        return {"role": "user", "content": [{"type": "text", "text": head + " "}, {"type": "text", "text": tail}]}
    return {"role": "user", "content": question}


def _tool_call(gen: TextGenerator, tool: dict[str, Any]) -> dict[str, Any]:
    rng = gen.rng
    arguments: Any = _tool_arguments(gen, tool)
    if rng.random() < 0.5:
        # As OpenAI sends them: a JSON string, written by the template exactly as given.
        arguments = json.dumps(arguments, ensure_ascii=rng.random() < 0.5)
    call_id = f"call_{rng.getrandbits(40):010x}"
    return {"id": call_id, "type": "function", "function": {"name": tool["function"]["name"], "arguments": arguments}}


def _assistant(
    gen: TextGenerator, text: str | None, tool_calls: list[dict[str, Any]] | None, form: str, key: str
) -> dict[str, Any]:
    """An assistant turn; its reasoning (drawn after ``text``) as the field ``key`` or inline, as ``form`` says."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if form == "field":
        message[key] = gen.reasoning()
    elif form == "inline":
        message["content"] = f"{THINK_OPEN}\n{gen.reasoning()}\n{THINK_CLOSE}\n\n{text or ''}"
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def to_sharegpt_tool_use(record: dict[str, Any], tools_as_string: bool) -> dict[str, Any]:
    """An agentic record in ShareGPT's tool-use variant (LLaMA-Factory's form): ``function_call`` turns
    (one per call, value ``{"name", "arguments"}`` as JSON), ``observation`` turns, ``tools`` as a JSON
    string or a list, the system prompt in ``system``; reasoning inline, as ShareGPT has no field for it."""
    turns: list[dict[str, str]] = []
    system = None
    for message in record["messages"]:
        role = message["role"]
        if role == "system":
            system = message["content"]
            continue
        if role == "user":
            content = message["content"]
            text = content if isinstance(content, str) else "".join(part["text"] for part in content)
            turns.append({"from": "human", "value": text})
        elif role == "tool":
            turns.append({"from": "observation", "value": message["content"]})
        elif message.get("tool_calls"):
            # LLaMA-Factory alternates strictly: one function_call turn holds every call of the turn.
            calls = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]
            ]
            turns.append({"from": "function_call", "value": json.dumps(calls if len(calls) > 1 else calls[0])})
        else:
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            text = message["content"] or ""
            turns.append(
                {"from": "gpt", "value": f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{text}" if reasoning else text}
            )
    out: dict[str, Any] = {"id": record["id"], "conversations": turns}
    out["tools"] = json.dumps(record["tools"]) if tools_as_string else record["tools"]
    if system is not None:
        out["system"] = system
    return out


def write_agentic(
    openai_path: Path, sharegpt_path: Path, records: Sequence[dict[str, Any]], *, seed: int
) -> tuple[int, int]:
    """The agentic records as OpenAI JSON Lines, and (every other one) in ShareGPT's tool-use variant as a
    JSON array; return the two record counts."""
    openai_path.parent.mkdir(parents=True, exist_ok=True)
    with openai_path.open("w", encoding="utf-8", newline="\n") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    rng = random.Random(seed)
    sharegpt = [to_sharegpt_tool_use(r, tools_as_string=rng.random() < 0.5) for r in records[::2]]
    with sharegpt_path.open("w", encoding="utf-8", newline="\n") as f:
        json.dump(sharegpt, f, ensure_ascii=False, indent=1)
        f.write("\n")
    return len(records), len(sharegpt)
