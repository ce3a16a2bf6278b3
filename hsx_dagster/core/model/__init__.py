"""What the pipeline knows about the target model, before and while it loads:

- `info`: `ModelInfo`, read once from ``config.json`` and the weight index (layers, hidden size, dtype, weight
  names and their text prefix), and `check_model_dir`, which names what is missing;
- `layers`: the layer presets (``eagle3``, ``dflash-N``) and explicit ids, resolved against the layer count;
- `transformers_internals`: the seam over transformers' private API (attention flags, kernel fallbacks, setting a
  config's attention implementation).
"""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.model.info import (
        ModelDirError as ModelDirError,
        ModelInfo as ModelInfo,
        check_model_dir as check_model_dir,
        text_weights_prefix as text_weights_prefix,
        weight_files as weight_files,
        weight_names as weight_names,
    )
    from hsx_dagster.core.model.layers import (
        LAYER_CONVENTION as LAYER_CONVENTION,
        LayerSpecError as LayerSpecError,
        dflash_layers as dflash_layers,
        parse_layer_spec as parse_layer_spec,
        resolve_layers as resolve_layers,
    )
    from hsx_dagster.core.model.transformers_internals import (
        AttentionFlags as AttentionFlags,
        KernelFallback as KernelFallback,
        attn_implementation_in_use as attn_implementation_in_use,
        kernel_fallbacks as kernel_fallbacks,
        package_distribution as package_distribution,
        use_attn_implementation as use_attn_implementation,
    )

EXPORTS = {
    "info": ["ModelDirError", "ModelInfo", "check_model_dir", "text_weights_prefix", "weight_files", "weight_names"],
    "layers": ["LAYER_CONVENTION", "LayerSpecError", "dflash_layers", "parse_layer_spec", "resolve_layers"],
    "transformers_internals": [
        "AttentionFlags",
        "KernelFallback",
        "attn_implementation_in_use",
        "kernel_fallbacks",
        "package_distribution",
        "use_attn_implementation",
    ],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
