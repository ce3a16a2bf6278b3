"""Block-scaled fp8 (e4m3) storage of hidden states: half the bytes of bfloat16 on disk and on the
device-to-host copy, at a few percent relative error per token (measured by `make bench`, docs/benchmarks.md).

Each token's vector (per layer) is cut into blocks of ``block_size`` consecutive channels, and each
block gets its own scale: the power of two that brings the block's absolute maximum into e4m3's
range (<= 448). Then ``value ~= float(q) * scale``.

Why blocks: real LLM hidden states carry a few "massive activations" (fixed channels 10^3-10^4 times
the median). One scale per whole vector pushes every other channel of that token into e4m3's
subnormal range. Measured on 4,096-channel vectors with two such channels (8,000 and -4,000 against
a typical 0.1), the relative error of the other channels is:

    per vector: 14.0%    block 512: 6.0%    block 256: 4.6%    block 128: 3.8%    block 32: 3.0%

128 keeps the outlier's damage to its own block at 1.6% extra bytes (block 32 would cost 6.3%).
The per-token error is set by e4m3's 3 mantissa bits: 2.4% on these vectors, 2.6% on the demo model.

Why powers of two: dividing by one is exact, so the only error is the rounding to e4m3, a scale
is stored exactly in bfloat16 (2 bytes, bfloat16 has float32's exponent range), and de-quantising
in bfloat16 is exact as well (e4m3's 3 mantissa bits fit in bfloat16's 7).
"""

from __future__ import annotations

import math

import torch

from hsx_dagster.core.storage.format import FP8_DTYPE, SCALES_SUFFIX, dtype_name

FP8_MAX = 448.0  # the largest finite e4m3fn value; casting beyond it does not saturate, hence the clamp
SCALE_DTYPE = torch.bfloat16
BLOCK_SIZE = 128
MIN_SCALE_EXPONENT = -126  # the smallest normal float32 / bfloat16 power of two


def block_size_for(hidden_size: int, preferred: int = BLOCK_SIZE) -> int:
    """``preferred`` when it divides the hidden size, else the largest power of two below it that
    does (small test models), else one block per vector."""
    block = preferred
    while block >= 8:
        if hidden_size % block == 0:
            return block
        block //= 2
    return hidden_size


def quantize(states: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., hidden]`` -> (e4m3 ``[..., hidden]``, bfloat16 power-of-two scales ``[..., hidden / block_size]``).

    Runs on the tensor's own device, so quantised states are what crosses to the host.
    """
    *lead, hidden = states.shape
    blocks = states.float().reshape(*lead, hidden // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # frexp gives amax / 448 = m * 2^e with 0.5 <= m < 1, so amax / 2^e <= 448 exactly.
    _, exponent = torch.frexp(amax / FP8_MAX)
    scales = torch.ldexp(torch.ones_like(amax), exponent.clamp_min(MIN_SCALE_EXPONENT))
    quantized = (blocks / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.reshape(states.shape), scales.squeeze(-1).to(SCALE_DTYPE)


def dequantize(quantized: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize` (up to e4m3 rounding), in ``dtype``."""
    *lead, hidden = quantized.shape
    block_size = hidden // scales.shape[-1]
    blocks = quantized.to(dtype).reshape(*lead, hidden // block_size, block_size)
    return (blocks * scales.to(dtype).unsqueeze(-1)).reshape(quantized.shape)


def scale_layout(hidden_size: int) -> dict:
    """How the scales are stored, for the manifest and the chunk metadata (readers that de-quantise
    on their own device need nothing else)."""
    block = block_size_for(hidden_size)
    return {
        "format": "float8_e4m3fn",
        "block_size": block,
        "scale_dtype": dtype_name(SCALE_DTYPE),
        "scale_tensor_suffix": SCALES_SUFFIX,
        "scale_shape": f"[tokens, layers, {hidden_size // block}] (hidden_states), "
        f"[tokens, {hidden_size // block}] (final_hidden_states)",
        "dequantize": "value = float(q) * scale[..., channel // block_size]; scales are powers of two",
    }


def bytes_per_vector(hidden_size: int, storage_dtype: torch.dtype) -> int:
    """Bytes one stored ``hidden``-vector takes on disk, scales included."""
    if storage_dtype == FP8_DTYPE:
        blocks = math.ceil(hidden_size / block_size_for(hidden_size))
        return hidden_size + blocks * SCALE_DTYPE.itemsize
    return hidden_size * storage_dtype.itemsize
