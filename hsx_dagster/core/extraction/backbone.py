"""Load the target model for extraction: the backbone only, cut after the deepest layer needed,
with forward hooks that capture exactly the requested layers.

- No LM head: `AutoModel` loads the decoder stack without it, so no logits are ever computed (for
  a 248K vocabulary the logits alone outweigh the hidden states many times over).
- Layers after the deepest requested one are never loaded (`num_hidden_layers` is lowered before
  loading); all layers stay only when the final-norm output is requested.
- Capture uses forward hooks on the chosen decoder layers (and the final norm), not
  ``output_hidden_states``, which would keep every layer's activations alive at once.

Layer id ``i`` is the output of decoder layer ``i``. Hugging Face's ``hidden_states[i + 1]`` is the
same tensor for every layer but the last, where Hugging Face applies the final norm: that normed
tensor is what ``include_final`` stores as the final state.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hsx_dagster.core.model_info import ModelDirError, check_model_dir

log = logging.getLogger(__name__)


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
    attn_implementation: str
    parameters: int  # parameters of the loaded (truncated) backbone


class Backbone:
    """A truncated decoder stack whose forward pass fills `captured` with the requested layers."""

    def __init__(self, model: torch.nn.Module, info: BackboneInfo) -> None:
        self.model = model
        self.info = info
        self.captured: dict[int | str, torch.Tensor] = {}
        layers = decoder_layers(model)
        self._handles = [layers[i].register_forward_hook(self._capture_hook(i)) for i in info.layer_ids]
        if info.include_final:
            norm = getattr(model, "norm", None) or getattr(model, "final_layernorm", None)
            if norm is None:
                raise BackboneError(f"{info.model_type}: no final norm module found to capture the final state")
            self._handles.append(norm.register_forward_hook(self._capture_hook("final")))

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


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    for name in ("layers", "h", "blocks"):
        layers = getattr(model, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise BackboneError(f"{type(model).__name__}: cannot find the list of decoder layers")


def load_backbone(
    model_path: Path,
    layer_ids: Sequence[int],
    *,
    include_final: bool = False,
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> Backbone:
    """Load only what the requested layers need, on ``device``, in ``compute_dtype``, in eval mode."""
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    model_path = Path(model_path)
    try:
        check_model_dir(model_path)
    except ModelDirError as exc:
        raise BackboneError(str(exc)) from None
    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise BackboneError(
            "extraction.attn_implementation is flash_attention_2 but flash-attn is not installed; use sdpa"
        )
    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    text_config = getattr(config, "text_config", None) or config
    num_layers = text_config.num_hidden_layers
    if not layer_ids:
        raise BackboneError("no layers requested")
    if max(layer_ids) >= num_layers or min(layer_ids) < 0:
        raise BackboneError(f"layer ids {list(layer_ids)} out of range for {num_layers} decoder layers")
    keep = num_layers if include_final else max(layer_ids) + 1
    truncated = copy.deepcopy(text_config)
    truncated.num_hidden_layers = keep
    if isinstance(getattr(truncated, "layer_types", None), list):  # hybrid models list each layer's kind
        truncated.layer_types = truncated.layer_types[:keep]

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the dropped layers and LM head are reported below, once
    try:
        model, loading = AutoModel.from_pretrained(
            str(model_path),
            config=truncated,
            dtype=compute_dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if loading.get("missing_keys"):
        missing = sorted(loading["missing_keys"])
        raise BackboneError(
            f"{model_path}: {len(missing)} weights the backbone needs are missing from the checkpoint "
            f"(first: {', '.join(missing[:5])}); refusing to extract from randomly initialised layers"
        )
    dropped = num_layers - keep
    log.info(
        "loaded %s backbone: %d of %d decoder layers%s, no LM head",
        config.model_type,
        keep,
        num_layers,
        f" ({dropped} after layer {keep - 1} not loaded)" if dropped else "",
    )
    model.requires_grad_(False)
    model.eval()
    model.to(device)
    info = BackboneInfo(
        model_type=str(config.model_type),
        num_layers=num_layers,
        kept_layers=keep,
        hidden_size=int(text_config.hidden_size),
        layer_ids=tuple(sorted(layer_ids)),
        include_final=include_final,
        compute_dtype=str(compute_dtype).removeprefix("torch."),
        device=str(device),
        attn_implementation=str(getattr(model.config, "_attn_implementation", attn_implementation)),
        parameters=sum(p.numel() for p in model.parameters()),
    )
    return Backbone(model, info)
