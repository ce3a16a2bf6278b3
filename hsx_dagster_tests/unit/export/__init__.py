"""Tests of hsx_dagster/core/export/."""
