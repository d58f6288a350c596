// notify.cu: the count exchange of a non-cached dispatch. One CTA, one launch.
//
// Buffer regions (byte offsets from each rank's NVLink buffer base; see common.cuh):
//   NOTIFY_DATA [parity][src][slot_words] int32, in rank d's buffer: written by rank src's notify CTA
//       (its slot for destination d), read by rank d's notify CTA. Words of a slot:
//         NW_NTPR   [R]  src's num_tokens_per_rank (every destination, for the rank prefix matrix)
//         NW_BAD         top-k ids outside [-1, E) that src saw (so every rank raises, not only src)
//         NW_SIG    [7]  src's call signature: hidden, x element bytes, FP8 scales per token, top-k,
//                        weights given, num_experts, channels. Every rank compares every peer's with
//                        its own (rejected sources excepted) and reports the lowest differing rank in
//                        host_counts, so every rank raises before any data moves (the dispatch kernel
//                        is never launched); with num_worst_tokens (no host read) it prints and traps.
//         NW_CPM    [C]  src's channel prefix towards d (d's recv_channel_prefix_matrix row src)
//         NW_EXPERT [L]  src's tokens per expert for d's experts
//   NOTIFY_FLAG [parity][src] u64, in rank d's buffer: release-stored = seq by src after its slot.
// parity = seq & 1: a rank can start call seq + 1 while a slow peer still reads call seq's slots,
// but not seq + 2 (that needs the peer's flag of seq + 1, written after it finished reading seq).
//
// Outputs (local): channel_prefix_matrix [R, C], rank_prefix_matrix [R, R],
// recv_channel_prefix_matrix [R, C], and host_counts (the only thing the host reads, once):
#define HC_TOTAL 0        // rows this rank receives
#define HC_BAD_ME 1       // bad top-k ids on this rank
#define HC_BAD_RANK 2     // lowest rank with bad ids (or a rejected call), -1 if none; the dispatch
                          // kernel reads it too and aborts (all padding, no waits) when it is >= 0
#define HC_BAD_VALUE 3    // that rank's bad word (REJECTED: its Buffer refused its input)
#define HC_SENT 4         // [R] rows this rank sends to each rank
#define HC_RECV 12        // [R] rows this rank receives from each rank
#define HC_SIG_RANK 20    // lowest rank whose signature differs from this rank's, -1 if none
#define HC_SIG 21         // [NW_SIG_WORDS] that rank's signature (the host knows its own)
#define HC_EXPERT 28      // [L] rows received per local expert
#define REJECTED 0x40000000
#define NOTIFY_MODE_REJECTED 1   // this rank's Buffer refused its input (takes part with zero counts)
#define NOTIFY_MODE_NO_HOST 2    // num_worst_tokens: the host never reads host_counts, so a
                                 // signature mismatch is printed and traps here
#include "common.cuh"

