"""The pipeline's core: no Dagster imports. Tokenise, batch, extract, store, read."""
