"""Acceptance length of a speculators drafter in real greedy speculative decoding against its target, on any prompts
file, checked lossless against the target's plain greedy decoding.

    python -m benchmarks.acceptance.measure --target DIR --drafter CKPT --prompts FILE.jsonl [--k 3,5,7]
        [--max-new-tokens 64] [--limit N] [--feature-offset 0] --out DIR

``--drafter``: a checkpoint in speculators' format (EAGLE-3 or DFlash: its ``speculators_model_type``), or
``oracle`` (proposes the target's own greedy tokens: tau must be k + 1). Prompts: JSONL conversations, OpenAI
``messages`` or ShareGPT ``conversations``; the prompt is the conversation up to its last user turn, rendered with the
target's chat template and its generation prompt. EAGLE-3 drafts a chain of k tokens for each k; DFlash one block
(k = block size - 1). Writes ``DIR/acceptance.json``: every prompt's emitted tokens and tau per k, and a summary
(micro tau: tokens per step over all steps; macro: the mean of the prompts' tau; acceptance at each draft position;
``lossless``: [decodes equal to greedy, decodes checked]; the drafter's wall time per drafted token against a
target decoding forward on this machine, and the speedup they imply). Exits 1, naming the prompt and the first
differing position, when a decode differs from greedy. Runs where speculators is installed (the trainer
environment: docs/benchmarks.md); float32 throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.acceptance.decode import (
    DFlashProposer,
    Eagle3Proposer,
    OracleProposer,
    TargetFeatures,
    first_difference,
    greedy,
    speculative,
)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def read_prompts(path: Path) -> list[list[dict[str, str]]]:
    """Each line's conversation up to and with its last user turn, as chat messages."""
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "messages" in record:
            messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
        elif "conversations" in record:
            turns = record["conversations"]
            messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
        else:
            raise ValueError(f"{path}:{number}: neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)")
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise ValueError(f"{path}:{number}: no user turn to prompt with")
        prompts.append(messages[: users[-1] + 1])
    return prompts