namespace commlib::intranode {

__global__ void __launch_bounds__(512) notify(
    const unsigned char* __restrict__ is_token_in_rank, int num_tokens,
    const int* __restrict__ num_tokens_per_rank, const int* __restrict__ num_tokens_per_expert,
    const i64* __restrict__ topk_idx, int num_topk, int num_experts,
    int* __restrict__ channel_prefix_matrix, int* __restrict__ rank_prefix_matrix,
    int* __restrict__ recv_channel_prefix_matrix, int* __restrict__ host_counts,
    const u64* __restrict__ peer_bases, int rank, int num_ranks, int num_channels, int slot_words,
    int mode, int hidden, int elem_bytes, int num_scales, int has_weights,
    u64* seq_counters, u32* smids, u64 timeout_ns, u64* host_flag, u64 host_seq) {
    // host_flag (pinned host memory, or null): raised to host_seq once every host_counts word of this
    // call is written (host_counts then points to pinned memory too); the host polls it instead of
    // copying the counts back and synchronising the stream.
    // mode & NOTIFY_MODE_REJECTED: this rank's Buffer refused its input; it still takes part (with
    // zero counts and the REJECTED word) so the peers raise instead of waiting. Null count pointers
    // read as 0.
    const int rejected = mode & NOTIFY_MODE_REJECTED;
    const int my_sig[CL_NW_SIG_WORDS] = {hidden, elem_bytes, num_scales, num_topk, has_weights, num_experts,
                                              num_channels};
    __shared__ int s_count[CL_MAX_RANKS][CL_MAX_CHANNELS];  // then: exclusive prefix
    __shared__ int s_bad;
    const int R = num_ranks, C = num_channels;
    const int L = num_experts / num_ranks;
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const u64 seq = read_seq(seq_counters, CL_SEQ_NOTIFY, 0, 0);
    const int parity = (int)(seq & 1);
    const u64 own = peer_bases[rank];
    if (smids != nullptr && threadIdx.x == 0) smids[blockIdx.x] = get_smid();
    if (threadIdx.x == 0) s_bad = 0;
    __syncthreads();

    // 1. tokens per (destination, channel): every warp takes 32 consecutive tokens at a time; when
    //    they share a channel (almost always) one shared atomic per destination, else one per token
    for (int i = threadIdx.x; i < R * CL_MAX_CHANNELS; i += blockDim.x) (&s_count[0][0])[i] = 0;
    __syncthreads();
    const int per = num_tokens > 0 ? (num_tokens + C - 1) / C : 1;
    for (int base = warp * 32; base < num_tokens; base += num_warps * 32) {
        const int t = base + lane;
        u32 bits = 0;
        if (t < num_tokens)
            for (int r = 0; r < R; ++r) bits |= (u32)(is_token_in_rank[(i64)t * R + r] != 0) << r;
        const int c = t < num_tokens ? t / per : -1;
        const int c0 = __shfl_sync(FULL_MASK, c, 0);
        const bool uniform = __all_sync(FULL_MASK, c == c0 || c < 0);
        for (int r = 0; r < R; ++r) {
            const u32 m = __ballot_sync(FULL_MASK, (bits >> r) & 1u);
            if (uniform) {
                if (lane == 0 && m) atomicAdd(&s_count[r][c0], __popc(m));
            } else if ((bits >> r) & 1u) {
                atomicAdd(&s_count[r][c], 1);
            }
        }
    }
    // ids outside [-1, E): the Buffer does not check them on CUDA (a host check would sync).
    // 16-byte loads, several in flight per thread.
    if (topk_idx != nullptr) {
        int bad = 0;
        const i64 n = (i64)num_tokens * num_topk;
        const bool aligned = (reinterpret_cast<u64>(topk_idx) & 15) == 0;
        const i64 num_pairs = aligned ? n / 2 : 0;
        const longlong2* pairs = reinterpret_cast<const longlong2*>(topk_idx);
#pragma unroll 4
        for (i64 i = threadIdx.x; i < num_pairs; i += blockDim.x) {
            const longlong2 v = __ldg(pairs + i);
            bad += (v.x < -1 || v.x >= num_experts) + (v.y < -1 || v.y >= num_experts);
        }
        for (i64 i = 2 * num_pairs + threadIdx.x; i < n; i += blockDim.x) {
            const i64 e = __ldg(topk_idx + i);
            bad += (e < -1 || e >= num_experts);
        }
        if (bad) atomicAdd(&s_bad, bad);
    }
    __syncthreads();

    // 2. exclusive prefix over channels (this rank's channel_prefix_matrix)
    if (threadIdx.x < R) {
        const int r = threadIdx.x;
        int run = 0;
        for (int c = 0; c < C; ++c) {
            const int v = s_count[r][c];
            s_count[r][c] = run;
            channel_prefix_matrix[r * C + c] = run;
            run += v;
        }
    }
    __syncthreads();

    // 3. my slot in every rank's buffer (mine included), then the flags
    const int words = CL_NW_EXPERT + L;
    for (int i = threadIdx.x; i < R * words; i += blockDim.x) {
        const int d = i / words, w = i % words;
        int v;
        if (w < CL_NW_BAD) v = (w < R && num_tokens_per_rank != nullptr) ? num_tokens_per_rank[w] : 0;
        else if (w == CL_NW_BAD) v = rejected ? REJECTED : s_bad;
        else if (w < CL_NW_SIG + CL_NW_SIG_WORDS) v = rejected ? 0 : my_sig[w - CL_NW_SIG];
        else if (w < CL_NW_CPM) v = 0;
        else if (w < CL_NW_EXPERT) v = (w - CL_NW_CPM) < C ? s_count[d][w - CL_NW_CPM] : 0;
        else v = num_tokens_per_expert != nullptr ? num_tokens_per_expert[d * L + (w - CL_NW_EXPERT)] : 0;
        int* slot = reinterpret_cast<int*>(peer_bases[d] + CL_OFF_NOTIFY_DATA) +
                    (i64)(parity * R + rank) * slot_words;
        st_volatile(slot + w, v);
    }
    __syncthreads();  // every word of the CTA is written before any flag (release is cumulative)
    if (threadIdx.x < R)
        st_release_sys(flag_at(peer_bases[threadIdx.x], CL_OFF_NOTIFY_FLAG, parity * R + rank), seq);

    // 4. wait for every rank's slot in my buffer
    if (warp == 0) {
        const WaitSite site = {"notify", "notify flag", rank, -1, false};
        warp_wait_geq(flag_at(own, CL_OFF_NOTIFY_FLAG, parity * R + (lane < R ? lane : 0)), seq, lane < R,
                      lane, site, timeout_ns);
    }
    __syncthreads();

    // 5. read them
    const int* slots = reinterpret_cast<const int*>(own + CL_OFF_NOTIFY_DATA) + (i64)parity * R * slot_words;
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
        const int row = i / R, col = i % R;
        int sum = 0;
        for (int s = 0; s <= row; ++s) sum += ld_volatile(slots + (i64)s * slot_words + CL_NW_NTPR + col);
        rank_prefix_matrix[i] = sum;
    }
    for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
        const int s = i / C, c = i % C;
        recv_channel_prefix_matrix[i] = ld_volatile(slots + (i64)s * slot_words + CL_NW_CPM + c);
    }
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
        int sum = 0;
        for (int s = 0; s < R; ++s) sum += ld_volatile(slots + (i64)s * slot_words + CL_NW_EXPERT + e);
        host_counts[HC_EXPERT + e] = sum;
    }
    if (threadIdx.x == 0) {
        int total = 0, bad_rank = -1, bad_value = 0;
        for (int s = 0; s < R; ++s) {
            const int* slot = slots + (i64)s * slot_words;
            const int from_s = ld_volatile(slot + CL_NW_NTPR + rank);
            total += from_s;
            host_counts[HC_RECV + s] = from_s;
            host_counts[HC_SENT + s] = num_tokens_per_rank != nullptr ? num_tokens_per_rank[s] : 0;
            const int bad = ld_volatile(slot + CL_NW_BAD);
            if (bad_rank < 0 && bad > 0) { bad_rank = s; bad_value = bad; }
        }
        host_counts[HC_TOTAL] = total;
        host_counts[HC_BAD_ME] = rejected ? REJECTED : s_bad;
        host_counts[HC_BAD_RANK] = bad_rank;
        host_counts[HC_BAD_VALUE] = bad_value;
        // signatures: the lowest rank that disagrees with this one (a rejected rank's is empty)
        int sig_rank = -1, sig_field = -1;
        for (int s = 0; s < R && sig_rank < 0 && !rejected; ++s) {
            const int* slot = slots + (i64)s * slot_words;
            if (ld_volatile(slot + CL_NW_BAD) == REJECTED) continue;
            for (int f = 0; f < CL_NW_SIG_WORDS; ++f)
                if (ld_volatile(slot + CL_NW_SIG + f) != my_sig[f]) { sig_rank = s; sig_field = f; break; }
        }
        host_counts[HC_SIG_RANK] = sig_rank;
        for (int f = 0; f < CL_NW_SIG_WORDS; ++f)
            host_counts[HC_SIG + f] = sig_rank >= 0 ? ld_volatile(slots + (i64)sig_rank * slot_words + CL_NW_SIG + f)
                                                    : 0;
        if (sig_rank >= 0 && (mode & NOTIFY_MODE_NO_HOST)) {
            // every rank sees a disagreement (some peer differs from it) and has already written its
            // slots, so every rank ends here: nobody waits for a trapped peer
            const char* names[CL_NW_SIG_WORDS] = {"hidden", "x element bytes (dtype)", "FP8 scales per token",
                                                       "num_topk", "topk_weights given + 2 x ring rows", "num_experts",
                                                       "num_channels (Config.num_sms / 2)"};
            printf("[commlib] rank %d notify: ranks disagree on %s: rank %d has %d, rank %d has %d (dispatch with "
                   "num_worst_tokens cannot raise on the host, so nothing is sent and the kernel traps)\n",
                   rank, names[sig_field], sig_rank, ld_volatile(slots + (i64)sig_rank * slot_words + CL_NW_SIG + sig_field),
                   rank, my_sig[sig_field]);
            asm volatile("trap;");
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        seq_counters[CL_SEQ_INDEX(CL_SEQ_NOTIFY, 0, 0)] = seq;
        if (host_flag != nullptr) {
            __threadfence_system();   // the CTA's host_counts stores (ordered before by the barrier) first
            st_release_sys(host_flag, host_seq);
        }
    }
}

