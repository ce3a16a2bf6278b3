"""The CPU benchmark (`make bench`) and the benchmarks that run on the host (see docs/benchmarks.md).

__main__.py      `make bench` (`python -m benchmarks.cpu`): the CPU benchmark's command line, all sections, one report
runs.py          its runs in interleaved rounds and the figures computed from them
report.py        its targets and Markdown
batch_shape.py   the defaults (auto batch shapes) against bare at each shape of a sweep
models.py        the benchmark models and the samples they run on
storage.py       bytes and reconstruction error per storage dtype
memory.py        peak RSS at 1x and 10x the samples, in child processes
tokenization.py  conversations per second of the tokenized_dataset step, 1 worker against 2
shard_run_floor.py a whole Dagster shard run on a wide, nearly free target against one write + fsync + sha256 (#42)
shard_run_floor_report.py its figures by round (by subtraction and by the run's own account) and report
host_share.py    shard runs launched together on one host: PyTorch's default pool against `host_threads: auto`
check_speed.py   the shard and drafter checks against a plain `sha256sum` of the same files
reader_memory.py DrafterDataset's index per process at 10^6 samples, in the parent and in DataLoader workers
export_pool.py   SpecForge files written in-process, by threads or by processes
progress_eta.py  a running shard's time left against the time it really had left, read from a Dagster instance
trainers.py      the drafter training proof: EAGLE-3 and DFlash drafts trained on an export, against a control
regeneration.py  `make bench-regen`: regeneration throughput by concurrency
scale_run.py     `make bench-scale`: every step of the pipeline at 2 x 10^4 and 2 x 10^5 conversations
scale_measure.py a command and every process it starts, measured by the kernel
scale_report.py  the scale run's growth, 10^6 extrapolation and goals
"""
