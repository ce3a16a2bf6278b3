"""Load the target model for extraction: the text decoder only, cut after the deepest layer needed,
with forward hooks that capture exactly the requested layers.

- No LM head, no vision tower, no multi-token-prediction module: the text model's own class
  (``AutoModel`` of the text config) is built, so nothing else of a multimodal or MTP release is
  instantiated or read; the text weights are found under whatever prefix the release keeps them
  (``model.``, ``model.language_model.``, ``language_model.model.``, ...).
- Layers after the deepest requested one are never loaded (``num_hidden_layers`` is lowered before
  loading); all layers stay only when the final-norm output is requested.
- On a GPU the weights load straight onto the device (``device_map``): no full copy is staged in host
  memory first.
- The attention implementation is chosen before any weight loads: ``auto`` takes the fastest one the
  model's class supports on the device (flash-attention when installed on a GPU, else sdpa, else
  eager); an explicit one that cannot work is refused naming the setting and the values that work.
- A hybrid target (Gated DeltaNet, Mamba) about to run on a GPU without its linear-attention kernels is
  warned about before the weights load, with the pip command that fixes it; what ran (attention and each
  kernel package) is in `BackboneInfo.kernels` and the log (core/extraction/kernels.py).
- Capture uses forward hooks on the chosen decoder layers (and the final norm), not
  ``output_hidden_states``, which would keep every layer's activations alive at once.

Layer id ``i`` is the output of decoder layer ``i``. Hugging Face's ``hidden_states[i + 1]`` is the
same tensor for every layer but the last, where Hugging Face applies the final norm: that normed
tensor is what ``include_final`` stores as the final state.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import logging
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from hsx_dagster.core.extraction.kernels import (
    KernelUse,
    describe_kernels,
    fast_kernel_warning,
    kernel_packages_found,
    kernels_in_use,
)
from hsx_dagster.core.model.info import ModelInfo, text_weights_prefix, weight_names
from hsx_dagster.core.model.transformers_internals import AttentionFlags, attn_implementation_in_use
from hsx_dagster.core.settings.choices import AttnImplementation
from hsx_dagster.core.storage.format import dtype_name
from hsx_dagster.core.storage.provenance import FINAL_SLOT, StoredLayers

log = logging.getLogger(__name__)

ATTN_SETTING = "extraction.attn_implementation"
# Explicit values, fastest first: `auto` takes the first one that works for the model on the device.
ATTN_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(AttnImplementation)
# Where a checkpoint's text decoder lives under these prefixes, transformers maps it onto the text model itself.
_NATIVE_PREFIXES = ("", "model.")
_LAYER_LIST_NAMES = ("layers", "h", "blocks")
_WRAPPER_NAMES = ("model", "language_model", "text_model", "transformer", "decoder")
_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")


class BackboneError(RuntimeError):
    """The model directory cannot be used for extraction; the message says why."""


@dataclass(frozen=True)
class BackboneInfo:
    model_type: str
    num_layers: int  # decoder layers in the full model
    kept_layers: int  # decoder layers loaded
    hidden_size: int
    layer_ids: tuple[int, ...]
    include_final: bool
    compute_dtype: str
    device: str
    attn_implementation: str  # the one resolved and used (never `auto`)
    parameters: int  # parameters of the loaded (truncated) text decoder
    kernels: tuple[KernelUse, ...] = ()  # what each linear-attention kernel package runs (empty: none used)

    @property
    def layers(self) -> StoredLayers:
        """The states each token gets from this backbone."""
        return StoredLayers(self.layer_ids, self.include_final)


class Backbone:
    """A truncated decoder stack whose forward pass fills `captured` with the requested layers."""

    def __init__(self, model: torch.nn.Module, info: BackboneInfo) -> None:
        self.model = model
        self.info = info
        self.captured: dict[int | str, torch.Tensor] = {}
        layers = decoder_layers(model)
        self._handles = [layers[i].register_forward_hook(self._capture_hook(i)) for i in info.layer_ids]
        if info.include_final:
            self._handles.append(final_norm(model).register_forward_hook(self._capture_hook(FINAL_SLOT)))

    def _capture_hook(self, key: int | str):
        def hook(module, inputs, output):
            self.captured[key] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[int | str, torch.Tensor]:
        """Run the backbone; returns {layer id: [B, S, H], 'final': [B, S, H]} for this batch."""
        self.captured.clear()
        self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        captured, self.captured = self.captured, {}
        return captured

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _decoder_owner(model: torch.nn.Module, depth: int = 3) -> tuple[torch.nn.Module, torch.nn.ModuleList] | None:
    for name in _LAYER_LIST_NAMES:
        layers = getattr(model, name, None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return model, layers
    if depth == 0:
        return None
    for name in _WRAPPER_NAMES:
        inner = getattr(model, name, None)
        if isinstance(inner, torch.nn.Module) and inner is not model:
            found = _decoder_owner(inner, depth - 1)
            if found is not None:
                return found
    return None


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The text decoder's layers of ``model``: a bare decoder (``layers``, ``h``, ``blocks``) or any wrapper
    around one (``model.layers``, ``model.language_model.layers``, ``language_model.model.layers``,
    ``transformer.h``, ...). The one lookup used by the extraction and by the parity check's reference."""
    found = _decoder_owner(model)
    if found is None:
        raise BackboneError(f"{type(model).__name__}: cannot find the list of decoder layers")
    return found[1]


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The norm applied after the last decoder layer (what the LM head reads), beside the layers."""
    found = _decoder_owner(model)
    owner = found[0] if found is not None else model
    for name in _NORM_NAMES:
        norm = getattr(owner, name, None)
        if isinstance(norm, torch.nn.Module):
            return norm
    raise BackboneError(f"{type(model).__name__}: no final norm module found to capture the final state")


def truncated_text_config(config: Any, keep: int) -> Any:
    """A copy of ``config``'s text config with only the first ``keep`` decoder layers."""
    text_config = config.get_text_config(decoder=True)
    truncated = copy.deepcopy(text_config)
    truncated.num_hidden_layers = keep
    for per_layer in ("layer_types", "sliding_window_pattern_list"):
        if isinstance(getattr(truncated, per_layer, None), list):  # hybrid models list each layer's kind
            setattr(truncated, per_layer, getattr(truncated, per_layer)[:keep])
    return truncated


