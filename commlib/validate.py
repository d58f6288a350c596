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


def refuse_inside_capture(what: str) -> None:
    """Raise RuntimeError naming ``what`` (e.g. "[commlib rank 0] Buffer") when the current CUDA
    stream is capturing a graph: building a buffer runs collectives and allocates communication
    memory, which a capture cannot record (it would fail later with an unrelated CUDA error, or
    leave the peers waiting in the collective)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{what}: built inside a CUDA graph capture. Building one runs collectives and allocates "
            "communication memory, which a capture cannot record; build it before torch.cuda.graph(...) "
            "and capture only its dispatch / combine calls")


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
    if device is not None and t.device != device and not same_device(t.device, device):
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
    """x (bf16 [T, H]) or (fp8 [T, H], scales [T, S]) -> (data, scales or None).

    Scales are float32, or int32 (UE8M0 exponents packed four per word), of any strides (DeepGEMM's
    column-major ``s.T.contiguous().T`` included) and any width 1 <= S <= H / 128: [T, 1] per token,
    [T, H / 128] per 128-channel block, [T, H / 512] packed UE8M0. They are moved, never read.
    """
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{_where(rank)} x as a tuple must be (fp8 [T, H], scales [T, S]), got {len(x)} items")
        data, scales = x
        check_tensor("x[0] (FP8 data)", data, rank, dtype=torch.float8_e4m3fn, dim=2, device=device)
        if not isinstance(scales, torch.Tensor):
            raise TypeError(f"{_where(rank)} x[1] (FP8 scales) must be a torch.Tensor, got {type(scales).__name__}")
        if scales.dtype not in (torch.float32, torch.int32):
            raise TypeError(f"{_where(rank)} x[1] (FP8 scales) must be torch.float32 or torch.int32 (packed UE8M0), "
                            f"got {scales.dtype}")
        if scales.dim() != 2:
            raise ValueError(f"{_where(rank)} x[1] (FP8 scales) must be 2-D [T, S], got shape {tuple(scales.shape)}")
        if scales.device != device and not same_device(scales.device, device):
            raise ValueError(f"{_where(rank)} x[1] (FP8 scales) is on {scales.device}, but this Buffer works on {device}")
        T, H = data.shape
        if H % BLOCK != 0:
            raise ValueError(f"{_where(rank)} FP8 x: hidden ({H}) must be a multiple of {BLOCK}")
        if scales.shape[0] != T or not 1 <= scales.shape[1] <= H // BLOCK:
            raise ValueError(f"{_where(rank)} x[1] (FP8 scales) must have shape [{T}, S] with 1 <= S <= "
                             f"{H // BLOCK} (hidden / {BLOCK}), got {tuple(scales.shape)}")
        return data, scales
    check_tensor("x", x, rank, dtype=torch.bfloat16, dim=2, device=device)
    return x, None


def scales_carrier(scales: torch.Tensor, hidden: int) -> torch.Tensor:
    """FP8 scales of any width, dtype and strides -> the float32 [T, hidden / 128] contiguous rows the
    transports move (the bits of ``scales`` in the first S columns, zeros after)."""
    W = hidden // BLOCK
    if scales.dtype == torch.float32 and scales.shape[1] == W and scales.is_contiguous():
        return scales
    carrier = torch.zeros(scales.shape[0], W, dtype=torch.float32, device=scales.device)
    carrier.view(torch.int32)[:, :scales.shape[1]] = scales.view(torch.int32) if scales.dtype == torch.float32 \
        else scales
    return carrier


def scales_from_carrier(recv: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The received carrier rows [N, hidden / 128] float32 -> [N, width] ``dtype`` scales (contiguous)."""
    if recv.shape[1] == width and dtype == torch.float32:
        return recv
    return recv.view(torch.int32)[:, :width].contiguous().view(dtype)


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
