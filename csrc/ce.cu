// ce.cu: the copy-engine data path of the NVLink engine (commlib/backends/nvlink/copy_engine.py, COMMLIB_CE_BYTES).
//
// The copy engines move the rows between GPUs (cudaMemcpyAsync into the peer's CE staging, issued by
// the host: it knows every count after the count exchange); no SM touches NVLink. What is left for
// the SMs is local: packing a rank's outgoing rows per destination (dispatch) and summing the rows
// that came back (combine), plus three one-warp kernels that order the copies between the ranks.
// The combine sum is csrc/combine.cu's, bit for bit: float32 from 0, the biases first, then the rows in
// rank order or in the handle's sum_order (DeepEP V1's and V2's orders).
// Why: the copy engines leave the SMs to compute (measurements: docs/notes/2026-11-30_pipeline_log.md,
// python -m experiments.bench_comm_interference).
//
// CE staging (one per rank, every peer maps it over CUDA IPC):
//   [0, 8 * MAX_RANKS)                   ready[src]: last call whose rows src has pushed here
//   [8 * MAX_RANKS, 16 * MAX_RANKS)      free[dst]:  last call whose rows from here dst has consumed
//   [CE_FLAG_BYTES + s * region, ...)    region s: the rows rank s pushed here (blocks, see nvlink/copy_engine.py)
//
// Every call (dispatch or combine on the copy-engine path) runs, on one stream:
//   ce_sync(BEGIN)   seq = ++counter; wait until every peer freed its region for me (free[p] >= seq - 1)
//                    (a non-cached dispatch skips it: its count exchange already waited for every peer to
//                    reach this call, so each peer's DONE of the call before has run; its PUSHED_NEXT
//                    advances the counter instead)
//   local packing (dispatch; or done before, on the caller's stream: NvlinkBackend.prepack) | nothing (combine)
//   copy-engine pushes into every peer's region [me]
//   ce_sync(PUSHED)  ready[me] = seq at every peer (release, system scope); wait ready[p] >= seq here
//   local reads of the regions (copies out, or ce_reduce)
//   ce_sync(DONE)    free[me] = seq at every peer: they may overwrite their region here from now on
// Every rank makes the same calls in the same order (the DeepEP contract), so seq agrees. The counter
// lives in device memory: CUDA-graph replays advance it like eager calls.
#include "common.cuh"

#define CE_FLAG_BYTES 4096
// vectors of 16 bytes each lane keeps in flight: the packing and the sum are local memory-bound
// passes on the few SMs the comm stream owns, so their rate is bytes in flight / memory latency
#ifndef CE_PACK_UNROLL
#define CE_PACK_UNROLL 6
#endif
#ifndef CE_SUM_UNROLL
#define CE_SUM_UNROLL 6
#endif
#define CE_SYNC_BEGIN 0
#define CE_SYNC_PUSHED 1
#define CE_SYNC_DONE 2
#define CE_SYNC_PUSHED_NEXT 3  // PUSHED for a call without BEGIN: seq = ++counter first

__device__ __forceinline__ u64* ce_ready(u64 base) { return reinterpret_cast<u64*>(base); }
__device__ __forceinline__ u64* ce_free(u64 base) { return reinterpret_cast<u64*>(base) + CL_MAX_RANKS; }

