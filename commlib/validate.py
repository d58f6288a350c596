"""Input checks the Buffer runs before any byte moves. Every message names the argument, the rank
and what was expected, so a wrong call fails loudly and identically on every backend."""
from __future__ import annotations

from typing import Optional

import torch

from commlib.config import MAX_TOPK
from commlib.fp8 import BLOCK
from commlib.utils.errors import CommlibError  # noqa: F401 - re-exported




def _where(rank: int) -> str:
    return f"[commlib rank {rank}]"


def check_tensor(name: str, t, rank: int, *, dtype=None, dim: Optional[int] = None,
                 device: Optional[torch.device] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_where(rank)} {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{_where(rank)} {name} must be {want}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{_where(rank)} {name} must be {dim}-D, got shape {tuple(t.shape)}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{_where(rank)} {name} is on {t.device}, but this Buffer works on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{_where(rank)} {name} must be contiguous (call .contiguous() first)")


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True


def split_x(x, rank: int, device: torch.device):
    """x (bf16 [T, H]) or (fp8 [T, H], float32 scales [T, H/128]) -> (data, scales or None)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{_where(rank)} x as a tuple must be (fp8 [T, H], scales [T, H/128]), got {len(x)} items")
        data, scales = x
        check_tensor("x[0] (FP8 data)", data, rank, dtype=torch.float8_e4m3fn, dim=2, device=device)
        check_tensor("x[1] (FP8 scales)", scales, rank, dtype=torch.float32, dim=2, device=device)
        T, H = data.shape
        if H % BLOCK != 0:
            raise ValueError(f"{_where(rank)} FP8 x: hidden ({H}) must be a multiple of {BLOCK}")
        if tuple(scales.shape) != (T, H // BLOCK):
            raise ValueError(f"{_where(rank)} x[1] (FP8 scales) must have shape [{T}, {H // BLOCK}], "
                             f"got {tuple(scales.shape)}")
        return data, scales
    check_tensor("x", x, rank, dtype=torch.bfloat16, dim=2, device=device)
    return x, None


def check_routing(topk_idx, topk_weights, num_tokens: int, rank: int, device: torch.device) -> None:
    check_tensor("topk_idx", topk_idx, rank, dtype=torch.int64, dim=2, device=device)
    T, K = topk_idx.shape
    if T != num_tokens:
        raise ValueError(f"{_where(rank)} topk_idx has {T} rows but x has {num_tokens} tokens")
    if not 0 < K <= MAX_TOPK:
        raise ValueError(f"{_where(rank)} topk_idx has {K} columns; top-k must be in [1, {MAX_TOPK}]")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, rank, dtype=torch.float32, dim=2, device=device)
        if tuple(topk_weights.shape) != (T, K):
            raise ValueError(f"{_where(rank)} topk_weights must have the shape of topk_idx {(T, K)}, "
                             f"got {tuple(topk_weights.shape)}")


def check_num_experts(num_experts: int, num_ranks: int, rank: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"{_where(rank)} num_experts must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks != 0:
        raise ValueError(f"{_where(rank)} num_experts ({num_experts}) must be divisible by the number of "
                         f"ranks ({num_ranks})")


def expert_id_error(topk_idx: torch.Tensor, num_experts: int) -> Optional[str]:
    """Message if topk_idx holds ids outside [-1, num_experts) (host check: syncs on CUDA)."""
    if topk_idx.numel() == 0:
        return None
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        return (f"topk_idx holds expert id {bad} outside [-1, {num_experts}) "
                f"(num_experts={num_experts}; -1 marks an empty slot)")
    return None


def check_layout(name: str, t, shape: tuple, dtype, rank: int, device: torch.device) -> None:
    check_tensor(name, t, rank, dtype=dtype, device=device)
    if tuple(t.shape) != shape:
        raise ValueError(f"{_where(rank)} {name} must have shape {list(shape)}, got {list(t.shape)} "
                         "(pass what get_dispatch_layout returned)")
