"""A second chat template for tests that must not assume ChatML: the demo tokenizer's BPE with Llama-3's control
tokens, BOS baked into the template and ``eos_token='<|eot_id|>'``."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hsx_dagster.demo.tokenizer import save_tokenizer

LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# Llama-3-Instruct layout: BOS in the template, headers around the role, trimmed content.
LLAMA3_STYLE_CHAT_TEMPLATE = """\
{{- '<|begin_of_text|>' }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def make_llama3_style_tokenizer(
    base_tokenizer_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> PreTrainedTokenizerBase:
    """Save a copy of the demo tokenizer with Llama-3 special tokens and chat template.

    Same BPE merges, different control tokens, BOS baked into the template and
    ``eos_token='<|eot_id|>'``: a second template for tests that must not assume ChatML.
    """
    tokenizer = AutoTokenizer.from_pretrained(base_tokenizer_dir)
    tokenizer.add_special_tokens(
        {"extra_special_tokens": list(LLAMA3_SPECIAL_TOKENS)}, replace_extra_special_tokens=False
    )
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = LLAMA3_STYLE_CHAT_TEMPLATE
    save_tokenizer(tokenizer, out_dir)
    return tokenizer
