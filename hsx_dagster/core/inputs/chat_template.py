"""Render conversations with the target's own chat template and build an exact assistant-only loss mask.

The mask is derived from character offsets in the *fully rendered* text, never from raw message
strings: templates rewrite content (Qwen3-style templates drop the reasoning of assistant turns
before the last user turn and normalise newlines; Llama-3 trims), and rendering turn by turn gives
a different text from rendering the whole conversation.

How a turn is found, for any template: the template's generation prompt is the assistant header
(what a model sees before it starts to answer), and the text a template appends after an
assistant reply, up to and including its first special token, is the end-of-turn marker. Both are
learnt once per tokenizer by rendering a probe conversation (`TemplateMarkers.probe`). In a
rendered conversation, each assistant turn runs from the end of its header to the end of its
end-of-turn marker; those characters, and only those, are supervised. Tokens are assigned to a
turn by the offset of their first character.

Every message reaches the template with every field the record gave (reasoning_content, tool_calls,
tool_call_id, name, content null or a list of text parts) and the record's tool schemas go in as
``tools=``, so the rendered text is exactly ``apply_chat_template(messages, tools=tools)``. Only
content holding the template's structural markers (the turn header, the end-of-turn marker, the
special tokens that delimit turns, bos/eos/pad/unk) is refused: with those, a message could forge
a turn. Reasoning and tool tags (``<think>``, ``<tool_call>``) are accepted even when the
tokenizer marks them special, since templates parse them out of content themselves.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hsx_dagster.core.inputs.records import Conversation, Message, RejectReason

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE_USER = "hsxprobeuserturn"
_PROBE_ASSISTANT = "hsxprobeassistantturn"


class TemplateError(ValueError):
    """The tokenizer or its chat template cannot be used (missing, or its turns cannot be located)."""


class SampleRejected(Exception):
    """One conversation cannot become a sample; carries a reason code from `RejectReason`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self):  # rebuilt from (reason, detail) when it comes back from a worker process
        return (type(self), (self.reason, self.detail))


@dataclass(frozen=True)
class TemplateMarkers:
    assistant_header: str
    end_of_turn: str
    control_strings: tuple[str, ...]  # structural markers: content holding one is refused
    content_parts: bool = False  # the template renders content given as a list of text parts

    @classmethod
    def probe(cls, tokenizer, name: str = "tokenizer") -> TemplateMarkers:
        """Learn the assistant header and end-of-turn marker of a tokenizer's chat template."""
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"{name} has no chat template (tokenizer_config.json has no 'chat_template')")
        user = [{"role": "user", "content": _PROBE_USER}]
        try:
            bare = tokenizer.apply_chat_template(user, tokenize=False)
            prompted = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(
                [*user, {"role": "assistant", "content": _PROBE_ASSISTANT}], tokenize=False
            )
        except Exception as exc:  # jinja errors surface as several types
            raise TemplateError(f"{name}: chat template failed on a two-turn probe conversation: {exc}") from None
        header = prompted[len(bare) :] if prompted.startswith(bare) else ""
        if not header:
            raise TemplateError(
                f"{name}: the chat template adds no generation prompt, so assistant turns cannot be located"
            )
        reply_at = full.find(_PROBE_ASSISTANT)
        if reply_at < 0 or full.rfind(header, 0, reply_at) < 0:
            raise TemplateError(
                f"{name}: the chat template's generation prompt {header!r} does not precede assistant replies"
            )
        footer = full[reply_at + len(_PROBE_ASSISTANT) :]
        special = sorted(_special_strings(tokenizer), key=len, reverse=True)
        hits = [(footer.find(s), s) for s in special if s and footer.find(s) >= 0]
        if hits:
            at, token = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            end_of_turn = footer[: at + len(token)]
        else:
            end_of_turn = footer.rstrip()
        if not end_of_turn:
            raise TemplateError(f"{name}: the chat template ends assistant turns with nothing (no end-of-turn token)")
        # Structural: the special tokens the template writes around a plain user turn, into the assistant
        # header and the end-of-turn marker, and the tokenizer's bos/eos/pad/unk. Not structural: special
        # tokens the template writes only from content it parses (reasoning and tool tags).
        scaffold = bare + header + end_of_turn
        controls = {s for s in special if s and s in scaffold} | _role_tokens(tokenizer)
        controls |= {header.strip(), end_of_turn.strip()}
        return cls(header, end_of_turn, tuple(sorted(s for s in controls if s)), _renders_parts(tokenizer))


