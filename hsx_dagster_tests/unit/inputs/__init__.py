"""Tests of hsx_dagster/core/inputs/."""
