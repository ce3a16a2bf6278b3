"""Throughput, storage and memory benchmarks of the extraction pipeline (see docs/benchmarks.md).

cpu.py           `make bench`: the CPU benchmark, all sections, one JSON + one Markdown report
contestants.py   naive (the floor), bare forward (the ceiling) and our pipeline
models.py        the benchmark models and the samples they run on
storage.py       bytes and reconstruction error per storage dtype
memory.py        peak RSS at 1x and 10x the samples, in child processes
tokenization.py  conversations per second of the tokenized_dataset step
measure.py       timing, peak RSS, medians, bytes on disk
report.py        Markdown tables
gpu.py           `make bench-gpu`: the GPU benchmark (runs without dagster; `--smoke` on a CPU)
"""
