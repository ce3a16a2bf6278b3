"""Tests of hsx_dagster/core/storage/."""
