"""Loss-mask exactness: decoding the supervised tokens of a sample gives back precisely the assistant
turns as the template rendered them, each with its end-of-turn token, and nothing else.

The expected turns are computed here independently of the code under test, from each template's
documented rules (Qwen3: earlier reasoning dropped, newlines normalised; Llama 3: trimmed).
"""

import numpy as np
import pytest

from hsx_dagster.core.inputs import (
    Conversation,
    Message,
    RejectReason,
    SampleRejected,
    TemplateError,
    TemplateMarkers,
    render,
    tokenize_rendered,
)
from hsx_dagster_tests.support.sweeps import densities


def qwen3_expected_turns(messages: tuple[Message, ...], thinking: str) -> list[str]:
    last_user = max(i for i, m in enumerate(messages) if m.role == "user")
    turns = []
    for index, message in enumerate(messages):
        if message.role != "assistant":
            continue
        content, reasoning = message.content, ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if thinking == "strip":
            reasoning = ""
        if index > last_user and (index == len(messages) - 1 or reasoning):
            think = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
            text = (think if thinking != "exclude_from_loss" else "") + content.lstrip("\n")
        else:
            text = content
        turns.append(text + "<|im_end|>")
    return turns


def llama3_expected_turns(messages: tuple[Message, ...], thinking: str) -> list[str]:
    return [m.content.strip() + "<|eot_id|>" for m in messages if m.role == "assistant"]


def supervised_runs(tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    runs, current = [], []
    for token, flag in zip(ids.tolist(), mask.tolist()):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False) for run in runs]


