"""The acceptance benchmark's commands (issue #40), CI-sized, on a tiny dense Llama target (8 layers, random weights:
on such a target acceptance means little, so only what cannot be noise is asserted):

- drafters trained by speculators' own EAGLE-3 and DFlash code on our export (``benchmarks.acceptance.train``) are
  saved in speculators' format and load through speculators' own ``SpeculatorModel.from_pretrained`` (the measure
  loads them so); a second training of the same inputs, budget and seed keeps the checkpoint;
- in greedy speculative decoding (``benchmarks.acceptance.measure``) every decode equals the target's plain greedy
  decoding, tau >= 1, acceptance never rises with the draft position, and the loop drafts exactly what speculators'
  own forward drafts from the same features (``--check-forward``);
- a drafter that proposes the target's own greedy tokens (the oracle) gives tau = k + 1 and acceptance 1 at every
  position: the loop's bookkeeping (cache crops, acceptance, the bonus token) loses nothing.

Whether features taken one layer off cost tau is left to the benchmark on a trained target: on a random one the
difference is noise.
"""

import itertools
import json
from pathlib import Path

import pytest

from hsx_dagster.core.export import export_speculators
from hsx_dagster_tests.end_to_end.trainers.env import run_trainer_python
from hsx_dagster_tests.support.helpers import build_drafter_dataset

pytestmark = pytest.mark.slow  # an extraction, trainings and decodes in the trainer environment: minutes on 2 cores

PROMPTS = 3
BUDGET = ["--max-new-tokens", 16, "--limit", PROMPTS]


@pytest.fixture(scope="module")
def case(demo_model_dir, small_inputs, demo_conversations, tmp_path_factory) -> dict[str, Path]:
    """A tiny dense target, an export of the small demo inputs made from it, and prompts it never saw (OpenAI and
    ShareGPT lines)."""
    from hsx_dagster.demo.model import build_tiny_model

    out = tmp_path_factory.mktemp("acceptance")
    build_tiny_model(out / "target", demo_model_dir, arch="llama", num_layers=8, hidden_size=64, seed=3)
    dataset = build_drafter_dataset([small_inputs], out / "target", out / "data", layer_ids=[1, 3, 4, 7],
                                    shards=("shard-00",), val_fraction=0.1)  # fmt: skip
    export = export_speculators(dataset / "drafter", dataset / "tokenized", out / "export").path
    seen = small_inputs.read_text()
    unseen = [c for c in demo_conversations if json.dumps({"messages": c.as_chat()}) not in seen][:PROMPTS]
    lines = [{"messages": c.as_chat()} for c in unseen[:-1]]
    sharegpt = {"user": "human", "assistant": "gpt", "system": "system"}
    lines.append(
        {"conversations": [{"from": sharegpt[m["role"]], "value": m["content"]} for m in unseen[-1].as_chat()]}
    )
    (out / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {"target": out / "target", "export": export, "prompts": out / "prompts.jsonl", "out": out}


def run(*args: object) -> str:
    done = run_trainer_python(*args, timeout=900)
    assert done.returncode == 0, f"{args[:2]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def measure(case: dict[str, Path], drafter: object, name: str, *extra: object) -> dict:
    out = case["out"] / f"measure-{name}"
    run("-m", "benchmarks.acceptance.measure", "--target", case["target"], "--drafter", drafter,
        "--prompts", case["prompts"], "--out", out, *BUDGET, *extra)  # fmt: skip
    return json.loads((out / "acceptance.json").read_text())


def test_the_oracle_drafter_is_accepted_at_every_position(case):
    result = measure(case, "oracle", "oracle", "--k", "1,4")
    for k, line in result["summary"].items():
        assert line["tau_micro"] == line["tau_macro"] == int(k) + 1, line
        assert line["acceptance_per_position"] == [1.0] * int(k), line
        assert line["lossless"] == [PROMPTS, PROMPTS], line


@pytest.mark.parametrize(
    ("algorithm", "budget"),
    [("eagle3", ["--untrained"]), ("eagle3", ["--steps", 4]), ("dflash", ["--steps", 4, "--block-size", 4])],
    ids=["eagle3-untrained", "eagle3-trained", "dflash-trained"],
)
def test_drafters_in_speculators_format_decode_losslessly(case, algorithm, budget):
    checkpoint = case["out"] / f"{algorithm}-{budget[0].strip('-')}"
    train = ["-m", "benchmarks.acceptance.train", "--export", case["export"], "--target", case["target"],
             "--algorithm", algorithm, "--out", checkpoint, "--batch-tokens", 512, *budget]  # fmt: skip
    run(*train)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["speculators_model_type"] == algorithm and (checkpoint / "model.safetensors").is_file()
    if "--untrained" in budget:  # once is enough (a process start): the same inputs, budget and seed are kept
        assert "kept" in run(*train)

    result = measure(case, checkpoint, checkpoint.name, "--k", "2,3", "--check-forward")
    summary = result["summary"]
    assert summary.pop("forward_check") == [3 * PROMPTS, 3 * PROMPTS], result["per_prompt"]
    assert list(summary) == (["3"] if algorithm == "dflash" else ["2", "3"])  # DFlash: its block (4) less the anchor
    for line in summary.values():
        assert line["lossless"] == [PROMPTS, PROMPTS], line
        assert line["tau_micro"] >= 1 and line["tau_macro"] >= 1, line
        rates = line["acceptance_per_position"]
        assert all(later <= earlier for earlier, later in itertools.pairwise(rates)), line
