"""The Dagster code location: `hsx_dagster.definitions:defs` (workspace.yaml, `-m hsx_dagster.definitions`).

Every definition lives in `hsx_dagster/defs/` (assets, checks, jobs, partitions, resources, sensors; built by
defs/build.py). Settings are read here, when the code location loads (the number of shard partitions comes from
them), so a bad hsx.yaml fails at load with the file and key named, before any run starts.
"""

from hsx_dagster.core.settings import load_settings
from hsx_dagster.defs.build import build_definitions

defs = build_definitions(load_settings())
