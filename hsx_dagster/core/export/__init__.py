"""Exports for the drafter trainers people use: speculators (vLLM) and SpecForge (SGLang). Dagster-free.

- `mapping`: which stored layers become each trainer's auxiliary layers and its last/target slot, checked
  before anything is written;
- `folder`: an export folder appears whole (renamed from a `.partial` folder) or not at all; a re-run finishes
  an interrupted one;
- `speculators`: the `datasets` folder, `token_freq.pt`, and optionally the plain `file` layout;
- `hs_backend`: the `hsx` hidden-states backend that serves each row's states from our chunks (imported inside
  speculators' environment only: it needs `hs_connectors`);
- `specforge`: SpecForge's offline `.ckpt` files (EAGLE-3 and DFlash layouts);
- `drafter_training`: speculators' own EAGLE-3 and DFlash drafters trained on an export in a plain CPU loop
  (speculators' environment only), for the training proof and the acceptance benchmark.
"""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.export.drafter_training import (
        build_drafter as build_drafter,
        drafter_step as drafter_step,
        load_rows as load_rows,
        model_vocab_size as model_vocab_size,
        packed_batches as packed_batches,
        shuffled_states as shuffled_states,
    )
    from hsx_dagster.core.export.file_pool import dataset_indices as dataset_indices, write_rows as write_rows
    from hsx_dagster.core.export.mapping import (
        ExportError as ExportError,
        LayerMapping as LayerMapping,
        specforge_mapping as specforge_mapping,
        speculators_mapping as speculators_mapping,
    )
    from hsx_dagster.core.export.specforge import (
        SpecForgeRows as SpecForgeRows,
        export_specforge as export_specforge,
        sample_file as sample_file,
    )
    from hsx_dagster.core.export.speculators import (
        ARROW_FILE as ARROW_FILE,
        export_speculators as export_speculators,
        row_order as row_order,
    )

EXPORTS = {
    "drafter_training": [
        "build_drafter",
        "drafter_step",
        "load_rows",
        "model_vocab_size",
        "packed_batches",
        "shuffled_states",
    ],
    "file_pool": ["dataset_indices", "write_rows"],
    "mapping": ["ExportError", "LayerMapping", "specforge_mapping", "speculators_mapping"],
    "specforge": ["SpecForgeRows", "export_specforge", "sample_file"],
    "speculators": ["ARROW_FILE", "export_speculators", "row_order"],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
