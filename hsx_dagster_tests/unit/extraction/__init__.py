"""Tests of hsx_dagster/core/extraction/."""
