"""``deep_ep.utils.math`` (DeepEP V2's module path): integer helpers, FP8 casts and the comparison metric.

Legend: T tokens, H hidden, S = ceil(H / 128) scale columns.
The casts are commlib's (``commlib.fp8``: one float32 scale per 128 channels, amax / 448), with
hidden sizes that are not multiples of 128 padded with zeros as V2 does.
"""
from __future__ import annotations

from typing import Tuple

import torch

from commlib import fp8
from commlib.utils.math import ceil_div


def align(x: int, y: int) -> int:
    """x rounded up to a multiple of y."""
    return ceil_div(x, y) * y


def safe_div(a, b):
    """a / b, and 0 for 0 / 0 (a non-zero numerator over 0 still raises ZeroDivisionError)."""
    if b == 0 and a == 0:
        return 0
    return a / b


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - the cosine-like similarity 2<x', y'> / (|x'|^2 + |y'|^2) of x' = x + 1 and y' = y + 1, in
    float64: 0 when equal, small when close."""
    a, b = x.double() + 1, y.double() + 1
    return float(1 - 2 * (a * b).sum() / (a.square().sum() + b.square().sum()))


def _pad_to_block(x: torch.Tensor) -> torch.Tensor:
    pad = align(x.shape[1], fp8.BLOCK) - x.shape[1]
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def per_token_cast_to_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (E4M3 [T, H], float32 scales [T, S]); the last block zero-padded when H % 128."""
    if x.dim() != 2:
        raise ValueError(f"per_token_cast_to_fp8: x must be [tokens, hidden], got shape {tuple(x.shape)}")
    q, scales = fp8.per_token_cast_to_fp8(_pad_to_block(x))
    return q[:, :x.shape[1]].contiguous(), scales


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """(E4M3 [T, H], scales [T, S] float32, or int32 packed UE8M0 [T, S / 4]) -> bf16 [T, H].
    Scales of any strides (column-major included)."""
    if x_fp8.numel() == 0:
        return x_fp8.to(torch.bfloat16)
    if x_scales.dtype == torch.int32:  # four exponent bytes per int: 2 ** (byte - 127)
        x_scales = (x_scales.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    T, H = x_fp8.shape
    padded = _pad_to_block(x_fp8.view(torch.uint8)).view(x_fp8.dtype)
    out = fp8.per_token_cast_back(padded, x_scales.float().contiguous(), torch.bfloat16)
    return out[:, :H].contiguous()


def count_bytes(*tensors) -> int:
    """Bytes of the tensors, nested tuples / lists included; None counts 0."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total


def hash_tensor(t: torch.Tensor) -> int:
    """The sum of the tensor's bytes read as int32 words (a cheap fingerprint; one host read)."""
    return int(t.view(torch.int32).sum().item())


def hash_tensors(*tensors) -> int:
    """XOR of hash_tensor over the tensors (nested tuples / lists included; None skipped)."""
    value = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            value ^= hash_tensors(*t)
        elif isinstance(t, torch.Tensor):
            value ^= hash_tensor(t)
    return value


__all__ = ["align", "calc_diff", "ceil_div", "count_bytes", "hash_tensor", "hash_tensors",
           "per_token_cast_back", "per_token_cast_to_fp8", "safe_div"]