def text_model_class(text_config: Any, model_path: Path, trust_remote_code: bool = False) -> type:
    """The class ``AutoModel`` builds for ``text_config`` (the bare text decoder), found without building it;
    with ``trust_remote_code``, the model's own ``AutoModel`` class when its config names one."""
    from transformers import MODEL_MAPPING  # what AutoModel builds for each config class

    auto_map = getattr(text_config, "auto_map", None) or {}
    if trust_remote_code and "AutoModel" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return cast(type, get_class_from_dynamic_module(auto_map["AutoModel"], str(model_path)))
    try:
        return cast(type, MODEL_MAPPING[type(text_config)])
    except KeyError:
        raise BackboneError(
            f"the installed transformers has no text model class for model_type {text_config.model_type!r}"
        ) from None


_FLASH_DISTRIBUTIONS = {  # implementation -> (module, distribution)
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
    "flash_attention_4": ("flash_attn", "flash-attn-4"),
}


def _flash_installed(implementation: str) -> bool:
    module, distribution = _FLASH_DISTRIBUTIONS[implementation]
    if importlib.util.find_spec(module) is None:
        return False
    providers = importlib.metadata.packages_distributions().get(module, [])
    return distribution in {name.lower().replace("_", "-") for name in providers}


def _flash_usable(implementation: str) -> bool:
    """transformers' own check (version floors, CUDA), where this transformers has one."""
    import transformers.utils as tf_utils

    check = getattr(tf_utils, f"is_flash_attn_{implementation.removeprefix('flash_attention_')}_available", None)
    return bool(check()) if check is not None else True


def attention_support(flags: AttentionFlags, device: torch.device, compute_dtype: torch.dtype) -> dict[str, str | None]:
    """For every explicit implementation: None when it works for the model class of ``flags`` on ``device``
    in ``compute_dtype``, else why not. Class flags and installed packages only: nothing is loaded."""
    import transformers

    name = flags.name
    reasons: dict[str, str | None] = {}
    compatible = flags.flash_variants
    for implementation in ATTN_IMPLEMENTATIONS:
        reason: str | None = None
        if implementation == "sdpa":
            if not flags.sdpa:
                reason = f"{name} has no sdpa attention in transformers {transformers.__version__}"
        elif implementation.startswith("flash_attention_"):
            if not flags.flash:
                reason = f"{name} has no flash-attention support in transformers {transformers.__version__}"
            elif compatible is not None and implementation not in compatible:
                reason = f"{name} runs only these flash-attention variants: {', '.join(compatible)}"
            elif not _flash_installed(implementation):
                reason = f"{_FLASH_DISTRIBUTIONS[implementation][1]} is not installed"
            elif device.type != "cuda":
                reason = f"flash-attention needs a CUDA GPU and the device is {device}"
            elif not _flash_usable(implementation):
                reason = f"transformers {transformers.__version__} cannot use the installed {implementation} here"
            elif compute_dtype not in (torch.bfloat16, torch.float16):
                reason = (
                    f"flash-attention computes in bfloat16 or float16 and extraction.compute_dtype resolves to "
                    f"{dtype_name(compute_dtype)}"
                )
        reasons[implementation] = reason
    return reasons


def resolve_attn_implementation(
    requested: str, flags: AttentionFlags, device: torch.device | str, compute_dtype: torch.dtype
) -> str:
    """`auto`: the fastest implementation that works; an explicit one that cannot work raises, naming the
    setting and the values that work."""
    device = torch.device(device)
    support = attention_support(flags, device, compute_dtype)
    working = [name for name, reason in support.items() if reason is None]
    if requested == "auto":
        return working[0]  # eager always works
    if requested not in support:
        raise BackboneError(f"{ATTN_SETTING} is {requested!r}, not one of auto, {', '.join(ATTN_IMPLEMENTATIONS)}")
    reason = support[requested]
    if reason is not None:
        raise BackboneError(
            f"{ATTN_SETTING} is {requested} but {reason}; values that work for {flags.name} on {device}: "
            f"{', '.join(['auto', *working])} (auto picks {working[0]})"
        )
    return requested


