"""The benchmarks run and report sane figures: the GPU script's smoke path (CPU, tiny configs, no
dagster) and a tiny CPU benchmark. Speed targets are measured by `make bench`, never asserted here."""

import json
import subprocess
import sys

import pytest

from hsx_dagster_tests.support.paths import REPO

pytestmark = pytest.mark.slow  # servers, subprocesses or kills: left out of the quick loop

CONTESTANTS = ("naive", "bare", "pipeline")

GPU_SMOKE = """
import runpy, sys
sys.argv = ["benchmarks.gpu", "--smoke", "--results", sys.argv[1]]
try:
    runpy.run_module("benchmarks.gpu", run_name="__main__")  # python -m benchmarks.gpu
except SystemExit as done:
    assert not done.code, done.code
assert "dagster" not in sys.modules, "benchmarks.gpu imported dagster"
"""


def test_gpu_benchmark_smoke_runs_on_cpu_without_dagster(tmp_path):
    subprocess.run(
        [sys.executable, "-c", GPU_SMOKE, str(tmp_path)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=180,
    )
    (path,) = tmp_path.glob("*-gpu-smoke.json")
    results = json.loads(path.read_text())
    assert results["smoke"] and results["ceiling"]["tflops"] > 0
    assert set(results["models"]) == {"qwen3-8b-like", "qwen3.6-27b-like"}
    for model in results["models"].values():
        for contestant in CONTESTANTS:
            figures = model["contestants"][contestant]
            assert figures["samples_per_s"] > 0 and figures["tokens_per_s"] > 0
            assert figures["mfu"] > 0 and 0 < figures["parameters_used"] < model["parameters"]
        # one round: each ratio is the other contestant's seconds over the pipeline's, i.e. the pipeline's speed-up
        pipeline_rate = model["contestants"]["pipeline"]["samples_per_s"]
        for other in ("naive", "bare"):
            speedup = pipeline_rate / model["contestants"][other]["samples_per_s"]
            assert model[f"pipeline_over_{other}"] == pytest.approx(speedup, rel=0.02)
        assert (
            model["contestants"]["pipeline"]["bytes_on_disk"] > 0 and model["contestants"]["naive"]["bytes_on_disk"] > 0
        )
        # bare and pipeline run the truncated backbone, the naive design every layer and the LM head
        assert model["contestants"]["bare"]["parameters_used"] < model["contestants"]["naive"]["parameters_used"]
    assert results["models"]["qwen3-8b-like"]["linear_attention"] is None
    assert (
        "PyTorch" in results["models"]["qwen3.6-27b-like"]["linear_attention"]
        or "flash" in results["models"]["qwen3.6-27b-like"]["linear_attention"]
    )
    assert "| qwen3.6-27b-like | pipeline |" in path.with_suffix(".md").read_text()


def test_tiny_cpu_benchmark_writes_every_section(tmp_path):
    command = [
        sys.executable, "-m", "benchmarks.cpu", "--samples", "8", "--rounds", "1", "--models", "qwen3.6-shaped",
        "--storage-models", "demo", "--memory-samples", "8", "--memory-factor", "2", "--tokenize-repeats", "1",
        "--tokenize-conversations", "400", "--tokenize-rounds", "1", "--max-repeats", "0", "--out", str(tmp_path),
        "--date", "test",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "test-cpu.json").read_text())
    markdown = (tmp_path / "test-cpu.md").read_text()
    assert markdown in done.stdout  # the table is printed too

    throughput = results["throughput"]["qwen3.6-shaped"]
    for contestant in CONTESTANTS:
        assert throughput["contestants"][contestant]["samples_per_s"] > 0
    for other in ("naive", "bare"):  # one round: the other's seconds over the pipeline's, the pipeline's speed-up
        ratio = throughput[f"pipeline_over_{other}"]
        speedup = (
            throughput["contestants"]["pipeline"]["samples_per_s"] / throughput["contestants"][other]["samples_per_s"]
        )
        assert ratio["per_round"] == [ratio["median"]] and ratio["median"] == pytest.approx(speedup, rel=0.02)
    pipeline = throughput["contestants"]["pipeline"]
    # Flat, unpadded chunks: the states plus 5 bytes of ids and mask per token, and a little metadata.
    assert 1.0 < pipeline["bytes_over_payload"] < 1.0 + 5 / throughput["payload_bytes_per_token"] + 0.01
    assert 0.9 < pipeline["padding_efficiency"] <= 1.0
    assert results["models"]["qwen3.6-shaped"]["vocab_size"] == 248_320
    assert results["models"]["qwen3.6-shaped"]["layer_kinds"] == {"full_attention": 2, "linear_attention": 6}

    storage = results["storage"]["demo"]["dtypes"]
    assert {"bfloat16", "float16", "float32"} <= set(storage)
    assert storage["float32"]["relative_error"]["p99"] == 0.0  # the reference itself
    assert 0 < storage["bfloat16"]["relative_error"]["median"] < 0.01
    assert storage["float16"]["relative_error"]["median"] < storage["bfloat16"]["relative_error"]["median"]
    assert 1.9 < storage["float32"]["over_bfloat16_bytes"] < 2.0

    memory = results["memory"]
    assert memory["runs"]["2x"]["tokens"] == 2 * memory["runs"]["1x"]["tokens"]
    compared = memory["compared"]
    assert memory["peak_ratio"] == pytest.approx(
        memory["runs"]["2x"][compared] / memory["runs"]["1x"][compared], abs=1e-4
    )
    for run in memory["runs"].values():  # the lifetime peak is at least any RSS the process had
        assert run["process_peak_rss_bytes"] >= run["rss_after_load_bytes"] > 0
    assert results["tokenization"]["conversations_per_s"] > 0
    workers = results["tokenization"]["workers"]
    assert workers["conversations"] == 400 and workers["identical_output"]
    assert set(workers["workers"]) == {"1", "2"} and workers["speedup"]["median"] > 0
    assert f"Speed-up {workers['speedup']['median']}x" in markdown  # the measured figure reaches the report
    (target,) = [row for row in results["targets"] if row["target"].startswith("tokenize_workers")]
    assert target["measured"] == workers["speedup"]["median"]
    assert target["met"] == (workers["speedup"]["median"] >= workers["target_speedup"])
    assert {row["target"].split(" ")[0] for row in results["targets"]} >= {"pipeline", "padding", "bytes", "peak"}