// Before a call whose channel count differs from the last call's (the rings' byte ranges move):
// wait until every peer's receivers of every earlier call (both kinds, every channel) are done with
// this rank's rows, so no sender overwrites bytes a receiver still reads. One warp; lane r < R waits
// for peer r's DONE words up to this rank's own sender counts (every rank made the same calls).
__global__ void __launch_bounds__(32) ring_drain(const u64* peer_bases, int rank, int num_ranks,
                                                 const u64* seq_counters, u64 timeout_ns) {
    const int lane = threadIdx.x & 31;
    const bool peer = lane < num_ranks && lane != rank;
    const u64 own = peer_bases[rank];
    for (int kind = 0; kind < 2; ++kind) {
        const u64 done_offset = kind == CL_SEQ_DISPATCH ? CL_OFF_DISPATCH_DONE : CL_OFF_COMBINE_DONE;
        for (int c = 0; c < CL_MAX_CHANNELS; ++c) {
            const u64 expected = seq_counters[CL_SEQ_INDEX(kind, 0, c)];
            if (expected == 0) continue;  // channel never used as a sender (same on every lane)
            const WaitSite site = {"ring drain", kind == CL_SEQ_DISPATCH ? "dispatch done" : "combine done", rank, c,
                                   false};
            warp_wait_geq(flag_at(own, done_offset, (peer ? lane : 0) * CL_MAX_CHANNELS + c), expected, peer, lane,
                          site, timeout_ns);
        }
    }
}

}  // namespace commlib::intranode
