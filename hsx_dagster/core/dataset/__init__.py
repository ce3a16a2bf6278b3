"""The trainer-facing dataset: assembly over shards, the reader (`DrafterDataset`) and its quality checks.

Its names load lazily: `from hsx_dagster import DrafterDataset` must load the reader alone (test_layout.py).
"""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.dataset.assembly import (
        AssemblyError as AssemblyError,
        assemble as assemble,
        shard_status as shard_status,
        split_of as split_of,
    )
    from hsx_dagster.core.dataset.drafter_checks import (
        check_coverage as check_coverage,
        check_integrity as check_integrity,
        check_numerics as check_numerics,
        check_parity as check_parity,
        check_parity_on_claimed_device as check_parity_on_claimed_device,
    )
    from hsx_dagster.core.dataset.manifest import Manifest as Manifest
    from hsx_dagster.core.dataset.reader import (
        DatasetError as DatasetError,
        DrafterDataset as DrafterDataset,
        collate_drafter_batch as collate_drafter_batch,
    )
    from hsx_dagster.core.dataset.shard_checks import (
        check_shard as check_shard,
    )
    from hsx_dagster.core.dataset.shard_overview import (
        LOW_FORWARD_SHARE as LOW_FORWARD_SHARE,
        SPEED_COLUMNS as SPEED_COLUMNS,
        STATE_COLUMNS as STATE_COLUMNS,
        ShardRow as ShardRow,
        low_forward_share_note as low_forward_share_note,
        markdown_table as markdown_table,
        shard_rows as shard_rows,
        text_table as text_table,
        total_line as total_line,
    )

EXPORTS = {
    "assembly": ["AssemblyError", "assemble", "shard_status", "split_of"],
    "drafter_checks": [
        "check_coverage",
        "check_integrity",
        "check_numerics",
        "check_parity",
        "check_parity_on_claimed_device",
    ],
    "manifest": ["Manifest"],
    "reader": ["DatasetError", "DrafterDataset", "collate_drafter_batch"],
    "shard_checks": ["check_shard"],
    "shard_overview": [
        "LOW_FORWARD_SHARE",
        "SPEED_COLUMNS",
        "STATE_COLUMNS",
        "ShardRow",
        "low_forward_share_note",
        "markdown_table",
        "shard_rows",
        "text_table",
        "total_line",
    ],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
