"""A Mixture-of-Experts layer with expert parallelism through Buffer + commlib.training.ops (custom ops:
torch.compile traces the layer whole), and its single-process equivalent.

Legend: T tokens on this rank, H hidden, E experts, L local experts (E / ranks), K top-k, N rows
this rank received.

Numerics, stated once: activations cross the wire in bf16 (dispatch moves ``x_TH.to(bf16)``,
the expert partial sum of a row is cast to bf16 before combine, combine sums in float32 and
returns bf16). The single-process layer (``buffer=None``) reproduces exactly that rounding for a
world of ``num_ranks`` virtual ranks: every rank's experts run on the same rows, in the same order,
as they would behind a real dispatch, and the emulated dispatch/combine sum in float32 in rank
order. The forward is therefore bit-identical to expert parallelism with the same parameters;
the backward differs only where the replicated (non-expert) parameters' gradients are summed
across ranks by an all-reduce instead of inside one matmul.

Parameters: with ``full_init=True`` (default) every rank draws the full [E, ...] expert tensors
from the torch RNG and keeps its slice, so an expert-parallel model and a single-process model
built after the same ``torch.manual_seed`` hold identical parameters. ``full_init=False`` draws
only the local experts (big models; benchmarks).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8
from commlib.layout import local_expert_ids, token_in_rank
from commlib.training import ops
from commlib.training.moe.config import COMM_DTYPE, MoEConfig
from commlib.training.moe.experts import Experts, SwiGLU
from commlib.training.moe.router import Router


# ------------------------------------------------------------------------------------------------
# Emulated communication for the single-process layer (same rounding as Buffer.dispatch/combine)
# ------------------------------------------------------------------------------------------------

class _EmulatedDispatch(torch.autograd.Function):
    """x_TH bf16 -> rows of every virtual rank; backward sums in float32 in rank order (= combine)."""

    @staticmethod
    def forward(ctx, x_TH, *rows_per_rank):
        ctx.num_tokens = x_TH.shape[0]
        ctx.save_for_backward(*rows_per_rank)
        return tuple(x_TH.index_select(0, rows) for rows in rows_per_rank)

    @staticmethod
    def backward(ctx, *grads):
        rows_per_rank = ctx.saved_tensors
        acc = None
        for rows, g in zip(rows_per_rank, grads):
            if g is None:
                continue
            if acc is None:
                acc = torch.zeros(ctx.num_tokens, g.shape[1], dtype=torch.float32, device=g.device)
            acc[rows] += g.float()
        return (None if acc is None else acc.to(COMM_DTYPE),) + (None,) * len(rows_per_rank)


class _FP8StraightThrough(torch.autograd.Function):
    """E4M3 round trip of x (what an FP8 dispatch delivers); the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x):
        return per_token_cast_back(*per_token_cast_to_fp8(x), x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _EmulatedCombine(torch.autograd.Function):
    """Rows of every virtual rank (bf16) -> float32 sum in rank order -> bf16; backward = copy back."""

    @staticmethod
    def forward(ctx, num_tokens, rows_per_rank, *ys):
        ctx.rows_per_rank = rows_per_rank
        acc = torch.zeros(num_tokens, ys[0].shape[1], dtype=torch.float32, device=ys[0].device)
        for rows, y in zip(rows_per_rank, ys):
            acc[rows] += y.float()
        return acc.to(COMM_DTYPE)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.to(COMM_DTYPE)
        return (None, None) + tuple(grad.index_select(0, rows) for rows in ctx.rows_per_rank)


# ------------------------------------------------------------------------------------------------
# The MoE layer
# ------------------------------------------------------------------------------------------------

class MoELayer(nn.Module):
    """Router + routed experts (+ shared experts), expert-parallel over ``buffer``'s ranks.

    Args:
      cfg: the layer's shapes and choices.
      buffer: a commlib Buffer (expert parallelism: this rank holds experts [rank * L, (rank+1) * L)),
        or None: all experts local, emulating ``num_ranks`` ranks' bf16 communication exactly.
      num_ranks: without a Buffer, the ranks to emulate (default 1).
      full_init: draw the full [E, ...] expert tensors and keep this rank's slice (module docstring).
      device: where the parameters live.

    forward(x_TH [T, H], any float dtype) -> [T, H] in x's dtype.
    """

    def __init__(self, cfg: MoEConfig, buffer=None, num_ranks: Optional[int] = None, full_init: bool = True,
                 device=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.buffer = buffer
        if buffer is not None:
            ops.register_buffer(buffer)   # the custom ops reach it by id (a compiled forward cannot register)
        self.rank = buffer.rank if buffer is not None else 0
        self.num_ranks = buffer.num_ranks if buffer is not None else (num_ranks or 1)
        if cfg.num_experts % self.num_ranks != 0:
            raise ValueError(f"MoELayer: num_experts ({cfg.num_experts}) must be divisible by the {self.num_ranks} ranks")
        self.num_local = cfg.num_experts // self.num_ranks if buffer is not None else cfg.num_experts
        first = self.rank * self.num_local if buffer is not None else 0
        self.router = Router(cfg, device=device)
        self.experts = Experts(cfg.hidden, cfg.expert_hidden, cfg.num_experts, first, self.num_local,
                               cfg.expert_dtype, full_init=full_init or buffer is None, device=device)
        self.shared = (SwiGLU(cfg.hidden, cfg.num_shared_experts * cfg.expert_hidden, device=device)
                       if cfg.num_shared_experts > 0 else None)

    # --- pieces, shared by forward() and the pipeline stages (MoEBlock.stage_*) ---
    def route(self, x_TH: torch.Tensor):
        """-> (x_TH bf16 for the wire, topk_idx [T, K] int64, topk_weights [T, K] float32)."""
        topk_idx, topk_weights = self.router(x_TH)
        return x_TH.to(COMM_DTYPE).contiguous(), topk_idx, topk_weights

    def expert_compute(self, recv_x_NH, recv_topk_idx_NK, recv_topk_weights_NK, counts=None,
                       rows_have_local_expert: bool = False) -> torch.Tensor:
        """Received rows -> weighted expert output per row, bf16 [N, H] for combine.

        rows_have_local_expert=True: the rows come from a dispatch whose layout was computed from
        the routing (get_dispatch_layout, num_worst_tokens=0: no padding rows), so each has a local
        expert (see routed_experts); forward() and MoEBlock.stage_experts pass it.
        """
        y = self.experts(recv_x_NH, recv_topk_idx_NK, recv_topk_weights_NK, counts, self.cfg.expert_impl,
                         rows_have_local_expert=rows_have_local_expert)
        return y.to(COMM_DTYPE)

    def shared_compute(self, x_TH: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared experts on x_TH [T, H] -> [T, H] (float32), or None without shared experts."""
        return self.shared(x_TH) if self.shared is not None else None

    @staticmethod
    def finish(combined_TH: torch.Tensor, shared_TH: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """combined_TH [T, H] bf16 (+ shared_TH [T, H]) -> [T, H] in ``dtype``."""
        if shared_TH is None:
            return combined_TH.to(dtype)
        shared_TH = shared_TH.to(dtype)
        if torch.promote_types(dtype, combined_TH.dtype) == dtype:
            # The add reads the bf16 rows and computes in ``dtype``: the cast is exact, so this is
            # combined.to(dtype) + shared bit for bit. On GPUs the add casts as it loads, saving the
            # cast's [T, H] pass (on CPU TensorIterator still makes the cast copy itself).
            return shared_TH + combined_TH
        return combined_TH.to(dtype) + shared_TH

    # --- whole layer ---
    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        if self.buffer is None:
            R = self.num_ranks
            chunks = list(x_TH.chunk(R)) if x_TH.shape[0] % R == 0 else [x_TH]
            return torch.cat(self.forward_chunks(chunks))
        x_wire, topk_idx, topk_weights = self.route(x_TH)
        # custom ops (commlib.training.ops): torch.compile traces through them
        out = ops.dispatch(self.buffer, x_wire, topk_idx, topk_weights, self.cfg.num_experts,
                           fp8=self.cfg.fp8_dispatch)
        # the layout comes from topk_idx and nothing is padded: every row has a local expert. The
        # counts are host values (a CPU tensor): traced, .tolist() gives unbacked sizes
        y_NH = self.expert_compute(out.recv_x, out.recv_topk_idx, out.recv_topk_weights,
                                   out.num_recv_tokens_per_expert.tolist(), rows_have_local_expert=True)
        combined, _ = ops.combine(self.buffer, y_NH, out.handle)
        return self.finish(combined, self.shared_compute(x_TH), x_TH.dtype)

    def forward_chunks(self, xs: list) -> list:
        """Single-process layer on the tokens of every virtual rank (xs[r]: rank r's [T_r, H]).

        What is per-rank under expert parallelism (router, shared expert) runs per chunk, so its
        parameter gradients are sums of per-rank contributions as after an all-reduce; every
        virtual rank r's experts get the rows a real dispatch would give rank r, in the same order.
        """
        if self.buffer is not None:
            raise RuntimeError("MoELayer.forward_chunks is the single-process path (buffer=None)")
        routed = [self.route(x) for x in xs]
        x_wire = torch.cat([r[0] for r in routed])
        topk_idx = torch.cat([r[1] for r in routed])
        topk_weights = torch.cat([r[2] for r in routed])
        R, L = self.num_ranks, self.cfg.num_experts // self.num_ranks
        in_rank_TR = token_in_rank(topk_idx, self.cfg.num_experts, R)
        rows = [in_rank_TR[:, r].nonzero().flatten() for r in range(R)]
        if self.cfg.fp8_dispatch:
            x_wire = _FP8StraightThrough.apply(x_wire)
        recv_x = _EmulatedDispatch.apply(x_wire, *rows)
        ys = []
        for r in range(R):
            idx_r = local_expert_ids(topk_idx.index_select(0, rows[r]), r, L)
            w_r = topk_weights.index_select(0, rows[r])
            w_r = torch.where(idx_r >= 0, w_r, torch.zeros_like(w_r))
            # rows[r] are the tokens with an expert on rank r (token_in_rank), so every row has a local
            # slot here as behind a real dispatch; counts=None: routed_experts checks it exactly anyway.
            y = self.experts(recv_x[r], idx_r, w_r, None, self.cfg.expert_impl, lo=r * L, hi=(r + 1) * L)
            ys.append(y.to(COMM_DTYPE))
        combined = _EmulatedCombine.apply(x_wire.shape[0], rows, *ys).split([x.shape[0] for x in xs])
        return [self.finish(c, self.shared_compute(x), x.dtype) for c, x in zip(combined, xs)]
