"""A target that has learned: a dense Llama trained from scratch on the CPU on ``corpus.py``'s conversations.

``python -m benchmarks.acceptance.target [--size ci|bench] [--out DIR]`` (``make acceptance-target``) writes

    DIR/model/          the target: transformers' LlamaForCausalLM + a byte-level BPE trained here, with the
                        demo's Qwen3-style chat template (loaded back through ``from_pretrained(path)`` like any model)
    DIR/train.jsonl     the training conversations (OpenAI messages): what the target trained on, and the drafters'
                        inputs (the data variants regenerate their answers with the target)
    DIR/heldout.jsonl   the held-out prompts (turns up to the last user turn, the reference answer beside): neither
                        the target nor any drafter trains on them
    DIR/report.json     the recipe, training figures, held-out perplexity against a unigram baseline, and greedy
                        answers' distinct tokens per 100
    DIR/.target-stamp.json  written last: the recipe's digest; a build whose stamp matches is not redone

Deterministic: one seed fixes the initial weights and the order of the training windows, the tokenizer's merges are a
pure function of the corpus (hsx_dagster/demo/tokenizer.py), and the loop runs on a fixed number of threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks import REPO
from benchmarks.acceptance.corpus import Item, build_items, held_out_prompts, write_jsonl
from benchmarks.acceptance.stamps import stamp_digest

BUILDER_VERSION = 1  # bump when a change here changes the bytes built
STAMP_NAME = ".target-stamp.json"
MODEL_DIR, TRAIN_FILE, HELD_OUT_FILE, REPORT_FILE = "model", "train.jsonl", "heldout.jsonl", "report.json"
DEFAULT_OUT = REPO / "data" / "acceptance"


@dataclass(frozen=True)
class Recipe:
    """Everything the target's bytes depend on besides the corpus and the library versions."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    seq_len: int
    batch_size: int
    steps: int
    learning_rate: float
    warmup_steps: int
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 2


# ci: built by the test suite and CI in a couple of minutes, on one thread (CI builds it beside the tests: a second
# thread waiting on a core someone else holds made the build seven times slower there); bench: what
# `make bench-acceptance` measures against
# (about 15 minutes on 2 quiet cores: 1,600 steps, enough for its held-out perplexity to halve as it learns to quote
# the pasted documentation, which 450 steps did not reach). Both have 8 decoder layers: eagle3 takes [1, 3, 4],
# dflash-5 [1, 2, 3, 4, 5].
SIZES = {
    "ci": Recipe(hidden_size=64, num_layers=8, vocab_size=1536, seq_len=128, batch_size=16, steps=200,
                 learning_rate=3e-3, warmup_steps=20, threads=1),
    "bench": Recipe(hidden_size=128, num_layers=8, vocab_size=2048, seq_len=256, batch_size=8, steps=1600,
                    learning_rate=3e-3, warmup_steps=80),
}  # fmt: skip
GREEDY_PROMPTS = 32  # held-out prompts answered greedily for the report
GREEDY_TOKENS = 100


def _digest(recipe: Recipe, items: Sequence[Item]) -> str:
    return stamp_digest(
        {
            "builder_version": BUILDER_VERSION,
            "recipe": asdict(recipe),
            "items": [item.record() for item in items],
            "versions": {name: version(name) for name in ("torch", "transformers", "tokenizers")},
        }
    )


def is_up_to_date(out: Path, digest: str) -> bool:
    stamp = out / STAMP_NAME
    if not stamp.is_file() or not (out / MODEL_DIR / "config.json").is_file():
        return False
    return bool(json.loads(stamp.read_text(encoding="utf-8")).get("digest") == digest)


