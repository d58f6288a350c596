// layout.cu: get_dispatch_layout on the GPU (routing -> counts), one launch, no memset.
//
// Buffers (all local to this rank; no peer memory is touched):
//   topk_idx              [T, K] int64         read by every CTA (CTA b owns tokens [b*256, b*256+256))
//   is_token_in_rank      [T, R] bool          written by the thread of each token
//   partials              [CTAs, R + E] int32  CTA b writes row b (its per-rank / per-expert counts)
//   num_tokens_per_rank   [R] int32            written by the last CTA to finish (sum of partials)
//   num_tokens_per_expert [E] int32            idem
//   scratch[0]            ticket               atomically counted up by every CTA; the last resets it
//   scratch[1]            error word           += ids outside [-1, E) (the Buffer skips that host check on
//                                              CUDA; the dispatch's notify kernel checks again and raises)
// The "last CTA sums" pattern avoids both a second launch and zero-filling the outputs first.
#include "common.cuh"

namespace commlib::layout {

__global__ void __launch_bounds__(256) count_tokens(
    const i64* __restrict__ topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
    int* __restrict__ num_tokens_per_rank, int* __restrict__ num_tokens_per_expert,
    unsigned char* __restrict__ is_token_in_rank, int* partials, u32* scratch) {
    extern __shared__ int s_count[];  // [R + E]: ranks first, then experts
    __shared__ int s_bad;
    __shared__ bool s_last;
    const int n = num_ranks + num_experts;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s_count[i] = 0;
    if (threadIdx.x == 0) s_bad = 0;
    __syncthreads();

    const int experts_per_rank = num_experts / num_ranks;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    u32 mask = 0;
    int bad = 0;
    if (t < num_tokens) {
        for (int k = 0; k < num_topk; ++k) {
            const i64 e = topk_idx[(i64)t * num_topk + k];
            if (e < -1 || e >= num_experts) { ++bad; continue; }  // counted, never indexed with
            if (e < 0) continue;
            atomicAdd(&s_count[num_ranks + (int)e], 1);
            mask |= 1u << ((int)e / experts_per_rank);
        }
        for (int r = 0; r < num_ranks; ++r)
            is_token_in_rank[(i64)t * num_ranks + r] = (unsigned char)((mask >> r) & 1u);
    }
    // Per-rank counts: one shared atomic per warp instead of one per token.
    for (int r = 0; r < num_ranks; ++r) {
        const int c = __popc(__ballot_sync(FULL_MASK, (mask >> r) & 1u));
        if (lane_id() == 0 && c) atomicAdd(&s_count[r], c);
    }
    if (bad) atomicAdd(&s_bad, bad);
    __syncthreads();

    if (gridDim.x == 1) {  // small T: no partials, no ticket
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (i < num_ranks) num_tokens_per_rank[i] = s_count[i];
            else num_tokens_per_expert[i - num_ranks] = s_count[i];
        }
        if (threadIdx.x == 0 && s_bad) atomicAdd(&scratch[1], (u32)s_bad);
        return;
    }
    int* mine = partials + (i64)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) mine[i] = s_count[i];
    __threadfence();  // partials visible device-wide before the ticket says so
    __syncthreads();
    if (threadIdx.x == 0) {
        if (s_bad) atomicAdd(&scratch[1], (u32)s_bad);
        s_last = atomicAdd(&scratch[0], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int sum = 0;
        for (int b = 0; b < (int)gridDim.x; ++b) sum += ld_volatile(partials + (i64)b * n + i);  // bypass L1
        if (i < num_ranks) num_tokens_per_rank[i] = sum;
        else num_tokens_per_expert[i - num_ranks] = sum;
    }
    if (threadIdx.x == 0) scratch[0] = 0;  // every CTA has taken its ticket: ready for the next launch
}

}  // namespace commlib::layout
