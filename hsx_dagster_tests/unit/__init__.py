"""Unit tests, one folder per core subpackage (hsx_dagster/core/<name>/): a module's tests are found by its name."""
