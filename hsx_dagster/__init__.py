"""hsx-dagster: batched hidden-state extraction for speculative-decoding drafters, on Dagster.

from hsx_dagster import DrafterDataset
ds = DrafterDataset("data/out/drafter", split="train")
"""

__version__ = "0.1.0"
__all__ = ["DrafterDataset", "__version__", "collate_drafter_batch"]


def __getattr__(name: str) -> object:
    # The reader imports torch; keep `import hsx_dagster.core.settings` and the CLI light.
    if name in ("DrafterDataset", "collate_drafter_batch"):
        import hsx_dagster.core.dataset

        return getattr(hsx_dagster.core.dataset, name)
    raise AttributeError(f"module 'hsx_dagster' has no attribute {name!r}")