namespace commlib::copy_engine {

// One warp; lane p speaks for peer p.
__global__ void sync(int mode, const u64* peer_bases, int rank, int num_ranks, u64* counter,
                     u64 timeout_ns) {
    const int lane = lane_id();
    const bool peer = lane < num_ranks && lane != rank;
    u64 seq = 0;
    if (lane == 0) {
        seq = *reinterpret_cast<volatile u64*>(counter);
        if (mode == CE_SYNC_BEGIN || mode == CE_SYNC_PUSHED_NEXT) *reinterpret_cast<volatile u64*>(counter) = ++seq;
    }
    seq = __shfl_sync(FULL_MASK, seq, 0);
    const u64 mine = peer_bases[rank];
    const u64 theirs = peer ? peer_bases[lane] : 0;
    if (mode == CE_SYNC_BEGIN) {
        warp_wait_geq(ce_free(mine) + lane, seq - 1, peer, lane, WaitSite{"ce", "region free", rank, -1, false},
                      timeout_ns);
        return;
    }
    // The copies before this kernel on the stream have completed; make them visible system-wide
    // before the flag that announces them.
    asm volatile("fence.sc.sys;" ::: "memory");
    const bool pushed = mode != CE_SYNC_DONE;
    if (peer) st_release_sys((pushed ? ce_ready(theirs) : ce_free(theirs)) + rank, seq);
    if (pushed)
        warp_wait_geq(ce_ready(mine) + lane, seq, peer, lane, WaitSite{"ce", "rows pushed", rank, -1, false},
                      timeout_ns);
}

// The packing and the sum launch as COMM_CLUSTER-CTA clusters (grid rounded up in nvlink/copy_engine.py): a plain
// CTA can land alone on a GPC and cost a 2-CTA-cluster GEMM beside it a slot.
// Dispatch, sender side: token t goes to every rank r with is_token_in_rank[t, r], as row pos[t, r]
// (its rank among this rank's tokens for r) of that destination's blocks: x rows, FP8 scales, top-k
// ids (r's local ids, -1 elsewhere), weights (0 elsewhere) and source indices (t). For this rank the
// blocks are recv_x and friends, already at this rank's row offset (the `own` pointers); for a peer r
// they are region r of the local pack buffer, laid out like the peer's region for this rank (blocks
// at `off`), which the copy engines then push. Bit b of `present` says block b (x, scales, top-k,
// weights, sources) is written (x always); the own pointers may be null when no row stays here. One warp per token; each x vector is loaded once, stored to every destination.
struct CeBlocks { u64 x, scales, topk, weights, src; };

__global__ void CL_CLUSTER_DIMS __launch_bounds__(1024) pack(
    const int4* __restrict__ x, const float* __restrict__ x_scales, const i64* __restrict__ topk_idx,
    const float* __restrict__ topk_weights, const bool* __restrict__ is_token_in_rank, const int* __restrict__ pos,
    u64 pack_base, u64 region_bytes, u64 off_scales, u64 off_topk, u64 off_weights, u64 off_src,
    u64 own_x, u64 own_scales, u64 own_topk, u64 own_weights, u64 own_src, int present,
    int num_tokens, int hidden_int4, int num_scales, int num_topk, int num_local_experts, int rank, int num_ranks) {
    const int lane = lane_id();
    const int warps = blockDim.x >> 5;
    const int R = num_ranks, K = num_topk, S = num_scales, H4 = hidden_int4;
    auto blocks = [&](int r) {
        if (r == rank) return CeBlocks{own_x, own_scales, own_topk, own_weights, own_src};
        const u64 b = pack_base + (u64)r * region_bytes;
        return CeBlocks{b, (present & 2) ? b + off_scales : 0, (present & 4) ? b + off_topk : 0,
                        (present & 8) ? b + off_weights : 0, (present & 16) ? b + off_src : 0};
    };
    for (int t = blockIdx.x * warps + warp_id(); t < num_tokens; t += gridDim.x * warps) {
        const bool in = lane < R && is_token_in_rank[(i64)t * R + lane];
        const u32 mask = __ballot_sync(FULL_MASK, in);
        if (mask == 0) continue;
        const int row = in ? pos[(i64)t * R + lane] : 0;
        int4* xr[CL_MAX_RANKS];
#pragma unroll
        for (int r = 0; r < CL_MAX_RANKS; ++r) {
            const int p = __shfl_sync(FULL_MASK, row, r);
            xr[r] = ((mask >> r) & 1u) ? reinterpret_cast<int4*>(blocks(r).x) + (i64)p * H4 : nullptr;
        }
        const int4* src = x + (i64)t * H4;
        for (int base = lane; base < H4; base += 32 * CE_PACK_UNROLL) {  // CE_PACK_UNROLL loads in flight
            int4 v[CE_PACK_UNROLL];
            load_row_part<CE_PACK_UNROLL>(v, src, base, H4);
#pragma unroll
            for (int r = 0; r < CL_MAX_RANKS; ++r)
                if (xr[r] != nullptr)
#pragma unroll
                    for (int u = 0; u < CE_PACK_UNROLL; ++u)
                        if (base + 32 * u < H4) st_na_v4(xr[r] + base + 32 * u, v[u]);
        }
        for (int r = 0; r < R; ++r) {  // small fields: lane-parallel, per destination
            if (!((mask >> r) & 1u)) continue;
            const int p = __shfl_sync(FULL_MASK, row, r);
            const CeBlocks d = blocks(r);
            if (d.scales != 0)
                for (int s = lane; s < S; s += 32)
                    reinterpret_cast<float*>(d.scales)[(i64)p * S + s] = x_scales[(i64)t * S + s];
            if (lane < K && d.topk != 0) {
                const i64 e = topk_idx[(i64)t * K + lane];
                const i64 lo = (i64)r * num_local_experts;
                const bool here = e >= lo && e < lo + num_local_experts;
                reinterpret_cast<i64*>(d.topk)[(i64)p * K + lane] = here ? e - lo : -1;
                if (d.weights != 0)
                    reinterpret_cast<float*>(d.weights)[(i64)p * K + lane] = here ? topk_weights[(i64)t * K + lane] : 0.f;
            }
            if (lane == 0 && d.src != 0) reinterpret_cast<int*>(d.src)[p] = t;
        }
    }
}

// Combine, receiver side: out[t] = bf16(acc), acc = 0.f; acc += bias0; acc += bias1; then acc += the
// row of each rank r holding t, in rank order or in sum_order[t]'s (DispatchHandle.sum_order, decoded
// once per token by common.cuh sum_place), float32 IEEE adds: csrc/combine.cu's sum, so the result is
// the same bits. The row of rank r is x_local[local_offset + pos[t, me]] for this rank, else row
// pos[t, r] of the x block of region r; the weights likewise (weights block at w_block_offset of each
// region), summed from 0 in the rows' order, no bias.
__global__ void CL_CLUSTER_DIMS __launch_bounds__(512) reduce(
    const int4* __restrict__ x_local, const float* __restrict__ w_local, u64 staging, u64 region_bytes,
    u64 w_block_offset, const bool* __restrict__ is_token_in_rank, const int* __restrict__ pos, int local_offset,
    const int4* __restrict__ bias0, const int4* __restrict__ bias1, const u32* __restrict__ sum_order,
    int4* __restrict__ out, float* __restrict__ out_w, int num_tokens, int hidden_int4, int num_topk, int rank,
    int num_ranks) {
    constexpr int U = CE_SUM_UNROLL;
    const int lane = lane_id();
    const int warps = blockDim.x >> 5;
    const int R = num_ranks, K = num_topk, H4 = hidden_int4;
    for (int t = blockIdx.x * warps + warp_id(); t < num_tokens; t += gridDim.x * warps) {
        const bool in = lane < R && is_token_in_rank[(i64)t * R + lane];
        const int n = __popc(__ballot_sync(FULL_MASK, in));
        const int row = in ? pos[(i64)t * R + lane] : 0;
        const u32 seq = sum_sequence(sum_place(sum_order != nullptr ? sum_order[t] : 0u, in, lane), lane);
        const int4* rows[CL_MAX_RANKS];  // rows[i]: the row summed i-th
        float wsum = 0.f;
#pragma unroll
        for (int i = 0; i < CL_MAX_RANKS; ++i) {
            rows[i] = nullptr;
            if (i >= n) continue;
            const int r = (seq >> (4 * i)) & 15u;
            const int p = __shfl_sync(FULL_MASK, row, r);
            const float* w;
            if (r == rank) {
                rows[i] = x_local + (i64)(local_offset + p) * H4;
                w = w_local + (i64)(local_offset + p) * K;
            } else {
                const u64 region = staging + CE_FLAG_BYTES + (u64)r * region_bytes;
                rows[i] = reinterpret_cast<const int4*>(region) + (i64)p * H4;
                w = reinterpret_cast<const float*>(region + w_block_offset) + (i64)p * K;
            }
            if (out_w != nullptr && lane < K) wsum = add_rn(wsum, w[lane]);
        }
        const int4* b0 = bias0 != nullptr ? bias0 + (i64)t * H4 : nullptr;
        const int4* b1 = bias1 != nullptr ? bias1 + (i64)t * H4 : nullptr;
        int4* o = out + (i64)t * H4;
        for (int base = 0; base < H4; base += 32 * U) {
            const int i0 = base + lane;
            float acc[U][8];
            zero_acc<U>(acc);
#pragma unroll
            for (int j = 0; j < CL_MAX_RANKS + 2; ++j) {  // the biases, then the rows in order
                const int4* s = j == 0 ? b0 : (j == 1 ? b1 : rows[j - 2]);
                if (s != nullptr) acc_row_part<U>(acc, s, i0, H4);
            }
            store_row_part<U>(o, acc, i0, H4);
        }
        if (out_w != nullptr && lane < K) out_w[(i64)t * K + lane] = wsum;
    }
}

}  // namespace commlib::copy_engine
