"""The trainer-facing dataset: assembly over shards, the reader (`DrafterDataset`) and its quality checks.

Kept free of imports: `from hsx_dagster import DrafterDataset` must load the reader alone.
"""
