"""Tests of hsx_dagster/core/settings/."""
