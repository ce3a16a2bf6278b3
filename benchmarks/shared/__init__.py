"""What the CPU and the GPU benchmarks both use (see docs/benchmarks.md). Imports no dagster (the GPU benchmark
imports it).

measure.py         timing, peak RSS, medians, other processes' load, bytes on disk
report.py          Markdown tables; writing a report's JSON and Markdown
contestants.py     naive (the floor), bare forward (the ceiling) and our pipeline, on any device
host_path.py       the host-path benchmark, which `make bench` and `make bench-gpu` (`--device cuda`) both run
host_path_runs.py  its contestants, each in a child process of its own
host_path_work.py  its free backbone of real width, generated shard, and the two ways through them
"""
