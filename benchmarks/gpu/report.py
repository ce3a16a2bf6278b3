"""The GPU benchmark's report: the machine it ran on and the Markdown of its results."""

from __future__ import annotations

import importlib.util
import platform

import torch

from benchmarks.shared.report import table


def machine(device: torch.device, transformers_version: str) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {
        "device": name,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers_version,
        "fla": importlib.util.find_spec("fla") is not None,
    }


def render(results: dict) -> str:
    m, c = results["machine"], results["ceiling"]
    lines = [
        f"# GPU benchmark{' (smoke: CPU, tiny configs)' if results['smoke'] else ''}, {results['date']}",
        "",
        f"{m['device']}, torch {m['torch']} (CUDA {m['cuda']}), transformers {m['transformers']}. "
        f"Matmul ceiling {c['tflops']:.1f} TFLOP/s ({c['shape']}). {results['elapsed_s']:.0f} s in all.",
        "",
    ]
    rows = []
    for name, r in results["models"].items():
        for contestant, f in r["contestants"].items():
            rows.append([
                name, contestant, f["samples_per_s"], f["tokens_per_s"], f["mfu"],
                r["pipeline_over_naive"] if contestant == "pipeline" else None,
                r["pipeline_over_bare"] if contestant == "pipeline" else None, f["peak_device_gib"],
            ])  # fmt: skip
    lines += [
        table(
            ["model", "contestant", "samples/s", "tokens/s", "MFU", "x naive", "x bare", "peak GPU GiB"],
            rows,
            [0, 0, 2, 0, 3, 2, 3, 1],
        ),
        "",
    ]
    for name, r in results["models"].items():
        kernel = f"; linear attention: {r['linear_attention']}" if r["linear_attention"] else ""
        lines.append(
            f"- {name}: {r['parameters']:,} parameters, layers {r['layer_ids']} ({r['kept_layers']} of "
            f"{r['config']['num_hidden_layers']} run by bare/pipeline), {r['samples']} samples, mean "
            f"{r['mean_tokens']} tokens, "
            f"{r['rounds']} rounds, attention {r['attn_implementation']}{kernel}; built in {r['build_s']} s"
        )
        if "states_gb_per_s_at_bare_pace" in r:
            lines.append(
                f"  - states to store: {r['states_gb_per_s_at_bare_pace']} GB/s at the bare forward's pace, "
                f"{r['states_gb_per_s_pipeline']} GB/s stored by the pipeline (the host path's own rate: "
                "python -m benchmarks.shared.host_path --device cuda)"
            )
        load = r.get("loading") or {}
        if "load_s" in load:
            lines.append(
                f"  - loaded from a {load['checkpoint_gib']} GiB checkpoint by load_backbone in {load['load_s']} s: "
                f"{load['loaded_gib']} GiB of weights, host peak RSS {load['host_peak_rss_gib']} GiB "
                f"(+{load['host_rss_growth_gib']} GiB while loading), attention {load['attn_implementation']}"
            )
        elif load:
            lines.append(f"  - loading not measured: {load['skipped']}")
        shape = r.get("batch_shape")
        if shape:
            lines.append(
                f"  - defaults (batch_size, max_batch_tokens auto) / best bare shape of the sweep: "
                f"{shape['auto_over_best_bare']['median']} (per round {shape['auto_over_best_bare']['per_round']}); "
                f"chose {', '.join(shape['chosen'])}; probe {shape['probe_s']} s, lost to slower shapes "
                f"{shape['probe_overhead_s']} s"
            )
    return "\n".join(lines) + "\n"
