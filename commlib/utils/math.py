"""Small integer and tensor helpers shared across layers."""
from __future__ import annotations

from typing import Optional

import torch

# Larger than any row index or rank: ``key = major * SORT_KEY_BIG + minor`` sorts by (major, minor).
SORT_KEY_BIG = 1 << 31


def align_up(n: int, a: int = 16) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def aligned_16(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Contiguous and 16-byte aligned (the kernels use 16-byte vectors; a sliced view may not be)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
