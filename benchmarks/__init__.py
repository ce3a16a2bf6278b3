"""Throughput, storage and memory benchmarks of the extraction pipeline (see docs/benchmarks.md).

cpu.py           `make bench`: the CPU benchmark's command line, all sections, one JSON + one Markdown report
cpu_runs.py      its runs in interleaved rounds and the figures computed from them
cpu_report.py    its targets and Markdown
batch_shape.py   the defaults (auto batch shapes) against bare at each shape of a sweep
contestants.py   naive (the floor), bare forward (the ceiling) and our pipeline
models.py        the benchmark models and the samples they run on
storage.py       bytes and reconstruction error per storage dtype
memory.py        peak RSS at 1x and 10x the samples, in child processes
tokenization.py  conversations per second of the tokenized_dataset step
measure.py       timing, peak RSS, medians, bytes on disk
report.py        Markdown tables; writing a report's JSON and Markdown
gpu.py           `make bench-gpu`: the GPU benchmark's command line (runs without dagster; `--smoke` on a CPU)
gpu_models.py    its models at real sizes, built on the device, and their samples
gpu_runs.py      the matmul ceiling and its contestants in interleaved rounds
gpu_report.py    its machine facts and Markdown
regeneration.py  `make bench-regen`: regeneration throughput by concurrency
scale_run.py     `make bench-scale`: every step of the pipeline at 2 x 10^4 and 2 x 10^5 conversations
scale_measure.py a command and every process it starts, measured by the kernel
scale_report.py  the scale run's growth, 10^6 extrapolation and goals
export_pool.py   SpecForge files written in-process, by threads or by processes
"""
