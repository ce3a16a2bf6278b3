"""The CPU benchmark's report: the targets each figure is held to, and the Markdown of every section."""

from __future__ import annotations

from benchmarks.cpu.batch_shape import render_batch_shape
from benchmarks.cpu.models import LAYERS
from benchmarks.cpu.runs import HEADLINE
from benchmarks.cpu.tokenization import render_workers
from benchmarks.shared.measure import mib
from benchmarks.shared.report import table

TARGETS = {
    "pipeline_over_bare": 0.95,
    "pipeline_over_naive": 20.0,
    "padding_efficiency": 0.97,
    "bytes_over_payload": 1.01,
    "memory_growth": 1.10,
    "auto_over_best_bare": 0.90,
    "auto_lowest_round": 0.80,
}


def targets(results: dict, models: list[str]) -> list[dict]:
    t = TARGETS
    rows = []
    for name in models:
        figures = results["throughput"][name]
        rows.append(
            _target(
                f"pipeline / bare >= {t['pipeline_over_bare']}",
                name,
                figures["pipeline_over_bare"]["median"],
                t["pipeline_over_bare"],
            )
        )
    if HEADLINE in results["throughput"]:
        ratio = results["throughput"][HEADLINE]["pipeline_over_naive"]["median"]
        rows.append(
            _target(f"pipeline / naive >= {t['pipeline_over_naive']:.0f}x", HEADLINE, ratio, t["pipeline_over_naive"])
        )
    workers = results.get("tokenization", {}).get("workers")
    if workers:
        bound = workers["target_speedup"]
        rows.append(_target(f"tokenize_workers 2 / 1 >= {bound}x", "tokenizer", workers["speedup"]["median"], bound))
    efficiency = results["samples"]["demo_set_padding_efficiency"]
    rows.append(
        _target(
            f"padding efficiency >= {t['padding_efficiency']} (whole demo set)",
            "all",
            efficiency,
            t["padding_efficiency"],
        )
    )
    for name in models:
        ratio = results["throughput"][name]["contestants"]["pipeline"]["bytes_over_payload"]
        rows.append(
            _target(
                f"bytes on disk <= {t['bytes_over_payload']} x payload",
                name,
                ratio,
                t["bytes_over_payload"],
                at_most=True,
            )
        )
    if results.get("batch_shape"):
        rows.append(
            _target(
                f"auto pipeline / best bare of the sweep >= {t['auto_over_best_bare']}",
                HEADLINE,
                results["batch_shape"]["auto_over_best_bare"]["median"],
                t["auto_over_best_bare"],
            )
        )
        rows.append(
            _target(
                f"auto pipeline / best bare of the sweep, lowest round >= {t['auto_lowest_round']}",
                HEADLINE,
                results["batch_shape"]["auto_over_best_bare"]["lowest"],
                t["auto_lowest_round"],
            )
        )
    growth = results["memory"]["peak_ratio"]
    rows.append(
        _target(
            f"peak RSS {results['memory']['factor']}x / 1x <= {t['memory_growth']}",
            "memory",
            growth,
            t["memory_growth"],
            at_most=True,
        )
    )
    return rows


def _target(name: str, model: str, measured: float, bound: float, at_most: bool = False) -> dict:
    return {
        "target": name,
        "model": model,
        "measured": measured,
        "met": measured <= bound if at_most else measured >= bound,
    }


def _noise_line(noise: dict) -> str:
    return (
        f"Other processes on the machine: {noise['repeated_runs']} runs measured again because others kept more than "
        f"{noise['quiet_cores']} cores busy meanwhile; {noise['noisy_kept_runs']} of the {noise['kept_runs']} "
        "kept runs were "
        f"still disturbed; others' median {noise['others_cores_median']} cores, max {noise['others_cores_max']}."
    )


