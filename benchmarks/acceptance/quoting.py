"""Does the target quote? Its answers to the held-out prompts that paste a function's documentation, against the
reference answer (the name and the first paragraph, quoted from the prompt):

    python -m benchmarks.acceptance.quoting [--target data/acceptance/bench] [--limit 40]

prints, as JSON, the teacher-forced accuracy of the target's argmax on the reference answer's tokens (the reference
fed as context) and how many of its greedy tokens match the reference's from the start (out of ``--tokens``; the
chat template's empty reasoning block, six tokens, counts). A target that copies from the prompt scores near 1 and
the whole budget; one that recalls a memorised docstring under a near name loses the thread within the name. What
separates a drafter that reads the target's states from one that reads tokens is this copying (``corpus.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.acceptance.target import DEFAULT_OUT, HELD_OUT_FILE, MODEL_DIR


def pasted_prompts(path: Path) -> list[dict]:
    """The held-out prompts of documented functions whose reference quotes the prompt (``corpus._summary_chat``:
    `` `name`: `` and a paragraph pasted in the request)."""
    picked = []
    for line in path.read_text(encoding="utf-8").splitlines():
        prompt = json.loads(line)
        reference, asked = prompt["reference"] or "", prompt["messages"][-1]["content"]
        if prompt["id"].startswith("python:") and "`: " in reference and reference.split("`: ", 1)[1] in asked:
            picked.append(prompt)
    return picked


def quoting(target: Path, limit: int, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target / MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(target / MODEL_DIR).eval()
    prompts = pasted_prompts(target / HELD_OUT_FILE)[:limit]
    accuracy, matched = [], []
    with torch.no_grad():
        for prompt in prompts:
            asked = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
            whole = tokenizer.apply_chat_template(
                [*prompt["messages"], {"role": "assistant", "content": prompt["reference"]}], tokenize=False
            )
            ids = tokenizer(whole, add_special_tokens=False, return_tensors="pt").input_ids
            start = len(tokenizer(asked, add_special_tokens=False).input_ids)
            predicted = model(input_ids=ids).logits[0, start - 1 : -1].argmax(-1)
            accuracy.append(float((predicted == ids[0, start:]).float().mean()))
            context = ids[:, :start]
            greedy = model.generate(context, attention_mask=torch.ones_like(context), max_new_tokens=tokens,
                                    do_sample=False)[0, start:].tolist()  # fmt: skip
            reference = ids[0, start : start + tokens].tolist()
            same = next((i for i, (a, b) in enumerate(zip(greedy, reference)) if a != b), min(len(greedy), tokens))
            matched.append(same)
    return {
        "target": str(target),
        "prompts": len(prompts),
        "teacher_forced_accuracy": round(sum(accuracy) / max(1, len(accuracy)), 3),
        "greedy_matching_prefix": round(sum(matched) / max(1, len(matched)), 1),
        "of_tokens": tokens,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acceptance.quoting", description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=DEFAULT_OUT / "bench", help="a folder target.py built")
    parser.add_argument("--limit", type=int, default=40, help="the first N pasted held-out prompts")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared")
    args = parser.parse_args(argv)
    print(json.dumps(quoting(args.target, args.limit, args.tokens), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
