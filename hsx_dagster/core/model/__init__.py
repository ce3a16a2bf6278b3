"""model"""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.model.info import (
        ModelDirError as ModelDirError,
    )
    from hsx_dagster.core.model.info import (
        ModelInfo as ModelInfo,
    )
    from hsx_dagster.core.model.info import (
        check_model_dir as check_model_dir,
    )
    from hsx_dagster.core.model.info import (
        text_weights_prefix as text_weights_prefix,
    )
    from hsx_dagster.core.model.info import (
        weight_files as weight_files,
    )
    from hsx_dagster.core.model.info import (
        weight_names as weight_names,
    )
    from hsx_dagster.core.model.layers import (
        LAYER_CONVENTION as LAYER_CONVENTION,
    )
    from hsx_dagster.core.model.layers import (
        LayerSpecError as LayerSpecError,
    )
    from hsx_dagster.core.model.layers import (
        dflash_layers as dflash_layers,
    )
    from hsx_dagster.core.model.layers import (
        parse_layer_spec as parse_layer_spec,
    )
    from hsx_dagster.core.model.layers import (
        resolve_layers as resolve_layers,
    )
    from hsx_dagster.core.model.transformers_internals import (
        AttentionFlags as AttentionFlags,
    )
    from hsx_dagster.core.model.transformers_internals import (
        KernelFallback as KernelFallback,
    )
    from hsx_dagster.core.model.transformers_internals import (
        attn_implementation_in_use as attn_implementation_in_use,
    )
    from hsx_dagster.core.model.transformers_internals import (
        kernel_fallbacks as kernel_fallbacks,
    )
    from hsx_dagster.core.model.transformers_internals import (
        package_distribution as package_distribution,
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
    ],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