def render(results: dict) -> str:
    s, m = results["samples"], results["machine"]
    out = [
        f"# CPU benchmark, {results['date']}",
        "",
        f"{m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}, transformers "
        f"{m['transformers']}. "
        f"{s['count']} demo samples in whole batches ({s['tokens']:,} tokens, mean {s['mean_tokens']}), "
        f"{results['settings']['rounds']} interleaved rounds, medians; layers {LAYERS}, float32 compute, "
        f"batches of <= {results['settings']['batch_size']} rows / {results['settings']['max_batch_tokens']:,} tokens. "
        f"Load average {m['load_average_start'][0]} at the start, {m['load_average_end'][0]} at the end; "
        f"{results['elapsed_s']:.0f} s in all.",
        "",
        _noise_line(results["noise"]),
        "",
        "## Throughput",
        "",
    ]
    out += _throughput_section(results) + _storage_section(results) + _memory_section(results)
    if results.get("batch_shape"):
        out += render_batch_shape(results["batch_shape"])
    tok = results["tokenization"]
    out += [
        "## Tokenization",
        "",
        f"{tok['conversations']:,} demo conversations -> {tok['samples']:,} samples ({tok['tokens']:,} tokens): "
        f"{tok['conversations_per_s']:,} conversations/s, {tok['tokens_per_s']:,} tokens/s (median of "
        f"{len(tok['seconds'])}).",
        "",
        *([render_workers(tok["workers"]), ""] if tok.get("workers") else []),
        "## Targets",
        "",
        table(
            ["target", "model", "measured", "met"],
            [[r["target"], r["model"], r["measured"], r["met"]] for r in results["targets"]],
            3,
        ),
        "",
    ]
    return "\n".join(out)


def _throughput_section(results: dict) -> list[str]:
    """The throughput table, and the padding efficiency of the whole demo set."""
    s = results["samples"]
    out: list[str] = []
    rows = []
    for name, figures in results["throughput"].items():
        for contestant, f in figures["contestants"].items():
            rows.append([
                name, contestant, f["samples_per_s"], f["tokens_per_s"],
                figures["pipeline_over_naive"]["median"] if contestant == "pipeline" else None,
                figures["pipeline_over_bare"]["median"] if contestant == "pipeline" else None,
                f.get("padding_efficiency"), f.get("bytes_per_token"), f.get("bytes_over_payload"),
                f["peak_rss_growth_mib"], f["cpu_busy"],
            ])  # fmt: skip
    headers = [
        "model",
        "contestant",
        "samples/s",
        "tokens/s",
        "c/a (x naive)",
        "c/b (x bare)",
        "padding eff.",
        "bytes/token",
        "x payload",
        "peak RSS +MiB",
        "cores busy",
    ]
    out += [table(headers, rows, [0, 0, 2, 0, 2, 3, 3, 1, 4, 0, 2]), ""]
    out += [
        f"Padding efficiency of the whole demo set ({s['demo_set_samples']:,} samples, mean "
        f"{s['demo_set_mean_tokens']} tokens) "
        f"with the same batches: {s['demo_set_padding_efficiency']}.",
        "",
        "## Storage dtypes",
        "",
    ]
    return out


def _storage_section(results: dict) -> list[str]:
    """Bytes and reconstruction error per storage dtype."""
    out: list[str] = []
    rows = []
    for name, entry in results["storage"].items():
        for dtype, f in entry["dtypes"].items():
            e = f["relative_error"]
            rows.append(
                [
                    name,
                    dtype,
                    f["bytes_per_token"],
                    f["over_bfloat16_bytes"],
                    f["over_payload"],
                    e["median"],
                    e["p99"],
                    f["throughput_over_bfloat16"]["median"],
                ]
            )
    headers = [
        "model",
        "storage dtype",
        "bytes/token",
        "x bfloat16",
        "x payload",
        "rel. error median",
        "rel. error p99",
        "throughput x bfloat16",
    ]
    out += [table(headers, rows, [0, 0, 1, 3, 4, 4, 4, 2]), ""]
    return out


def _memory_section(results: dict) -> list[str]:
    """Peak RSS at 1x and at the factor of the samples, in child processes."""
    out: list[str] = []
    mem = results["memory"]
    out += ["## Memory scaling (pipeline, Qwen3.6-shaped, child processes)", ""]
    rows = [
        [
            run,
            r["samples"],
            r["tokens"],
            r["chunks"],
            mib(r["extraction_peak_rss_bytes"]),
            mib(r["process_peak_rss_bytes"]),
            mib(r["rss_after_load_bytes"]),
            r["seconds"],
        ]
        for run, r in mem["runs"].items()
    ]
    out += [
        table(
            [
                "run",
                "samples",
                "tokens",
                "chunks",
                "extraction peak RSS MiB",
                "process peak RSS MiB",
                "RSS after load MiB",
                "seconds",
            ],
            rows,
            1,
        ),
        "",
    ]
    compared = "the extraction's own peak" if mem["compared"].startswith("extraction") else "the process's peak"
    out += [
        f"Peak RSS {mem['factor']}x / 1x: {mem['peak_ratio']} ({compared}); whole process, imports and loading "
        f"included: {mem['process_peak_ratio']}.",
        "",
    ]
    return out
