"""A small byte-level BPE tokenizer for the demo model, with Qwen3- and Llama-3-style chat templates.

Real target tokenizers cannot be downloaded here, so we train one on the generated
demo conversations.  It mirrors what matters about Qwen3's tokenizer for
hidden-state extraction: byte-level BPE (lossless round-trip of any text), ChatML
special tokens, ``<think>``/``</think>`` as ordinary added tokens, no BOS, and a chat
template that drops reasoning from turns before the last user query and renders tool schemas,
tool calls and tool responses the way Qwen3's does.  The Llama-3
variant gives the tests a second, structurally different template.

Training is deterministic without pinning threads: ``BpeTrainer`` only sums word
and pair counts (order-independent), sorts the initial alphabet, and breaks ties
between equally frequent pairs by the pair's token ids, so the merges are a pure
function of the corpus' word counts.  (Verified: identical tokenizer.json with
RAYON_NUM_THREADS=1/2/4, TOKENIZERS_PARALLELISM=false, and a shuffled corpus.)
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from hsx_dagster.core.inputs import THINK_CLOSE, THINK_OPEN

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
THINK_TOKENS = (THINK_OPEN, THINK_CLOSE)

# Qwen3's chat template, function calling included: with ``tools`` a system block lists the tool
# schemas (one JSON per line inside ``<tools>``, after the system prompt); an assistant turn writes its
# ``tool_calls`` as ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` blocks after its text
# (arguments given as a JSON string are written as given, objects through ``tojson``); tool messages
# become user turns wrapping ``<tool_response>`` blocks, consecutive ones sharing a turn.  Reasoning
# is taken from ``reasoning_content`` or split off ``<think>...</think>``; it is kept only for
# assistant turns after the last real user query (earlier turns are rendered as the model saw them
# at inference time: answer only).  Content may be a string, null, or a list of text parts (written
# one after another, as Qwen3-VL-family templates do).
QWEN3_STYLE_CHAT_TEMPLATE = """\
{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if item.type == 'text' %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
        '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- set text = render_content(message.content) %}
    {%- if ns.multi_step_tool and message.role == 'user'
        and not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = render_content(message.content) %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
            {{- content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def _special(token: str) -> AddedToken:
    return AddedToken(token, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)


def train_demo_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train the demo byte-level BPE on ``texts`` (in order) and wrap it as a HF tokenizer.

    ``vocab_size`` counts the five added tokens, so ``len(tokenizer) == vocab_size``
    unless the corpus runs out of merges first.  Regex pre-tokenization means BPE
    merges never cross word boundaries, and the byte-level decoder makes
    ``decode(encode(text)) == text`` for any string.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(THINK_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    # Like Qwen: specials and think tags come after the learned vocabulary.
    bpe.add_special_tokens([_special(t) for t in SPECIAL_TOKENS])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        unk_token=None,
        bos_token=None,
        chat_template=QWEN3_STYLE_CHAT_TEMPLATE,
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike[str]) -> None:
    """Save with the chat template inside tokenizer_config.json, as Qwen3 checkpoints ship it."""
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
