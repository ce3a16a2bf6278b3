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
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hsx_dagster.core.inputs.conversations import Conversation, Message, RejectReason

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


@dataclass(frozen=True)
class TemplateMarkers:
    assistant_header: str
    end_of_turn: str
    control_strings: tuple[str, ...]

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
        controls = {s for s in special if s} | {header.strip(), end_of_turn.strip()}
        return cls(header, end_of_turn, tuple(sorted(s for s in controls if s)))


@dataclass(frozen=True)
class RenderedConversation:
    text: str
    supervised: list[tuple[int, int]]  # character spans whose tokens get loss 1


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool


def sample_id_of(messages: Sequence[Message]) -> int:
    """A stable 63-bit id from the conversation's content: the same conversation always gets the same
    id, whatever file or position it comes from, and exact duplicates are recognised."""
    canonical = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(canonical.encode("utf-8"), digest_size=8).digest(), "big") >> 1


def strip_reasoning(content: str) -> str:
    """The answer part of an assistant message, as Qwen3-style templates keep it for earlier turns."""
    if THINK_CLOSE in content:
        return content.split(THINK_CLOSE)[-1].lstrip("\n")
    return content


def render(conversation: Conversation, tokenizer, markers: TemplateMarkers, thinking: str) -> RenderedConversation:
    """Render with the chat template and locate the characters of each assistant turn.

    ``thinking``: 'keep' supervises reasoning wherever the template renders it; 'strip' removes it
    from every assistant turn before rendering; 'exclude_from_loss' renders it but leaves it out of
    the loss.
    """
    messages = conversation.messages
    for position, message in enumerate(messages):
        for control in markers.control_strings:
            if control in message.content:
                raise SampleRejected(
                    RejectReason.CONTROL_TOKEN_IN_CONTENT,
                    f"message {position} ({message.role}) contains the chat-template control text {control!r}",
                )
    chat = [
        {
            "role": m.role,
            "content": strip_reasoning(m.content) if thinking == "strip" and m.role == "assistant" else m.content,
        }
        for m in messages
    ]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception as exc:  # a template may raise on shapes it does not support (e.g. role order)
        raise SampleRejected(RejectReason.TEMPLATE_ERROR, f"chat template failed: {exc}") from None

    expected = sum(1 for m in messages if m.role == "assistant")
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
    return RenderedConversation(text, spans)


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
