"""Tests of hsx_dagster/core/model/."""