def load_drafter(path: Path, target: Path) -> Any:
    """speculators' own loader, with the verifier (whose embeddings and head it reloads) set to ``target``."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    from hsx_dagster.core.model import use_attn_implementation

    config = SpeculatorModelConfig.from_pretrained(str(path))
    config.speculators_config.verifier.name_or_path = str(target)
    use_attn_implementation(config.transformer_layer_config, "eager")  # the loop passes explicit (or no) masks
    return SpeculatorModel.from_pretrained(str(path), config=config)


def positions_summary(accepted: list[int], k: int) -> list[float]:
    """Per draft position j = 1..k: the share of steps whose first j drafts were all accepted (vLLM's rate)."""
    return [sum(a >= j for a in accepted) / max(len(accepted), 1) for j in range(1, k + 1)]


def summarize(runs: list[dict[str, Any]], k: int, target_forward_s: float) -> dict[str, Any]:
    accepted = [a for run in runs for a in run["accepted"]]
    taus = [run["tau"] for run in runs if run["tau"] is not None]
    steps = len(accepted)
    micro = (sum(accepted) + steps) / max(steps, 1)
    draft_s = sum(run["draft_seconds"] for run in runs) / max(steps * k, 1)
    cost = draft_s / target_forward_s if target_forward_s else None
    return {
        "k": k,
        "tau": micro,
        "tau_micro": micro,
        "tau_macro": statistics.fmean(taus) if taus else None,  # prompts with a verification step
        "steps": steps,
        "acceptance_per_position": positions_summary(accepted, k),
        "lossless": [sum(run["equal"] for run in runs), len(runs)],
        "draft_seconds_per_token": draft_s,
        "verify_seconds_per_step": sum(run["verify_seconds"] for run in runs) / max(steps, 1),
        "target_forward_seconds": target_forward_s,
        "draft_cost_per_token": cost,  # against one target decoding forward
        # as users estimate it where a verification costs about one decoding forward (a GPU, memory-bound)
        "implied_speedup": micro / (1 + k * cost) if cost is not None else None,
        # this machine, where verifying k + 1 tokens costs more than one forward (CPU, compute-bound)
        "wall_speedup": sum(run["greedy_seconds"] for run in runs) / sum(run["seconds"] for run in runs),
    }


def forward_check(proposer: Any, target: TargetFeatures, sequence: list[int], start: int, k: int) -> list[bool]:
    """At three points of a decoded sequence: whether the loop drafts what speculators' own forward drafts."""
    from transformers import DynamicCache

    features = target.forward(sequence, DynamicCache())[1]
    checks = []
    for n in sorted({start, (start + len(sequence) - 1) // 2, len(sequence) - 1}):
        proposer.start()
        expected = proposer.speculators_forward(sequence[: n + 1], features[:n], k)
        proposer.start()
        checks.append(proposer.propose(sequence[: n + 1], features[:n], k) == expected)
    return checks


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    model = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    eos = (
        {model.config.eos_token_id}
        if isinstance(model.config.eos_token_id, int)
        else set(model.config.eos_token_id or [])
    )
    eos |= {tokenizer.eos_token_id} - {None}
    prompts = read_prompts(args.prompts)[: args.limit]
    drafter = None if args.drafter == "oracle" else load_drafter(args.drafter, args.target)
    algorithm = "oracle" if drafter is None else drafter.config.speculators_model_type
    proposer: Any = {"eagle3": Eagle3Proposer, "dflash": DFlashProposer}[algorithm](drafter) if drafter else None
    ks = [proposer.block_size - 1] if algorithm == "dflash" else [int(k) for k in args.k.split(",")]
    features = TargetFeatures(model, proposer.layer_ids if proposer else [], offset=args.feature_offset)
    per_prompt: list[dict[str, Any]] = []
    runs: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
    forwards: list[float] = []
    for index, messages in enumerate(prompts):
        rendered: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        ids = [int(token) for token in rendered["input_ids"]]
        reference = greedy(model, ids, args.max_new_tokens, eos)
        forwards += reference.forward_seconds
        record: dict[str, Any] = {"prompt": index, "prompt_tokens": len(ids), "greedy": reference.tokens, "runs": {}}
        if proposer is None:  # the oracle's proposals: greedy on past the budget and past any EOS
            continuation = greedy(model, ids, args.max_new_tokens + max(ks), eos=set()).tokens
        for k in ks:
            used = proposer or OracleProposer(continuation, len(ids))
            decoded = speculative(features, used, ids, k, args.max_new_tokens, eos)
            differs = first_difference(decoded.tokens, reference.tokens)
            run = {"tokens": decoded.tokens, "tau": decoded.tau, "accepted": decoded.accepted,
                   "equal": differs is None, "first_difference": differs, "draft_seconds": decoded.draft_seconds,
                   "verify_seconds": decoded.verify_seconds, "seconds": decoded.seconds,
                   "greedy_seconds": reference.seconds}  # fmt: skip
            if differs is not None and differs < len(reference.margins):
                run["greedy_margin_there"] = reference.margins[differs]  # top-2 logit gap: a near-tie when tiny
            record["runs"][str(k)] = run
            runs[k].append(run)
        if args.check_forward and proposer is not None:
            record["forward_check"] = forward_check(proposer, features, ids + reference.tokens, len(ids), ks[-1])
        per_prompt.append(record)
    forward_s = statistics.fmean(forwards) if forwards else 0.0
    summary: dict[str, Any] = {str(k): summarize(runs[k], k, forward_s) for k in ks}
    if args.check_forward and proposer is not None:
        checks = [ok for record in per_prompt for ok in record["forward_check"]]
        summary["forward_check"] = [sum(checks), len(checks)]
    return {"target": str(args.target), "drafter": str(args.drafter), "algorithm": algorithm,
            "prompts_file": str(args.prompts), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "feature_offset": args.feature_offset, "summary": summary, "per_prompt": per_prompt}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--drafter", required=True, help="a speculators checkpoint folder, or 'oracle'")
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL conversations (OpenAI or ShareGPT)")
    parser.add_argument("--k", default="3,5,7", help="EAGLE-3: draft lengths, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    parser.add_argument("--feature-offset", type=int, default=0, help="take layer k + offset (a deliberate error)")
    parser.add_argument("--check-forward", action="store_true",
                        help="also check that the loop drafts what speculators' own forward drafts")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.target = args.target.resolve()
    args.drafter = args.drafter if args.drafter == "oracle" else Path(args.drafter).resolve()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args)
    # the wall times are this machine's at this load: record both with them
    result["machine"] = {"threads": torch.get_num_threads(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance.json").write_text(json.dumps(result, indent=2))
    check = result["summary"].pop("forward_check", None)
    for k, line in result["summary"].items():
        brief = {key: line[key] for key in ("tau_micro", "tau_macro", "acceptance_per_position", "lossless")}
        print(f"{result['algorithm']} k={k}: {json.dumps(brief)}")
    unequal = [(r["prompt"], k, run["first_difference"], run.get("greedy_margin_there"))
               for r in result["per_prompt"] for k, run in r["runs"].items() if not run["equal"]]  # fmt: skip
    if check is not None:
        result["summary"]["forward_check"] = check
        (args.out / "acceptance.json").write_text(json.dumps(result, indent=2))
        print(f"drafts equal to speculators' own forward: {check[0]} of {check[1]}")
    if check is not None and check[0] != check[1]:
        print("the loop's drafts differ from speculators' own forward: see forward_check per prompt", file=sys.stderr)
        sys.exit(1)
    if unequal:
        for prompt, k, position, margin in unequal:
            print(f"NOT LOSSLESS: prompt {prompt} (line order in {args.prompts}), k={k}: the decode differs from "
                  f"greedy first at generated token {position} (greedy's top-2 logit margin there: {margin})",
                  file=sys.stderr)  # fmt: skip
        sys.exit(1)


if __name__ == "__main__":
    main()