def _render(tokenizer: Any, items: Sequence[Item]) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template(item.messages, tokenize=False) for item in items]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _make_model(recipe: Recipe, tokenizer: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from hsx_dagster.demo.model import make_config

    config = make_config(
        "llama",
        vocab_size=-(-len(tokenizer) // 64) * 64,
        num_layers=recipe.num_layers,
        hidden_size=recipe.hidden_size,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    config.initializer_range = 0.02  # trained from scratch: GPT-style init, not the demo's spread-out random states
    torch.manual_seed(recipe.seed)
    return LlamaForCausalLM(config)


def train(recipe: Recipe, stream: Any, model: Any, log: Any) -> dict[str, Any]:
    """Next-token training on random windows of the packed token ``stream``; returns the training figures."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    generator = torch.Generator().manual_seed(recipe.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.learning_rate,
        betas=(0.9, 0.95),
    )
    schedule = get_cosine_schedule_with_warmup(optimizer, recipe.warmup_steps, recipe.steps)
    model.train()
    start, losses = time.perf_counter(), []
    offsets = torch.arange(recipe.seq_len + 1)
    for step in range(1, recipe.steps + 1):
        starts = torch.randint(0, len(stream) - recipe.seq_len - 1, (recipe.batch_size,), generator=generator)
        window = stream[starts[:, None] + offsets]
        logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == recipe.steps:
            elapsed = time.perf_counter() - start
            log(
                f"step {step}/{recipe.steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                f"{step / elapsed:.2f} steps/s, {elapsed:.0f} s, load {os.getloadavg()[0]:.2f}"
            )
    model.eval()
    elapsed = time.perf_counter() - start
    return {
        "wall_s": round(elapsed, 1),
        "steps_per_s": round(recipe.steps / elapsed, 3),
        "tokens_seen": recipe.steps * recipe.batch_size * recipe.seq_len,
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
    }


def held_out_perplexity(model: Any, sequences: Sequence[list[int]], unigram: Any) -> dict[str, float]:
    """Per-token perplexity of the held-out conversations (every token after the first), the model's against the
    training stream's add-one unigram distribution on the same tokens."""
    import torch

    nll, unigram_nll, count = 0.0, 0.0, 0
    with torch.no_grad():
        for ids in sequences:
            tensor = torch.tensor([ids])
            logits = model(input_ids=tensor).logits[0, :-1].float()
            targets = tensor[0, 1:]
            nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            unigram_nll += float(-unigram[targets].sum())
            count += len(targets)
    return {
        "tokens": count,
        "perplexity": round(math.exp(nll / count), 3),
        "unigram_perplexity": round(math.exp(unigram_nll / count), 3),
    }


def greedy_answers(model: Any, tokenizer: Any, prompts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Greedy answers to held-out prompts: distinct tokens per 100 generated (the mean over answers, each scaled to
    100 tokens), the share of 4-grams that repeat an earlier one in the same answer, how many ended by themselves."""
    import torch

    distinct, repeated, ended, samples = [], [], 0, []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, return_tensors="pt")
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            output = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS, do_sample=False
            )
            new = output[0, ids.shape[1] :].tolist()
            if new and new[-1] == tokenizer.eos_token_id:
                ended += 1
                new = new[:-1]
            if not new:
                continue
            distinct.append(100 * len(set(new)) / len(new))
            grams = [tuple(new[i : i + 4]) for i in range(len(new) - 3)]
            repeated.append(1 - len(set(grams)) / len(grams) if grams else 0.0)
            if len(samples) < 3:
                samples.append({"prompt": prompt["messages"][-1]["content"], "answer": tokenizer.decode(new)})
    return {
        "prompts": len(prompts),
        "distinct_tokens_per_100": round(sum(distinct) / max(1, len(distinct)), 1),
        "repeated_4gram_share": round(sum(repeated) / max(1, len(repeated)), 3),
        "ended_with_eos": ended,
        "samples": samples,
    }


def build_target(out: Path, size: str, log: Any = print) -> dict[str, Any]:
    """Build the target of ``SIZES[size]`` into ``out`` (unless the stamp matches); returns the report."""
    import torch

    from hsx_dagster.demo.tokenizer import save_tokenizer, train_demo_tokenizer

    recipe = SIZES[size]
    items, sources = build_items()
    digest = _digest(recipe, items)
    if is_up_to_date(out, digest):
        log(f"target in {out} is up to date ({out / STAMP_NAME})")
        return dict(json.loads((out / REPORT_FILE).read_text(encoding="utf-8")))
    (out / STAMP_NAME).unlink(missing_ok=True)
    torch.set_num_threads(recipe.threads)
    training = [item for item in items if not item.held_out]
    held_out = [item for item in items if item.held_out]
    write_jsonl(out / TRAIN_FILE, training)
    (out / HELD_OUT_FILE).write_text(
        "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in held_out_prompts(held_out)), encoding="utf-8"
    )

    texts = [tokenizer_text(item) for item in training]
    tokenizer = train_demo_tokenizer(texts, vocab_size=recipe.vocab_size)
    stream = torch.tensor([t for ids in _render(tokenizer, training) for t in ids])
    counts = torch.bincount(stream, minlength=len(tokenizer)).double() + 1
    unigram = (counts / counts.sum()).log()
    model = _make_model(recipe, tokenizer)
    parameters = sum(p.numel() for p in model.parameters())
    log(f"{size} target: {parameters:,} parameters, {len(stream):,} training tokens, {len(held_out)} held out")
    training_figures = train(recipe, stream, model, log)

    model_dir = out / MODEL_DIR
    shutil.rmtree(model_dir, ignore_errors=True)
    model.save_pretrained(model_dir)
    save_tokenizer(tokenizer, model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # what every consumer of the target runs
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = held_out_prompts(held_out)
    report = {
        "size": size,
        "recipe": asdict(recipe),
        "digest": digest,
        "model": {
            "architecture": type(reloaded).__name__,
            "parameters": parameters,
            "layers": recipe.num_layers,
            "hidden_size": recipe.hidden_size,
            "vocab_size": reloaded.config.vocab_size,
            "tokenizer_size": len(tokenizer),
        },
        "corpus": {
            **sources,
            "training_items": len(training),
            "held_out_items": len(held_out),
            "training_stream_tokens": len(stream),
        },
        "training": training_figures,
        "held_out": held_out_perplexity(reloaded, _render(tokenizer, held_out), unigram),
        "greedy": greedy_answers(reloaded, tokenizer, prompts[:GREEDY_PROMPTS]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "threads": recipe.threads},
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / STAMP_NAME).write_text(json.dumps({"digest": digest, "size": size}) + "\n", encoding="utf-8")
    return report


def tokenizer_text(item: Item) -> str:
    """What the tokenizer learns its merges from: the turns' texts (the template's control tokens are added ones)."""
    return "\n".join(message["content"] for message in item.messages)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acceptance.target", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_OUT}/<size>")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = args.out or DEFAULT_OUT / args.size
    report = build_target(out, args.size, log=lambda line: print(line, flush=True))
    print(json.dumps({k: report[k] for k in ("model", "corpus", "training", "held_out", "greedy")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
