"""The baseline every benchmark runs next to commlib: Megatron's all-to-all token dispatcher.

What Megatron-LM's ``MoEAlltoAllTokenDispatcher`` does with plain ``torch.distributed``:
  dispatch  1. count exchange: all_to_all_single of this rank's per-destination counts (and
               per-expert counts, so the receiver knows its tokens per local expert);
               the counts cross to the host (the splits of step 3 are Python ints)
            2. permute: copy every token once per destination rank, sorted by destination
               (the same row set commlib moves: one copy per (token, destination rank))
            3. all_to_all_single of the rows
  combine   4. all_to_all_single back (the reverse splits)
            5. unpermute: sum the rows of each token, in float32, in rank order, then cast

Rows arrive grouped by source rank in rank order, token order within a source: the order
commlib's dispatch uses, so ``recv_x`` here equals commlib's bit for bit, and on one node so
does the combined output (same summation order, see ``backends/base.py``).

gloo's all_to_all_single refuses bf16 / fp8 / int16 ("Invalid scalar type"), and the baseline
only moves bytes, so rows always travel as uint8 (a free ``view``; NCCL moves the same bytes).

Legend: T tokens on this rank, H hidden, K top-k slots, E experts, R ranks, S rows this rank
sends (token copies), N rows this rank receives.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.distributed as dist

from commlib.layout import token_in_rank

# x, or (x_fp8, scales) as DeepEP's dispatch accepts
Rows = Union[torch.Tensor, tuple]


@dataclasses.dataclass
class A2AState:
    """What combine needs from dispatch (Megatron keeps the same in its dispatcher object)."""
    token_of_row: torch.Tensor          # [S] int64: source token of each sent row, in send order
    dest_of_row: torch.Tensor           # [S] int64: destination rank of each sent row
    input_splits: list                  # [R] rows sent to each rank
    output_splits: list                 # [R] rows received from each rank
    num_recv_tokens_per_expert: list    # [E / R] rows received per local expert
    num_tokens: int                     # T
    hidden: int                         # H


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[rows, ...] any dtype -> [rows, bytes per row] uint8, no copy for contiguous input."""
    row_bytes = t.element_size()
    for d in t.shape[1:]:
        row_bytes *= d
    if t.numel() == 0:
        return torch.empty(t.shape[0], row_bytes, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(t.shape[0], -1).view(torch.uint8)


def _comm_device(group) -> torch.device:
    """Where count tensors must live for this group's backend (NCCL: the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_counts(topk_idx_TK: torch.Tensor, num_experts: int, group=None
                    ) -> tuple[torch.Tensor, list, list, list]:
    """Step 1: is_token_in_rank [T, R], input_splits, output_splits, received rows per local expert.

    One all_to_all_single of a [R, 1 + E/R] int64 table: column 0 counts token copies for each
    destination, the rest count top-k hits on each of that destination's experts.
    """
    R = dist.get_world_size(group)
    if num_experts % R != 0:
        raise ValueError(f"a2a_dispatch: num_experts ({num_experts}) must be a multiple of the world size ({R})")
    num_local = num_experts // R
    is_token_in_rank_TR = token_in_rank(topk_idx_TK, num_experts, R)
    send_counts = torch.zeros(R, 1 + num_local, dtype=torch.int64, device=topk_idx_TK.device)
    send_counts[:, 0] = is_token_in_rank_TR.sum(dim=0)
    valid = topk_idx_TK[topk_idx_TK >= 0]
    send_counts[:, 1:] = torch.bincount(valid, minlength=num_experts).view(R, num_local)
    dev = _comm_device(group)
    send_counts = send_counts.to(dev)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_cpu = recv_counts.cpu()  # the host sync Megatron's dispatcher also makes
    input_splits = send_counts[:, 0].tolist()
    output_splits = recv_cpu[:, 0].tolist()
    per_expert = recv_cpu[:, 1:].sum(dim=0).tolist()
    return is_token_in_rank_TR, input_splits, output_splits, per_expert


def a2a_dispatch(x: Rows, topk_idx: torch.Tensor, num_experts: int, group=None
                 ) -> tuple[Rows, A2AState]:
    """Send every token once to each rank that holds one of its top-k experts.

    x: [T, H] any dtype (bf16), or a tuple (x_fp8 [T, H] float8_e4m3fn, scales [T, H / 128] float32)
    topk_idx: [T, K] int64, -1 for empty slots
    Returns (recv_x [N, H] (or (recv_x, recv_scales)), state for ``a2a_combine``).
    """
    scales = None
    if isinstance(x, (tuple, list)):
        x, scales = x
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"a2a_dispatch: x must be [T, H] and topk_idx [T, K]; got {tuple(x.shape)} "
                         f"and {tuple(topk_idx.shape)}")
    T, H = x.shape
    is_token_in_rank_TR, input_splits, output_splits, per_expert = exchange_counts(topk_idx, num_experts, group)

    # Permute: (destination, token) pairs sorted by destination, then token (nonzero is row-major).
    dest_of_row, token_of_row = is_token_in_rank_TR.t().nonzero(as_tuple=True)
    parts = [_as_bytes(x).index_select(0, token_of_row)]
    if scales is not None:
        parts.append(_as_bytes(scales).index_select(0, token_of_row))
    send_SB = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    row_bytes = send_SB.shape[1]

    dev = _comm_device(group)
    recv_NB = torch.empty(sum(output_splits), row_bytes, dtype=torch.uint8, device=dev)
    dist.all_to_all_single(recv_NB, send_SB.to(dev), output_splits, input_splits, group=group)
    recv_NB = recv_NB.to(x.device)

    x_bytes = H * x.element_size()
    recv_x = recv_NB[:, :x_bytes].contiguous().view(x.dtype)
    state = A2AState(token_of_row, dest_of_row, input_splits, output_splits, per_expert, T, H)
    if scales is None:
        return recv_x, state
    recv_scales = recv_NB[:, x_bytes:].contiguous().view(scales.dtype)
    return (recv_x, recv_scales), state


def a2a_combine(y: torch.Tensor, state: A2AState, group=None) -> torch.Tensor:
    """Send every received row back and sum the rows of each token.

    y: [N, H] bf16, rows in the order ``a2a_dispatch`` delivered them.
    Returns combined [T, H] in y's dtype: float32 sum over the token's ranks in rank order, cast once.
    """
    N = sum(state.output_splits)
    if y.dim() != 2 or y.shape[0] != N:
        raise ValueError(f"a2a_combine: y must be [{N}, H] (rows as dispatched), got {tuple(y.shape)}")
    H = y.shape[1]
    dev = _comm_device(group)
    back_SB = torch.empty(sum(state.input_splits), H * y.element_size(), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(back_SB, _as_bytes(y).to(dev), state.input_splits, state.output_splits, group=group)
    back_SH = back_SB.to(y.device).view(y.dtype).view(-1, H)

    # Unpermute. One index_add_ per destination rank: within one rank every token appears at most
    # once, so each add is deterministic (no atomics race) and the sum runs in rank order.
    acc_TH = torch.zeros(state.num_tokens, H, dtype=torch.float32, device=y.device)
    start = 0
    for count in state.input_splits:
        if count:
            acc_TH.index_add_(0, state.token_of_row[start:start + count], back_SH[start:start + count].float())
        start += count
    return acc_TH.to(y.dtype)


def count_wrong(got: Optional[torch.Tensor], want: torch.Tensor) -> int:
    """Elements of ``got`` that differ bit-wise from ``want`` (all of them if the shapes differ)."""
    if got is None or tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return int(want.numel())
    if want.numel() == 0:
        return 0
    g = _as_bytes(got.reshape(got.shape[0], -1).contiguous()).view(got.shape[0], -1, got.element_size())
    w = _as_bytes(want.reshape(want.shape[0], -1).contiguous()).view(want.shape[0], -1, want.element_size())
    return int((g != w.to(g.device)).any(dim=2).sum())


def count_wrong_close(got: Optional[torch.Tensor], want: torch.Tensor, sum_abs: torch.Tensor,
                      partial_roundings: int) -> int:
    """Elements of a combined output outside the rounding bound: exact when ``partial_roundings``
    is 0; otherwise each rounding of a partial sum to bf16 may add 2^-8 of the summed magnitude.
    The final cast adds one bf16 half-ulp of the result on either side."""
    if got is None or tuple(got.shape) != tuple(want.shape):
        return int(want.numel())
    if partial_roundings == 0:
        return count_wrong(got, want)
    g, w = got.float(), want.float().to(got.device)
    bound = sum_abs.to(got.device) * (partial_roundings * 2.0 ** -8) + w.abs() * 2.0 ** -8 + 1e-30
    return int(((g - w).abs() > bound).sum())
