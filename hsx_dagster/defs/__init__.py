"""Every Dagster definition of the pipeline, one module per kind, as Dagster's own project layout has them:

assets/       one module per asset: inputs (the observable sources), tokenized, regenerated, hidden_states,
              drafter, exports (speculators, SpecForge)
checks.py     every asset check (each thin over a core check)
jobs.py       the shard job and the input observation job, with their run tags
partitions.py the shard partitions of `hidden_states`
resources.py  the settings, GPU and generator resources (run config generated from the settings)
sensors/      automation.py (drafter assembly, input observation) and retries.py (failed shards as backfills)
build.py      `build_definitions(settings)`: all of the above as one `Definitions`

What only helps them (metadata rendering, the shard table, the pool, asset keys, the seam over Dagster's private
API) is in `hsx_dagster/defs_support/`; the core they wrap imports no Dagster.
"""