def _role_tokens(tokenizer) -> set[str]:
    """The tokenizer's bos, eos, pad and unk tokens (as text)."""
    found = set()
    for attribute in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, attribute, None)
        if value:
            found.add(str(value))
    return found


def _renders_parts(tokenizer) -> bool:
    """Whether the template writes the text of content given as a list of parts (else parts are joined
    into one string before rendering, as OpenAI-compatible servers do for string-only templates)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": _PROBE_USER}]}]
    try:
        return _PROBE_USER in tokenizer.apply_chat_template(parts, tokenize=False)
    except Exception:  # a template that only takes strings may raise on a list
        return False


@dataclass(frozen=True)
class RenderedConversation:
    text: str
    supervised: list[tuple[int, int]]  # character spans whose tokens get loss 1


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool


def sample_id_of(messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> int:
    """A stable 63-bit id from the conversation's content: the same conversation always gets the same
    id, whatever file or position it comes from, and exact duplicates are recognised. A plain message
    (role and text only) hashes as it always has; reasoning, tool calls, tool ids and names, null
    content, text parts and the record's tools are part of the id when present."""
    canonical_messages: list[list[Any]] = []
    for m in messages:
        if m.is_plain:
            canonical_messages.append([m.role, m.content])
        else:
            extra = {key: value for key, value in m.as_chat(content_parts=True).items() if key != "role"}
            canonical_messages.append([m.role, m.content, extra])
    payload: Any = canonical_messages if tools is None else [canonical_messages, {"tools": list(tools)}]
    canonical = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(canonical.encode("utf-8"), digest_size=8).digest(), "big") >> 1


def strip_reasoning(content: str) -> str:
    """The answer part of an assistant message, as Qwen3-style templates keep it for earlier turns."""
    if THINK_CLOSE in content:
        return content.split(THINK_CLOSE)[-1].lstrip("\n")
    return content


def chat_messages(conversation: Conversation, markers: TemplateMarkers, thinking: str) -> list[dict[str, Any]]:
    """The messages handed to ``apply_chat_template``: as the record gave them, except that
    ``thinking='strip'`` removes reasoning (``reasoning_content`` and inline ``<think>``) from assistant turns."""
    chat = conversation.as_chat(markers.content_parts)
    if thinking == "strip":
        for message in chat:
            if message["role"] != "assistant":
                continue
            message.pop("reasoning_content", None)
            if isinstance(message["content"], str):
                message["content"] = strip_reasoning(message["content"])
            elif isinstance(message["content"], list):
                message["content"] = [{**part, "text": strip_reasoning(part["text"])} for part in message["content"]]
    return chat


def render(
    conversation: Conversation, tokenizer, markers: TemplateMarkers, thinking: str, loss_mask: str = "assistant"
) -> RenderedConversation:
    """Render with the chat template (``apply_chat_template(messages, tools=tools)``) and locate the
    characters the loss covers.

    ``thinking``: 'keep' supervises reasoning wherever the template renders it; 'strip' removes it
    (``reasoning_content`` and inline ``<think>``) from every assistant turn before rendering;
    'exclude_from_loss' renders it but leaves it out of the loss.
    ``loss_mask``: 'assistant' supervises the assistant turns; 'all' the whole text (the assistant turns are
    still located, so a template that loses one rejects the sample either way).
    """
    tools = conversation.chat_tools()
    _refuse_control_text(conversation, tools, markers)
    chat = chat_messages(conversation, markers, thinking)
    try:
        text = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False)
    except Exception as exc:  # a template may raise on shapes it does not support (e.g. role order)
        raise SampleRejected(RejectReason.TEMPLATE_ERROR, f"chat template failed: {exc}") from None

    spans = _assistant_spans(text, conversation, markers, thinking)
    return RenderedConversation(text, [(0, len(text))] if loss_mask == "all" else spans)


