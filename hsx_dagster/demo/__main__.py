"""``python -m hsx_dagster.demo build [--out DIR] [--force]``: build the demo data (idempotent)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from hsx_dagster.demo.build import (
    AGENTIC_PATH,
    AGENTIC_SHAREGPT_PATH,
    MODEL_PATH,
    OPENAI_PATH,
    SHAREGPT_PATH,
    STAMP_NAME,
    build_demo,
    is_up_to_date,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hsx_dagster.demo", description="Build the offline demo data set and tiny target model."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="generate conversations, tokenizer and tiny model")
    build.add_argument("--out", type=Path, default=Path("data"), help="output directory (default: data)")
    build.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    args = parser.parse_args(argv)

    out: Path = args.out
    if not args.force and is_up_to_date(out):
        print(f"demo data in {out} is up to date ({out / STAMP_NAME}); use --force to rebuild")
        return 0

    from transformers.utils import logging as hf_logging  # deferred: importing transformers takes seconds

    hf_logging.disable_progress_bar()
    result = build_demo(out, force=True)
    stats = result.stamp["tokens_per_conversation"]
    print(f"built demo data in {out} in {result.seconds:.1f}s:")
    print(f"  {out / SHAREGPT_PATH}")
    print(f"  {out / OPENAI_PATH}")
    print(f"  {out / AGENTIC_PATH}")
    print(f"  {out / AGENTIC_SHAREGPT_PATH}")
    print(
        f"  {out / MODEL_PATH}/  (tokenizer {result.stamp['tokenizer_size']} tokens, "
        f"model vocab {result.stamp['model_vocab_size']})"
    )
    print(
        f"  tokens/conversation: mean {stats['mean']}, median {stats['median']}, p99 {stats['p99']}, "
        f"max {stats['max']}, >2000: {stats['over_2000']} (n={stats['count']})"
    )
    print("  hidden-state norms per layer: " + ", ".join(f"{n:.2f}" for n in result.hidden_state_norms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
