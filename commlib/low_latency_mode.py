"""The Buffer's low-latency (decode) mode and shrink mode (DeepEP's mask buffer), and its ``runtime``.

``LowLatencyMode`` is a base class of ``commlib.buffer.Buffer``: these methods use the Buffer's
``_ll()`` engine (``commlib.backends.low_latency``), ``_run`` (comm stream, events), ``_alive``,
``rank``, ``num_ranks``, ``device``, ``enable_shrink`` and ``_mask``.

Legend: T tokens on this rank, H hidden, K top-k, L local experts, R ranks, M max tokens per rank.
"""
from __future__ import annotations

from typing import Optional

import torch

from commlib.backends.base import Outputs, alloc_outputs
from commlib.backends.low_latency.reference import rdma_size_hint
from commlib.validate import check_tensor


class LowLatencyMode:
    # ------------------------------------------------------------------ low-latency mode (decode)
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` a low-latency Buffer needs."""
        return rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def _ll(self):
        self._alive()
        if self._low_latency is None:
            raise RuntimeError(f"[commlib rank {self.rank}] build the Buffer with low_latency_mode=True to use "
                               "low-latency dispatch/combine")
        return self._low_latency

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP clears its signalling buffers here; commlib's never need it (sequence numbers). In shrink
        mode it is a barrier of the unmasked ranks that masks a rank which does not take part (as DeepEP's)."""
        ll = self._ll()
        barrier = getattr(ll, "barrier", None)
        if self.enable_shrink and barrier is not None:
            barrier(self._mask)

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """[local experts, R * M, H] bf16 that the next ``zero_copy=True`` combine reads: write the expert
        outputs into it, then call low_latency_combine(..., zero_copy=True) with any x (as DeepEP)."""
        return self._ll().next_combine_buffer(handle)

    # ------------------------------------------------------------------ shrink mode (DeepEP's mask buffer)
    def _shrink(self, what: str) -> torch.Tensor:
        self._alive()
        if not self.enable_shrink:
            raise RuntimeError(f"[commlib rank {self.rank}] {what} needs shrink mode: build the Buffer with "
                               "enable_shrink=True")
        return self._mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank: low-latency dispatch and combine neither send to nor
        receive from a masked rank, and combine leaves its experts out of the sum."""
        m = self._shrink("low_latency_update_mask_buffer")
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < self.num_ranks:
            raise ValueError(f"[commlib rank {self.rank}] rank_to_mask must be an int in [0, {self.num_ranks}), "
                             f"got {rank_to_mask!r}")
        m[rank_to_mask] = 1 if mask else 0

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask into ``mask_status`` ([R] int32: 1 = masked), on the tensor's device."""
        m = self._shrink("low_latency_query_mask_buffer")
        check_tensor("mask_status", mask_status, self.rank, dtype=torch.int32, dim=1)
        if mask_status.numel() != self.num_ranks:
            raise ValueError(f"[commlib rank {self.rank}] mask_status must have {self.num_ranks} elements, "
                             f"got {mask_status.numel()}")
        mask_status.copy_(m)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._shrink("low_latency_clean_mask_buffer").zero_()

    def _check_stats(self, name: str, t, n: int, dtype) -> None:
        if t is None:
            return
        check_tensor(name, t, self.rank, dtype=dtype, dim=1, device=self.device)
        if t.numel() != n:
            raise ValueError(f"[commlib rank {self.rank}] {name} must have shape [{n}], got {list(t.shape)}")
        if name.endswith("wait_recv_cost_stats") and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # checked before any stream work, so the capture ends cleanly
            raise ValueError(f"[commlib rank {self.rank}] {name}: wait times are read on the host (a sync), "
                             "which a CUDA graph capture cannot hold; pass None while capturing")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Decode-mode dispatch (commlib.backends.low_latency.reference): (recv_x, recv_count, handle, event, hook).

        Args:
            x: [T, H] bf16 (T <= num_max_dispatch_tokens_per_rank = M); topk_idx: [T, K] int64 (-1: empty).
            cumulative_local_expert_recv_stats: [L] int32 or None: this call's recv_count is added to it.
            dispatch_wait_recv_cost_stats: [R] int64 or None: time spent waiting for each source rank's
                rows is added, in nanoseconds (reference: host time of its exchange; nvlink: CUDA-event time
                of the receiving launch, one host sync), the same amount to every source's entry.
        Returns:
            recv_x: [L, R * M, H] bf16, or (E4M3 [L, R * M, H], scales [L, R * M, S]) with use_fp8, the scales
                column-major in their last two dims (strides (S * R * M, 1, R * M), as DeepEP's, for TMA):
                float32 S = H / 128, or with use_ue8m0 int32 S = H / 512.
            recv_count: [L] int32; handle; event; hook (return_recv_hook) that completes the receive.
        """
        ll = self._ll()
        L = num_experts // self.num_ranks if isinstance(num_experts, int) and num_experts > 0 else 0
        self._check_stats("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, L, torch.int32)
        self._check_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, self.num_ranks, torch.int64)
        mask = self._mask if self.enable_shrink else None
        cum = cumulative_local_expert_recv_stats

        def call():
            recv_x, recv_count, handle, hook = ll.dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                return_recv_hook, mask=mask, wait_stats=dispatch_wait_recv_cost_stats)
            column_major, blocks = None, ll.blocks
            if use_fp8:
                data, scales = recv_x
                shape = (scales.shape[0], scales.shape[2], scales.shape[1])
                if blocks is None:
                    column_major = torch.empty(shape, dtype=scales.dtype, device=scales.device)
                else:  # with the engine's outputs, on the caller's stream
                    made = list(blocks)
                    column_major = alloc_outputs(self._ctx.out_stream, self._ctx.comm_stream,
                                                 ((shape, scales.dtype),), scales.device, made)[0]
                    blocks = made
                column_major = column_major.transpose(1, 2)
                recv_x = (data, column_major)

            def received() -> None:  # what needs the rows: on the stream that completed the receive
                if column_major is not None:
                    column_major.copy_(scales)
                if cum is not None:
                    cum.add_(recv_count)
            if hook is None:
                received()
            else:
                inner = hook

                def hook() -> None:
                    inner()
                    received()
            out = (recv_x, recv_count, handle, hook)
            return out if blocks is None else Outputs.of(out, blocks)

        (recv_x, recv_count, handle, hook), event = self._run(call, [x, topk_idx], None, async_finish, False)
        return recv_x, recv_count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Decode-mode combine: (combined_x [T, H] bf16, event, hook); the top-k weighted sum.

        Args:
            x: [L, R * M, H] bf16 expert outputs (ignored with ``zero_copy``: the buffer from
                get_next_low_latency_combine_buffer is read instead).
            use_logfmt: the partial sums cross as LogFMT-10 (nvlink: min(R, K) launches around the kernel
                and the reference's codec, the reference's result bit for bit).
            combine_wait_recv_cost_stats: [R] int64 or None, as dispatch_wait_recv_cost_stats.
        """
        ll = self._ll()
        self._check_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, self.num_ranks, torch.int64)
        mask = self._mask if self.enable_shrink else None
        def call():
            result = ll.combine(x, topk_idx, topk_weights, handle, zero_copy, return_recv_hook, out,
                                use_logfmt=bool(use_logfmt), mask=mask, wait_stats=combine_wait_recv_cost_stats)
            return result if ll.blocks is None else Outputs.of(result, ll.blocks)

        (combined, hook), event = self._run(call, [x, topk_idx, topk_weights], None, async_finish, False)
        return combined, event, hook


class Runtime:
    """What DeepEP exposes as ``Buffer.runtime`` (its C++ object), for clients that query it."""

    def __init__(self, buffer: "LowLatencyMode") -> None:
        self._buffer = buffer

    def get_num_rdma_ranks(self) -> int:
        return self._buffer.topology.num_nodes

    def get_rdma_rank(self) -> int:
        return self._buffer.topology.node

    def get_root_rdma_rank(self, global_: bool) -> int:
        return self._buffer.topology.local_rank if global_ else 0

    def get_num_nvl_ranks(self) -> int:
        return self._buffer.topology.ranks_per_node

    def get_nvl_rank(self) -> int:
        return self._buffer.topology.local_rank

    def get_local_device_id(self) -> int:
        return self._buffer.device.index if self._buffer.device.type == "cuda" else -1

    def is_available(self) -> bool:
        return not self._buffer._destroyed

    def is_internode_available(self) -> bool:
        return self._buffer.topology.num_nodes > 1

    def get_comm_stream(self):
        return self._buffer.get_comm_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, offset: int, use_rdma_buffer: bool) -> torch.Tensor:
        return self._buffer.get_local_buffer_tensor(dtype, None, offset, use_rdma_buffer)