@dataclass(frozen=True)
class LoadedDecoder:
    model: torch.nn.Module
    model_type: str
    num_layers: int
    kept_layers: int
    hidden_size: int
    attn_implementation: str
    parameters: int
    kernels: tuple[KernelUse, ...] = ()


def load_text_decoder(
    model_info: ModelInfo,
    keep: int | None,
    *,
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    warn: Callable[[str], None] | None = None,
) -> LoadedDecoder:
    """The text decoder of ``model_info`` (its directory checked by `check_model_dir`, which gives the `ModelInfo`)
    with its first ``keep`` layers (all when None), in eval mode, on ``device``; nothing else of the checkpoint
    (LM head, vision tower, MTP module, later layers) is built or read. Shared by the extraction and the parity
    check's reference. ``warn`` takes the warning about missing linear-attention kernels (default: the log)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    model_path = model_info.path
    device = torch.device(device)
    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    text_config = config.get_text_config(decoder=True)
    num_layers = int(text_config.num_hidden_layers)
    keep = num_layers if keep is None else keep
    if not 1 <= keep <= num_layers:
        raise BackboneError(f"cannot keep {keep} of {num_layers} decoder layers")
    truncated = truncated_text_config(config, keep)
    model_class: Any = text_model_class(truncated, model_path, trust_remote_code)
    attention = resolve_attn_implementation(attn_implementation, AttentionFlags.of(model_class), device, compute_dtype)
    warning = fast_kernel_warning(device.type, kernel_packages_found(model_class), model_class.__name__)
    if warning:
        (warn or log.warning)(warning)
    options: dict[str, Any] = {}
    prefix = text_weights_prefix(weight_names(model_path))
    if prefix is not None and prefix not in _NATIVE_PREFIXES:
        # e.g. Gemma 3 multimodal releases keep the text decoder under language_model.model.*
        options["key_mapping"] = {f"^{re.escape(prefix)}": "model."}
    if device.type == "cuda":
        options["device_map"] = {"": str(device)}  # straight onto the GPU: no full copy in host memory first

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the parts not loaded (head, vision tower, MTP, later layers) are expected
    try:
        model, loading = model_class.from_pretrained(
            str(model_path),
            config=truncated,
            dtype=compute_dtype,
            attn_implementation=attention,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **options,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if loading.get("missing_keys"):
        missing = sorted(loading["missing_keys"])
        raise BackboneError(
            f"{model_path}: {len(missing)} weights the text decoder needs are missing from the checkpoint "
            f"(first: {', '.join(missing[:5])}); refusing to extract from randomly initialised layers"
        )
    model.requires_grad_(False)
    model.eval()
    if device.type != "cuda":
        model.to(device)
    return LoadedDecoder(
        model=model,
        model_type=str(config.model_type),
        num_layers=num_layers,
        kept_layers=keep,
        hidden_size=int(text_config.hidden_size),
        attn_implementation=str(attn_implementation_in_use(model) or attention),
        parameters=sum(p.numel() for p in model.parameters()),
        kernels=kernels_in_use(model, device),
    )


def load_backbone(
    model: ModelInfo,
    layer_ids: Sequence[int],
    *,
    include_final: bool = False,
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    warn: Callable[[str], None] | None = None,
) -> Backbone:
    """Load only what the requested layers need of ``model``, on ``device``, in ``compute_dtype``, in eval mode;
    ``warn`` as in `load_text_decoder`."""
    if not layer_ids:
        raise BackboneError("no layers requested")
    num_layers = model.num_hidden_layers
    if max(layer_ids) >= num_layers or min(layer_ids) < 0:
        raise BackboneError(f"layer ids {list(layer_ids)} out of range for {num_layers} decoder layers")
    keep = StoredLayers(tuple(sorted(layer_ids)), include_final).kept_decoder_layers(num_layers)
    loaded = load_text_decoder(
        model,
        keep,
        device=device,
        compute_dtype=compute_dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        warn=warn,
    )
    dropped = num_layers - keep
    log.info(
        "loaded %s text decoder: %d of %d decoder layers%s, no LM head; %s",
        loaded.model_type,
        keep,
        num_layers,
        f" ({dropped} after layer {keep - 1} not loaded)" if dropped else "",
        describe_kernels(loaded.attn_implementation, loaded.kernels),
    )
    info = BackboneInfo(
        model_type=loaded.model_type,
        num_layers=num_layers,
        kept_layers=keep,
        hidden_size=loaded.hidden_size,
        layer_ids=tuple(sorted(layer_ids)),
        include_final=include_final,
        compute_dtype=dtype_name(compute_dtype),
        device=str(device),
        attn_implementation=loaded.attn_implementation,
        parameters=loaded.parameters,
        kernels=loaded.kernels,
    )
    return Backbone(loaded.model, info)