def test_host_path_benchmark_smoke_compares_the_pipeline_with_its_baselines(tmp_path):
    """The host-path benchmark runs as `make bench-gpu` runs it (`python -m benchmarks.shared.host_path`, the device's
    part on the given device) and reports every contestant of every configuration with figures that follow from its
    runs."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.shared.host_path",
        "--smoke",
        "--results",
        str(tmp_path),
        "--out-dir",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("*-host-path-smoke.json")
    results = json.loads(path.read_text())
    assert {entry["config"]["dtype"] for entry in results["configs"]} == {"bfloat16", "float8_e4m3"}
    for entry in results["configs"]:
        runs, summary = entry["runs"], entry["summary"]
        assert set(runs) == {"device", "pipeline", "pipeline buffered", "floor", "plain write", "sha256sum"}
        pipeline = runs["pipeline"][0]
        assert pipeline["bytes"] == runs["sha256sum"][0]["bytes"] > 0  # sha256sum hashed what the pipeline stored
        assert runs["device"][0]["bytes"] <= pipeline["bytes"]  # the states, ids and masks; the chunks add headers
        assert summary["stored_gb"] == round(pipeline["bytes"] / 1e9, 3)
        # the report rounds to 4 decimals: a smoke run on a busy machine stores at a few MB/s
        assert summary["pipeline_gb_per_s"] == pytest.approx(
            pipeline["bytes"] / 1e9 / pipeline["wall_s"], rel=0.01, abs=5e-5
        )
        host = (pipeline["cpu_s"] - runs["device"][0]["cpu_s"]) / (pipeline["bytes"] / 1e9)
        assert summary["host_cpu_s_per_gb"] == pytest.approx(host, rel=0.01, abs=0.01)
        # the floor (one write with fsync, one sha256 of the same bytes) from the same rounds, and the host over it
        floor = runs["floor"][0]["cpu_s"] / (runs["floor"][0]["bytes"] / 1e9)
        assert summary["floor_cpu_s_per_gb"] == pytest.approx(floor, rel=0.01, abs=0.01)
        assert summary["host_over_floor"] == pytest.approx(summary["host_cpu_s_per_gb"] / floor, rel=0.02, abs=0.01)
        # the pipeline's own account: its parts and what lies outside them add up to its CPU time
        parts = summary["parts_per_gb"]
        assert {"write", "fsync", "hash", "checks", "outside_the_account"} <= parts.keys()
        assert sum(parts.values()) == pytest.approx(pipeline["cpu_s"] / (pipeline["bytes"] / 1e9), rel=0.02, abs=0.05)
        assert pipeline["checks_bytes_hashed"] == 0  # its checks took the writer's digests: one hash per byte
        assert runs["pipeline buffered"][0]["direct_io"] == "buffered (direct_io: off)"
    assert not list(tmp_path.glob("host-path-*"))  # every run's scratch folder is gone
    assert "| 256 x 4 float8_e4m3 |" in path.with_suffix(".md").read_text()


def test_scale_run_measures_every_step_as_a_user_runs_it(tmp_path):
    """benchmarks/cpu/scale_run.py at toy size: every step a child process of the Dagster CLI or hsx_dagster.launch,
    measured (wall, CPU, the kernel's peak RSS of its processes, Dagster's own steps inside it); a second call
    finds every step recorded and measures nothing again."""
    work = tmp_path / "work"
    command = [sys.executable, "-m", "benchmarks.cpu.scale_run", "--sizes", "24", "--shards", "1", "--files", "2",
               "--work", str(work), "--out", str(tmp_path)]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=900)
    state = json.loads((work / "24" / "steps.json").read_text())
    steps = state["steps"]
    assert list(steps) == [
        "observe",
        "tokenize",
        "shard-00",
        "recheck",
        "drafter",
        "speculators",
        "specforge",
        "report",
    ]
    for label, record in steps.items():
        assert record["returncode"] == 0 and record["wall_s"] > 0 and record["cpu_s"] > 0, label
        assert 50e6 < record["peak_rss_bytes"] < 8e9 and record["peak_tree_rss_bytes"] >= 0, label
    inside = {label: {s["step"]: s for s in record["dagster_steps"]} for label, record in steps.items()}
    assert {"extract_hidden_states", "check_hidden_states_shard"} <= set(inside["shard-00"])
    assert {"drafter_dataset", "drafter_dataset_drafter_coverage"} <= set(inside["drafter"])
    assert all(s["ok"] and s["seconds"] > 0 and s["peak_rss_bytes"] for s in inside["shard-00"].values())
    assert steps["specforge"]["bytes_added"] > 0 and state["plain_write_bytes_per_s"] > 0
    (report,) = tmp_path.glob("*-scale.md")
    assert "| shard checks |" in report.read_text() and "| specforge export |" in report.read_text()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    assert json.loads((work / "24" / "steps.json").read_text())["steps"] == steps  # resumed: nothing measured again


def test_scale_report_grows_and_extrapolates_each_step(tmp_path):
    """The report's arithmetic on two sizes: growth, the straight line to 10^6, the goal at the larger size (the
    scale run's `--report-only` on two sizes' steps.json files)."""

    def state(n: int, seconds: float, rss: int, written: int) -> dict:
        record = {"wall_s": seconds, "cpu_s": seconds, "peak_rss_bytes": rss, "peak_tree_rss_bytes": rss,
                  "bytes_added": written, "load_before": [0.5, 0, 0], "others_cores": 0.0,
                  "dagster_steps": []}  # fmt: skip
        return {"conversations": n, "plain_write_bytes_per_s": 10**9, "steps": {"speculators": record}}

    work = tmp_path / "work"
    for n, figures in {20_000: (10.0, 10**9, 0), 200_000: (100.0, 1.5 * 10**9, 5 * 10**10)}.items():
        (work / str(n)).mkdir(parents=True)
        (work / str(n) / "steps.json").write_text(json.dumps(state(n, *figures)))
    command = [sys.executable, "-m", "benchmarks.cpu.scale_run", "--report-only", "--sizes", "20000,200000",
               "--work", str(work), "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (report,) = tmp_path.glob("*-scale.json")
    rows = json.loads(report.read_text())["rows"]
    (row,) = [r for r in rows if r["step"] == "speculators export"]
    assert (row["time_growth"], row["rss_growth"], row["size_ratio"]) == (10.0, 1.5, 10.0)
    assert row["seconds_1e6"] == 500.0 and row["rss_1e6"] == round(1.5e9 + 0.5e9 / 180_000 * 800_000)
    assert row["budget_s"] == 170.0 and row["within_time"] and row["within_rss"]
