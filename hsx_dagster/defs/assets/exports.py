"""`speculators_dataset` and `specforge_dataset`: the drafter dataset as each trainer's own code takes it.

Thin over `hsx_dagster.core.export`. Materialized only when asked: selecting them, or `export.speculators` /
`export.specforge` (then `make demo` builds them after `drafter_dataset`). An export that cannot serve the trainer
fails before writing anything, naming the setting to change.
"""

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from hsx_dagster.core.export import LayerMapping, export_specforge, export_speculators
from hsx_dagster.core.units import format_bytes, format_count
from hsx_dagster.defs.resources import HsxSettings
from hsx_dagster.defs_support.asset_keys import (
    DRAFTER_DATASET,
    SPECFORGE_DATASET,
    SPECULATORS_DATASET,
    TOKENIZED_DATASET,
)


def _metadata(path, rows: int, train_rows: int, size: int, mapping: LayerMapping, command: str) -> dict:
    return {
        "dagster/row_count": rows,
        "rows": rows,  # a plain count, read by scripts; the readable form is "size"
        "size": f"{format_count(rows)} rows ({format_count(train_rows)} train, {format_count(rows - train_rows)} "
        f"validation), {format_bytes(size)}",
        "layer_mapping": MetadataValue.md(mapping.markdown()),
        "how_to_train": MetadataValue.md(f"```bash\n{command}\n```"),
        "path": MetadataValue.path(str(path)),
    }


@asset(
    key=SPECULATORS_DATASET,
    group_name="exports",
    deps=[DRAFTER_DATASET, TOKENIZED_DATASET],
    kinds={"arrow"},
    description="speculators' --data-path: the datasets folder (train rows, then validation rows), token_freq.pt, "
    "and the states served from our chunks by the `hsx` backend (or, with export.speculators_files, the `file` "
    "layout). docs/trainers-speculators.md",
)
def speculators_dataset(context: AssetExecutionContext, settings: HsxSettings) -> MaterializeResult:
    loaded = settings.load()
    result = export_speculators(
        loaded.drafter_dir,
        loaded.tokenized_dir,
        loaded.speculators_dir,
        files=loaded.export.speculators_files,
        progress=context.log.info,
    )
    context.log.info(f"speculators export: {result.rows} rows in {result.path}")
    metadata = _metadata(result.path, result.rows, result.train_rows, result.bytes, result.mapping, result.command)
    return MaterializeResult(metadata={**metadata, "hidden_states_backend": "file" if result.files else "hsx"})


@asset(
    key=SPECFORGE_DATASET,
    group_name="exports",
    deps=[DRAFTER_DATASET],
    kinds={"pytorch"},
    description="SpecForge's --hidden-states-path: one .ckpt per sample (EAGLE-3 or DFlash layout, "
    "export.specforge_layout); the one pickle-based container written, tensors only. docs/trainers-specforge.md",
)
def specforge_dataset(context: AssetExecutionContext, settings: HsxSettings) -> MaterializeResult:
    loaded = settings.load()
    result = export_specforge(
        loaded.drafter_dir, loaded.specforge_dir, layout=loaded.export.specforge_layout, progress=context.log.info
    )
    context.log.info(f"specforge export: {result.rows} rows in {result.path}")
    metadata = _metadata(result.path, result.rows, result.train_rows, result.bytes, result.mapping, result.command)
    return MaterializeResult(metadata={**metadata, "layout": result.layout})


export_assets = [speculators_dataset, specforge_dataset]
