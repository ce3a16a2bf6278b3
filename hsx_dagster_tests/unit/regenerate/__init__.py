"""Tests of hsx_dagster/core/regenerate/."""