def check_exact(conversations, tokenizer, expected_turns, thinking):
    markers = TemplateMarkers.probe(tokenizer)
    rendered = [render(c, tokenizer, markers, thinking) for c in conversations]
    tokenized = tokenize_rendered(rendered, tokenizer, max_length=1_000_000)
    for conversation, item, tokens in zip(conversations, rendered, tokenized):
        expected = expected_turns(conversation.messages, thinking)
        got = supervised_runs(tokenizer, tokens.input_ids, tokens.loss_mask)
        assert got == expected, f"{conversation.source} {conversation.location}"
        # Everything outside the mask decodes to the rest of the text: nothing lost, nothing added.
        assert (
            tokenizer.decode(tokens.input_ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            == item.text
        )
    return rendered


@densities()
@pytest.mark.parametrize("thinking", ["keep", "strip", "exclude_from_loss"])
def test_qwen3_template_mask_exact_on_the_demo_samples(demo_conversations, demo_tokenizer, thinking, every):
    conversations = demo_conversations[::every]
    rendered = check_exact(conversations, demo_tokenizer, qwen3_expected_turns, thinking)
    if thinking == "keep":
        # The demo exercises the template's rewriting: some earlier reasoning is dropped from the text
        # (more than 50 times in the whole corpus, in proportion in every n-th sample).
        dropped = sum(
            1
            for c, r in zip(conversations, rendered)
            for m in c.messages
            if m.role == "assistant"
            and "</think>" in m.content
            and m.content.split("</think>")[0].split("<think>")[-1].strip() not in r.text
        )
        assert dropped > 50 / every


@densities()
@pytest.mark.parametrize("thinking", ["keep", "strip"])
def test_llama3_template_mask_exact_on_the_demo_samples(demo_conversations, llama3_tokenizer, thinking, every):
    expected = llama3_expected_turns if thinking == "keep" else None
    if thinking == "strip":

        def expected(messages, _):
            from hsx_dagster.core.inputs import strip_reasoning

            return [strip_reasoning(m.content).strip() + "<|eot_id|>" for m in messages if m.role == "assistant"]

    check_exact(demo_conversations[::every], llama3_tokenizer, expected, thinking)


def test_markers_learnt_from_the_templates(demo_tokenizer, llama3_tokenizer):
    qwen = TemplateMarkers.probe(demo_tokenizer)
    assert (qwen.assistant_header, qwen.end_of_turn) == ("<|im_start|>assistant\n", "<|im_end|>")
    llama = TemplateMarkers.probe(llama3_tokenizer)
    assert (llama.assistant_header, llama.end_of_turn) == (
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    )


def conversation(*pairs):
    return Conversation("mem", 0, "line 1", tuple(Message(role, content) for role, content in pairs))


def test_truncation_cuts_the_mask_with_the_ids(demo_tokenizer):
    markers = TemplateMarkers.probe(demo_tokenizer)
    item = render(
        conversation(("user", "question " * 50), ("assistant", "answer " * 50)), demo_tokenizer, markers, "keep"
    )
    (full,) = tokenize_rendered([item], demo_tokenizer, max_length=10_000)
    (cut,) = tokenize_rendered([item], demo_tokenizer, max_length=len(full.input_ids) - 20)
    assert cut.truncated and not full.truncated
    assert np.array_equal(cut.input_ids, full.input_ids[: len(cut.input_ids)])
    assert np.array_equal(cut.loss_mask, full.loss_mask[: len(cut.input_ids)])


def test_loss_mask_all_covers_the_whole_rendered_text(demo_tokenizer):
    markers = TemplateMarkers.probe(demo_tokenizer)
    chat = conversation(("system", "be brief"), ("user", "a question"), ("assistant", "an answer"))
    (assistant,) = tokenize_rendered([render(chat, demo_tokenizer, markers, "keep")], demo_tokenizer, 10_000)
    item = render(chat, demo_tokenizer, markers, "keep", loss_mask="all")
    (everything,) = tokenize_rendered([item], demo_tokenizer, 10_000)
    assert np.array_equal(everything.input_ids, assistant.input_ids)
    assert everything.loss_mask.all() and 0 < assistant.loss_mask.sum() < len(assistant.loss_mask)
    # a template that loses an assistant turn still rejects the sample, whatever the mask covers
    with pytest.raises(SampleRejected):
        render(
            conversation(("user", "q"), ("assistant", "a"), ("assistant", "b")),
            demo_tokenizer,
            TemplateMarkers("<|im_start|>assistant\n", "<nope>", markers.control_strings, markers.content_parts),
            "keep",
            loss_mask="all",
        )


def test_control_tokens_in_content_are_rejected(demo_tokenizer):
    markers = TemplateMarkers.probe(demo_tokenizer)
    sneaky = conversation(("user", "hi <|im_end|> there"), ("assistant", "ok"))
    with pytest.raises(SampleRejected) as caught:
        render(sneaky, demo_tokenizer, markers, "keep")
    assert caught.value.reason == RejectReason.CONTROL_TOKEN_IN_CONTENT
    assert "message 0 (user)" in caught.value.detail


def test_tokenizer_without_chat_template_is_refused(demo_tokenizer):
    template = demo_tokenizer.chat_template
    try:
        demo_tokenizer.chat_template = None
        with pytest.raises(TemplateError, match="has no chat template"):
            TemplateMarkers.probe(demo_tokenizer, name="tokenizer at /models/x")
    finally:
        demo_tokenizer.chat_template = template


def test_template_that_rejects_a_shape_becomes_a_reject(demo_tokenizer):
    markers = TemplateMarkers.probe(demo_tokenizer)
    template = demo_tokenizer.chat_template
    try:
        demo_tokenizer.chat_template = (
            "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
            "{{ raise_exception('system message must come first') }}{% endif %}"
            "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
        late_system = conversation(("user", "a"), ("system", "b"), ("assistant", "c"))
        with pytest.raises(SampleRejected) as caught:
            render(late_system, demo_tokenizer, markers, "keep")
        assert caught.value.reason == RejectReason.TEMPLATE_ERROR
        assert "system message must come first" in caught.value.detail
    finally:
        demo_tokenizer.chat_template = template
