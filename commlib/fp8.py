"""FP8 E4M3 with one float32 scale per 128 channels of a token (DeepSeek-V3's activation format).

scale = amax(|x| over the 128-channel block) / 448, so the block's largest value maps to E4M3's
largest finite value. An all-zero block gets scale 1e-4 / 448 (any positive value round-trips 0).
Round-trip error: E4M3 keeps 3 mantissa bits, so |x - back(cast(x))| <= 2^-4 * |x| + amax * 2^-9
per element (relative half-ulp for normals, absolute bound in the subnormal range).
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
BLOCK = 128
_MIN_AMAX = 1e-4


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] (H % 128 == 0, any float dtype) -> (E4M3 [T, H], float32 scales [T, H / 128])."""
    if x.dim() != 2:
        raise ValueError(f"per_token_cast_to_fp8: x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    T, H = x.shape
    if H % BLOCK != 0:
        raise ValueError(f"per_token_cast_to_fp8: hidden ({H}) must be a multiple of {BLOCK}")
    blocks = x.float().view(T, H // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=_MIN_AMAX)
    scales = amax / FP8_MAX
    q = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn)
    return q.view(T, H), scales.contiguous()


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(E4M3 [T, H], float32 scales [T, H / 128]) -> [T, H] in ``dtype``."""
    if x_fp8.dim() != 2 or scales.dim() != 2:
        raise ValueError("per_token_cast_back: x_fp8 and scales must be 2-D")
    T, H = x_fp8.shape
    if H % BLOCK != 0 or scales.shape != (T, H // BLOCK):
        raise ValueError(f"per_token_cast_back: scales must be [{T}, {H // BLOCK}], got {tuple(scales.shape)}")
    blocks = x_fp8.float().view(T, H // BLOCK, BLOCK) * scales.float().unsqueeze(2)
    return blocks.view(T, H).to(dtype)


def roundtrip_bound(x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |x - back(cast(x))| stated in the module docstring."""
    T, H = x.shape
    blocks = x.float().view(T, H // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True).clamp(min=_MIN_AMAX)
    return (blocks.abs() * 2.0 ** -4 + amax * 2.0 ** -9).view(T, H)
