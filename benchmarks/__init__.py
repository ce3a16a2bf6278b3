"""Throughput, storage and memory benchmarks of the extraction pipeline (see docs/benchmarks.md).

cpu/     `make bench` (`python -m benchmarks.cpu`) and the benchmarks that run on the host: tokenization, storage,
         memory, batch shapes, shard runs sharing a host, checks, reader memory, exports, progress time left, the
         training proof, regeneration (`make bench-regen`) and the scale run (`make bench-scale`)
gpu/     `make bench-gpu` (`python -m benchmarks.gpu`): the GPU benchmark at real sizes; imports no dagster
shared/  what both use: timing and memory measures, the report files, the naive / bare / pipeline contestants, and
         the host-path benchmark (`python -m benchmarks.shared.host_path`) that `make bench` and `make bench-gpu` run
acceptance/ the data's worth as users measure it: a target trained here on text nobody on the project wrote
         (`make acceptance-target`), the drafters' data made through the Dagster definitions, one folder per variant
results/ the committed results, `<date>-<benchmark>.{json,md}`
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout the benchmarks run from and write their results into
