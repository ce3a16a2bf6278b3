"""hsx-dagster: batched hidden-state extraction for speculative-decoding drafters, on Dagster."""

__version__ = "0.1.0"
