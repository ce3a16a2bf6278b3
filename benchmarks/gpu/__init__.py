"""The GPU benchmark (`make bench-gpu`; see docs/benchmarks.md). Imports no dagster: it runs with a GPU box's own
Python and the core's dependencies.

__main__.py  `python -m benchmarks.gpu`: the command line (`--smoke` on a CPU with tiny configs, in seconds)
models.py    its models at real sizes, built on the device; loading from a checkpoint; their samples
runs.py      the matmul ceiling and the contestants in interleaved rounds (MFU, ratios)
report.py    its machine facts and Markdown
"""
