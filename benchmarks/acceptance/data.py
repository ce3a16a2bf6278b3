"""The drafters' data, made the way users make it: a settings file per variant and the Dagster definitions run from
the shell as `make demo` runs them (the `dagster` CLI over `hsx_dagster.definitions`, shard runs through
`python -m hsx_dagster.launch`, a Dagster instance of the variant's own).

    python -m benchmarks.acceptance.data --target DIR --variant NAME [--out DIR] [--conversations N]

The target (``target.py``'s folder) regenerates the answers of its training conversations greedily
(`regenerated_conversations`, local backend, as the EAGLE-3 and DFlash recipes do), then `tokenized_dataset`,
`hidden_states` (speculators' layers: `model.layers: speculators`, what its EAGLE-3 and DFlash drafters read by
default), `drafter_dataset` and `speculators_dataset`. Variants (the choices and mistakes users make):

    bf16                the reference: bfloat16 states
    fp8                 storage dtype float8_e4m3
    shifted_layers      Hugging Face hidden_states[i] where [i + 1] is meant: every layer stored one decoder layer too
                        early (model.layers = speculators' ids - 1), then drafter/manifest.json's layer ids rewritten
                        to the ids meant, so the export claims the correct layers (the package has no switch for
                        the bug: the benchmark makes it, here, in the open)
    all_tokens_mask     dataset.loss_mask: all (user turns and the template's markup supervised too)
    original_responses  regenerate.enabled: false (the corpus' own answers, not the target's)

Regeneration is greedy and the same for every variant that regenerates: a variant whose own `regenerated/` folder is
missing starts from a copy of the first one made (`bf16`'s where it exists), which `regenerated_conversations`
then resumes and finds complete (its store refuses a folder made with other settings or another target). Each
variant's folder gets a stamp (the settings' and the target's digests) written last: a finished variant is not
made again. Writes ``<out>/<variant>/report.json``: each step's wall time, the samples and tokens, the layers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from benchmarks import REPO
from benchmarks.acceptance.stamps import stamp_digest
from benchmarks.acceptance.target import STAMP_NAME as TARGET_STAMP, TRAIN_FILE

BUILDER_VERSION = 1  # bump when a change here changes what a variant's folder holds
VARIANTS = ("bf16", "fp8", "shifted_layers", "all_tokens_mask", "original_responses")
REGENERATING = tuple(v for v in VARIANTS if v != "original_responses")
STAMP_NAME = ".data-stamp.json"
BUILDING_NAME = ".data-building.json"  # the inputs a build under way is making: an interrupted one resumes
SPECULATORS_LAYERS = (1, 3, 4, 7)  # model.layers: speculators for 8 decoder layers: [1, N//2 - 1, N - 4, N - 1]
MAX_NEW_TOKENS = 192  # per regenerated answer: the corpus' answers are a few dozen to ~200 tokens


def variant_settings(variant: str, target: Path, inputs: Path, output_dir: Path) -> dict[str, Any]:
    """The settings file a user would write for the variant (hsx.yaml's keys; docs/configuration.md)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    layers: str | list[int] = "speculators"
    if variant == "shifted_layers":
        layers = [layer - 1 for layer in SPECULATORS_LAYERS]
    return {
        "dataset": {
            "paths": [str(inputs)],
            "max_length": 1024,
            "min_loss_tokens": 1,
            "tokenize_workers": 1,
            "loss_mask": "all" if variant == "all_tokens_mask" else "assistant",
        },
        "model": {"path": str(target / "model"), "layers": layers, "include_final": False},
        "shards": 1,
        "output_dir": str(output_dir),
        "extraction": {
            "devices": ["cpu"],
            "compute_dtype": "float32",
            "storage_dtype": "float8_e4m3" if variant == "fp8" else "bfloat16",
        },
        "drafter": {"val_fraction": 0.05, "parity_samples": 4},
        "regenerate": {
            "enabled": variant != "original_responses",
            "backend": "local",
            "temperature": 0.0,  # the target's own greedy answers: what speculative decoding will verify
            "max_tokens": MAX_NEW_TOKENS,
            "batch_size": 16,
            "turns": "all",
        },
        "export": {"speculators": True},
    }


def pick_inputs(target: Path, out: Path, conversations: int | None) -> Path:
    """The target's training conversations, or ``conversations`` of them spread evenly over the file, as JSONL in
    ``out`` (one file every variant reads, so that their regenerated answers are the same)."""
    lines = (target / TRAIN_FILE).read_text(encoding="utf-8").splitlines()
    if conversations is not None and conversations < len(lines):
        lines = [lines[i * len(lines) // conversations] for i in range(conversations)]
    path = out / f"inputs-{len(lines)}.jsonl"
    text = "".join(line + "\n" for line in lines)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return path


class Project:
    """One variant's folder: its settings file, its Dagster instance, its outputs, and the commands run on them."""

    def __init__(self, root: Path, settings: dict[str, Any], log: Any) -> None:
        self.root, self.settings, self.log = root, settings, log
        self.settings_file = root / "hsx.yaml"
        self.home = root / "dagster_home"
        self.output_dir = Path(settings["output_dir"])
        self.timings: dict[str, float] = {}

    def prepare(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / "deploy" / "local" / "dagster.yaml", self.home / "dagster.yaml")
        self.settings_file.write_text(yaml.safe_dump(self.settings, sort_keys=False), encoding="utf-8")

    def run(self, step: str, *command: str) -> None:
        """One command as a user types it, with this project's settings file and instance; fails naming the step."""
        env = {**os.environ, "HSX_CONFIG": str(self.settings_file), "DAGSTER_HOME": str(self.home)}
        bin_dir = Path(sys.executable).parent
        argv = [str(bin_dir / command[0]) if (bin_dir / command[0]).exists() else command[0], *command[1:]]
        start = time.perf_counter()
        self.log(f"[{self.root.name}] {step}: {' '.join(command)}")
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        self.timings[step] = round(time.perf_counter() - start, 1)
        (self.root / "logs").mkdir(exist_ok=True)
        (self.root / "logs" / f"{step}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
        if done.returncode != 0:
            tail = (done.stdout + done.stderr)[-3000:]
            raise RuntimeError(f"{step} failed (exit {done.returncode}; {self.root / 'logs' / step}.log):\n{tail}")
        self.log(f"[{self.root.name}] {step}: {self.timings[step]} s")

    def materialize(self, asset: str) -> None:
        # the asset and its checks in the run's own process: a step subprocess apiece costs a Python start and the
        # imports again (a minute on a loaded 2-core machine) for steps that take seconds here
        config = json.dumps({"execution": {"config": {"in_process": {}}}})
        self.run(asset, "dagster", "asset", "materialize", "-m", "hsx_dagster.definitions", "--select", asset,
                 "--config-json", config)  # fmt: skip


def claim_meant_layers(drafter_dir: Path) -> list[int]:
    """shifted_layers: rewrite drafter/manifest.json so that states of decoder layers [i - 1] claim to be layers
    [i] (the convention bug); every later reader (the export, its `hsx` backend) then serves them as such.
    Returns the ids the manifest held."""
    path = drafter_dir / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    stored = list(manifest["layers"]["ids"])
    manifest["layers"]["ids"] = [layer + 1 for layer in stored]
    manifest["layers"]["preset"] = "speculators"
    path.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return stored


def make_variant(target: Path, variant: str, out: Path, conversations: int | None, log: Any = print) -> dict[str, Any]:
    """Make the variant's data under ``out/variant`` unless its stamp matches; returns its report."""
    target, out = target.resolve(), out.resolve()  # DAGSTER_HOME and the settings' paths must be absolute
    target_stamp = json.loads((target / TARGET_STAMP).read_text(encoding="utf-8"))
    root = out / variant
    inputs = pick_inputs(target, out, conversations)
    settings = variant_settings(variant, target, inputs, root / "out")
    digest = stamp_digest({"builder": BUILDER_VERSION, "settings": settings, "target": target_stamp["digest"],
                      "inputs": hashlib.sha256(inputs.read_bytes()).hexdigest()})  # fmt: skip
    if claim_folder(root, digest):
        log(f"{variant} data in {root} is up to date ({root / STAMP_NAME})")
        return dict(json.loads((root / "report.json").read_text(encoding="utf-8")))
    project = Project(root, settings, log)
    project.prepare()
    project.run("observe_inputs", "dagster", "job", "execute", "-m", "hsx_dagster.definitions", "-j", "observe_inputs")
    if settings["regenerate"]["enabled"]:
        _seed_regenerated(out, variant, target_stamp["digest"], project.output_dir / "regenerated", log)
        project.materialize("regenerated_conversations")
    project.materialize("tokenized_dataset")
    project.run("hidden_states", "python", "-m", "hsx_dagster.launch", "shard-00")
    project.materialize("drafter_dataset")
    stored = settings["model"]["layers"]
    if variant == "shifted_layers":
        stored = claim_meant_layers(project.output_dir / "drafter")
    project.materialize("speculators_dataset")
    report = _report(variant, project, stored, digest)
    (root / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    made = {"digest": digest, "variant": variant, "target": target_stamp["digest"]}
    (root / STAMP_NAME).write_text(json.dumps(made) + "\n", encoding="utf-8")
    (root / BUILDING_NAME).unlink()
    return report


def claim_folder(root: Path, digest: str) -> bool:
    """Whether ``root`` already holds the finished variant of inputs ``digest`` (its stamp matches); if not, ready it
    for the build, with a marker naming the digest: an interrupted build of the same inputs is kept and resumes,
    anything else is emptied first."""
    stamp, building = root / STAMP_NAME, root / BUILDING_NAME
    if _digest_in(stamp) == digest:
        return True
    if _digest_in(building) != digest:
        # made from other inputs (or never): its instance and outputs belong to them, and the pipeline rightly
        # refuses to mix their chunks with new ones
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    building.write_text(json.dumps({"digest": digest}) + "\n", encoding="utf-8")
    return False


def _digest_in(path: Path) -> str | None:
    return json.loads(path.read_text(encoding="utf-8")).get("digest") if path.is_file() else None


def _seed_regenerated(out: Path, variant: str, target_digest: str, regenerated: Path, log: Any) -> None:
    """Start from the complete regenerated answers of another variant made from the same target (its stamp says
    so; the inputs file is shared), if any."""
    if regenerated.exists():
        return
    for other in REGENERATING:
        source, other_stamp = out / other / "out" / "regenerated", out / other / STAMP_NAME
        made_here = other_stamp.is_file() and json.loads(other_stamp.read_text()).get("target") == target_digest
        if other != variant and made_here and (source / "conversations.jsonl").is_file():
            shutil.copytree(source, regenerated, ignore=shutil.ignore_patterns(".lock"))
            log(f"[{variant}] regenerated answers copied from {other}; regenerated_conversations resumes them")
            return


def _report(variant: str, project: Project, stored: Any, digest: str) -> dict[str, Any]:
    out = project.output_dir
    manifest = json.loads((out / "drafter" / "manifest.json").read_text(encoding="utf-8"))
    tokenized = json.loads((out / "tokenized" / "summary.json").read_text(encoding="utf-8"))
    export = json.loads((out / "speculators" / "hsx_export.json").read_text(encoding="utf-8"))
    regenerated = out / "regenerated" / "summary.json"
    return {
        "variant": variant,
        "digest": digest,
        "settings": str(project.settings_file),
        "speculators_data_path": str(out / "speculators"),
        "seconds": project.timings,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "samples": tokenized["samples"],
        "tokens": tokenized["tokens"],
        "supervised_tokens": tokenized["loss_tokens"],
        "export_rows": export["rows"],
        "storage_dtype": manifest["storage_dtype"],
        "layers_stored": stored,
        "layers_claimed": manifest["layers"]["ids"],
        "export_layer_mapping": export["mapping"],
        "regenerated": json.loads(regenerated.read_text(encoding="utf-8")) if regenerated.is_file() else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acceptance.data", description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="a folder target.py built")
    parser.add_argument("--variant", choices=(*VARIANTS, "all"), default="all")
    parser.add_argument("--out", type=Path, default=None, help="default: <target>/data")
    parser.add_argument("--conversations", type=int, default=None, help="default: every training conversation")
    args = parser.parse_args(argv)
    out = args.out or args.target / "data"
    for variant in VARIANTS if args.variant == "all" else (args.variant,):
        report = make_variant(args.target, variant, out, args.conversations, log=lambda s: print(s, flush=True))
        print(json.dumps({k: report[k] for k in ("variant", "seconds", "samples", "tokens", "layers_claimed")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
