"""Test support: shared helpers, the parameter sweeps, the code-size budget, processes the tests kill, the Ray
cluster and release-checkpoint builders, and the private Dagster calls only tests make."""
