"""Tests of the Dagster layer (hsx_dagster/defs/, defs_support/) through real instances: definitions, assets and
checks materialized, sensors, run tags, what the operator reads."""
