"""GPU benchmark: the pipeline against a bare forward pass and the naive design on random-weight
models at real sizes, and the model FLOP utilisation (MFU) against the measured matmul ceiling.

    python -m benchmarks.gpu            # one GPU (sized for an H200): within --budget-s, no network
    python -m benchmarks.gpu --smoke    # the same code on the CPU with tiny configs, in seconds (tests run it)

Models, built from configs (no download): a Qwen3-8B-like dense model and a Qwen3.6-27B-like hybrid
(Gated DeltaNet linear attention + full attention, 3:1). Weights are built directly on the device:
the model is constructed on the meta device, materialised there with ``to_empty`` and initialised in
place with a seeded normal_ (norms, decay and rotary buffers as the architecture initialises them),
so a 27B model never touches host memory. The naive design and the pipeline share the weights.

MFU = 2 x parameters used x tokens / seconds / matmul ceiling, where parameters used are the
non-embedding parameters the forward pass multiplies with (the truncated backbone for bare and
pipeline; every layer and the LM head for the naive design) and the ceiling is a large bf16 GEMM
timed with CUDA events on the same GPU. Attention's own FLOPs are not counted.

Needs what hsx_dagster.core needs (torch, transformers 5.x with the Qwen3 and Qwen3.5 classes, safetensors,
pyarrow, numpy, pydantic-settings, pyyaml), not dagster.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # also as `python path/to/benchmarks/gpu` from anywhere, installed or not

from benchmarks.gpu.models import MODELS  # noqa: E402
from benchmarks.gpu.report import machine, render  # noqa: E402
from benchmarks.gpu.runs import bench_model, matmul_ceiling  # noqa: E402
from benchmarks.shared.report import write_results  # noqa: E402

MEAN_TOKENS = 335


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, tiny configs, a few samples: checks the code in seconds"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--samples", type=int, nargs="+", default=None, help="samples per model (default 512 dense, 256 hybrid)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mean-tokens", type=int, default=None, help=f"mean sample length (default {MEAN_TOKENS})")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=65_536)
    parser.add_argument("--budget-s", type=float, default=360.0, help="rounds stop early rather than run past this")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="where the contestants write (default: a temporary folder)"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="folder of <date>-gpu.json/.md (default benchmarks/results; none with --smoke)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.samples = args.samples or [8]
        args.mean_tokens = args.mean_tokens or 40
        args.rounds = min(args.rounds, 1)
        args.batch_size, args.max_batch_tokens = min(args.batch_size, 4), min(args.max_batch_tokens, 1024)
    args.samples = args.samples or [512 if "dense" in name or "8b" in name else 256 for name in args.models]
    if len(args.samples) == 1:
        args.samples = args.samples * len(args.models)
    args.mean_tokens = args.mean_tokens or MEAN_TOKENS
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible; use --smoke to check the code on a CPU")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(args.seed)
    results = {
        "date": datetime.date.today().isoformat(),
        "smoke": args.smoke,
        "machine": machine(device, transformers.__version__),
        "ceiling": matmul_ceiling(device, dtype, n=256 if args.smoke else 8192),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "models": {},
    }
    print(
        f"matmul ceiling: {results['ceiling']['tflops']:.1f} TFLOP/s ({results['ceiling']['shape']})", file=sys.stderr
    )
    out_root = Path(tempfile.mkdtemp(prefix="hsx-gpu-bench-", dir=args.out_dir))
    try:
        for position, (name, count) in enumerate(zip(args.models, args.samples)):
            left = args.budget_s - (time.perf_counter() - started)
            budget = left / (len(args.models) - position)
            results["models"][name] = bench_model(
                name, count, args, device, dtype, results["ceiling"], out_root / name, budget
            )
    finally:
        shutil.rmtree(out_root, ignore_errors=True)
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    markdown = render(results)
    folder = args.results or (None if args.smoke else REPO / "benchmarks" / "results")
    if folder is None:
        print(markdown)
    else:
        write_results(folder / f"{results['date']}-gpu{'-smoke' if args.smoke else ''}", results, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
