"""Tests of hsx_dagster/core/dataset/."""