def _assistant_spans(
    text: str, conversation: Conversation, markers: TemplateMarkers, thinking: str
) -> list[tuple[int, int]]:
    """The characters of each assistant turn in the rendered ``text``, header excluded, end of turn included
    (without a leading reasoning block when ``thinking`` is 'exclude_from_loss')."""
    expected = sum(1 for m in conversation.messages if m.role == "assistant")
    headers = [match.start() for match in re.finditer(re.escape(markers.assistant_header), text)]
    if len(headers) != expected:
        raise SampleRejected(
            RejectReason.TEMPLATE_ERROR,
            f"found {len(headers)} assistant headers in the rendered text for {expected} assistant turns",
        )
    spans: list[tuple[int, int]] = []
    for number, header_at in enumerate(headers):
        start = header_at + len(markers.assistant_header)
        end_at = text.find(markers.end_of_turn, start)
        limit = headers[number + 1] if number + 1 < len(headers) else len(text)
        if end_at < 0 or end_at + len(markers.end_of_turn) > limit:
            raise SampleRejected(RejectReason.TEMPLATE_ERROR, f"assistant turn {number} has no end-of-turn marker")
        end = end_at + len(markers.end_of_turn)
        if thinking == "exclude_from_loss":
            spans.extend(_without_reasoning(text, start, end))
        else:
            spans.append((start, end))
    return spans


def _refuse_control_text(conversation: Conversation, tools: list | None, markers: TemplateMarkers) -> None:
    """Reject a sample whose messages or tool schemas contain the template's control text (it would forge turns)."""
    for position, message in enumerate(conversation.messages):
        for field, value in message.texts():
            for control in markers.control_strings:
                if control in value:
                    where = "" if field == "content" else f" in {field}"
                    raise SampleRejected(
                        RejectReason.CONTROL_TOKEN_IN_CONTENT,
                        f"message {position} ({message.role}) contains the chat-template control text "
                        f"{control!r}{where}",
                    )
    if tools:
        schema = json.dumps(tools, ensure_ascii=False, default=str)
        for control in markers.control_strings:
            if control in schema:
                raise SampleRejected(
                    RejectReason.CONTROL_TOKEN_IN_CONTENT,
                    f"the tools contain the chat-template control text {control!r}",
                )


def _without_reasoning(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Split a turn's span around a leading <think>...</think> block (and the whitespace after it)."""
    lead = start
    while lead < end and text[lead] in " \n":
        lead += 1
    if not text.startswith(THINK_OPEN, lead):
        return [(start, end)]
    close = text.find(THINK_CLOSE, lead, end)
    if close < 0:
        return [(start, end)]
    answer = close + len(THINK_CLOSE)
    while answer < end and text[answer] in " \n":
        answer += 1
    return [span for span in ((start, lead), (answer, end)) if span[1] > span[0]]


def tokenize_rendered(
    rendered: Sequence[RenderedConversation], tokenizer, max_length: int
) -> list[TokenizedConversation]:
    """Tokenise a batch of rendered texts in one call to the fast tokenizer and build the masks."""
    encoded = tokenizer(
        [r.text for r in rendered],
        add_special_tokens=False,  # the template already wrote every special token it wants
        return_offsets_mapping=True,
        return_attention_mask=False,
    )
    results = []
    for item, ids, offsets in zip(rendered, encoded["input_ids"], encoded["offset_mapping"]):
        ids_array = np.asarray(ids, dtype=np.int32)
        starts = np.asarray([start for start, _ in offsets], dtype=np.int64)
        mask = np.zeros(len(ids_array), dtype=np.uint8)
        for span_start, span_end in item.supervised:
            mask[(starts >= span_start) & (starts < span_end)] = 1
        truncated = len(ids_array) > max_length
        results.append(TokenizedConversation(ids_array[:max_length], mask[:max_length], truncated))
    return results


def _special_strings(tokenizer) -> set[str]:
    strings = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(token, "special", False):
            strings.add(str(token))
    return strings


def template_fingerprint(tokenizer) -> str:
    """A short hash of the chat template text, for provenance in summaries and manifests."""
    template = tokenizer.chat_template
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
