// dispatch.cu: move each token once to every rank that holds one of its experts (one node, NVLink).
//
// Grid: num_sms CTAs; CTA pair p = blockIdx.x / 2 serves channels p, p + num_sms/2, ... (one in the
// usual case). Even CTA = sender, odd CTA = receiver of the channel. Channel c owns the token range
// channel_range(T, C, c) of every rank.
//
// Buffer regions (byte offsets from a rank's NVLink buffer base; common.cuh has the control ones):
//   Ring [src][c] (common.cuh, Ring) in rank d's staging, slot_bytes per slot: row i = the i-th
//       token of channel c that goes to d, in slot i % cap; written by rank src's sender CTA c,
//       read by rank d's receiver CTA c. Slot = [hidden bytes][FP8 scales][meta: src token, K local
//       expert ids (int32, -1 elsewhere), K weights (0 elsewhere)].
//   DISPATCH_HEAD [d][c] u64 in rank src's buffer: (seq << 32) | rows consumed, release-stored by d's
//       receiver (its head publisher warp) when its rows from src on c go through more than cap slots;
//       src's copy warps wait for it before writing row i >= cap (head >= i - cap + 1).
//   DISPATCH_TAIL [src][c] u64 in rank d's buffer: (seq << 32) | tokens written, release-stored by
//       src's sender after each round of round_tokens tokens; acquire-polled by d's receiver.
//   DISPATCH_DONE [d][c] u64 in rank src's buffer: = seq, release-stored by d's receiver CTA c once
//       it has copied everything src sent it on channel c; src's sender waits for seq - 1 (and for
//       the last combine's COMBINE_DONE on c: the kinds share the rings) before its first write of
//       the next call. No resets; a change of channel count drains first (notify.cu ring_drain).
// Local destination: the sender copies x straight into recv_x (no staging), in the same warp pass
// that pushes the token to the peers, so x is read once.
//
// Sender CTA: warps 0 .. W-2 copy tokens (token j of the channel with a destination goes to warp
// j % (W-1)); warp W-1 publishes tails after each round's __syncthreads (its release fence
// overlaps the next round's copies) and writes send_head. Every warp scans the round's
// is_token_in_rank rows with ballots itself, so no shared scan state and no extra barriers.
// Receiver CTA: all warps copy rows from the staging slots into recv_x (row = rank_prefix of the
// source + recv_channel_prefix + i), converting nothing: the sender already wrote local ids.
// Rows past the received count (num_worst_tokens) are padded by the receiver CTAs.
// Rings that wrap (more rows than cap on a channel from some source): the receiver's copy warps are
// split into one group per source, each consuming its source's rows in order, and its last warp
// publishes every source's head; no ring then waits on another (a blocked sender only waits for a
// receiver group that depends on nothing but rows already published). The rounds of the sender
// are at most cap tokens, so the rows a head wait needs were published by an earlier round.
// Work sharing (CL_SHARE, common.cuh): the received rows are items of a counter in the
// receiver's shared memory; the sender CTA takes items too once its last round is published, and
// the receiver hands the slots back (DISPATCH_DONE) only after a cluster barrier with it. Not on a
// channel whose rings wrap (the receiver's groups own their rows there).
#include "common.cuh"

// The variant's knobs (loader.DEFAULT_VARIANT, passed with -D).
#if !defined(CL_DISPATCH_THREADS) || !defined(CL_DISPATCH_MIN_BLOCKS) || !defined(CL_DISPATCH_UNROLL) || \
    !defined(CL_LOCAL_IN_RECEIVER) || !defined(CL_DISPATCH_STREAM_SEND)
#error "dispatch.cu compiles with the -D defines of commlib/cuda/loader.py options()"
#endif
constexpr int kDispatchThreads = CL_DISPATCH_THREADS;
constexpr int kDispatchMinBlocks = CL_DISPATCH_MIN_BLOCKS;  // CTAs per SM the register budget allows
constexpr int kDispatchUnroll = CL_DISPATCH_UNROLL;         // 16-byte vectors in flight per lane
// 1: the receiver CTA copies the local half (x -> recv_x), the sender only pushes
constexpr bool kLocalInReceiver = CL_LOCAL_IN_RECEIVER;
// N > 0: sender warps stream their tokens without round barriers; the publisher follows per-warp
// progress words, each released after every N of the warp's tokens (see dispatch_send)
constexpr int kStreamReleaseEvery = CL_DISPATCH_STREAM_SEND;

#define DISPATCH_FLAG_WRITE_HANDLE 1  // write send_head and recv_src_idx (non-cached mode)

struct DispatchArgs {
    const int4* x; const float* x_scales; const i64* topk_idx; const float* topk_weights;
    const unsigned char* is_token_in_rank;
    const int* rank_prefix_matrix; const int* channel_prefix_matrix; const int* recv_channel_prefix_matrix;
    int4* recv_x; float* recv_x_scales; int* recv_src_idx; i64* recv_topk_idx; float* recv_topk_weights;
    int* send_head;
    int num_tokens, hidden_int4, num_scales, num_topk, num_local_experts, num_out_rows;
    const u64* peer_bases; int rank, num_ranks, num_channels;
    Ring ring; int slot_off_scales, slot_off_meta;
    int round_tokens, flags, head_batch;
    const u64* seq_counters;
    u64 timeout_ns;
};

// Rows [first, num_out_rows) = 0 / -1 / 0 (num_worst_tokens padding), spread over channels and warps.
__device__ void dispatch_pad(const DispatchArgs& a, int c, int first) {
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const int K = a.num_topk, S = a.num_scales;
    const int4 zero = make_int4(0, 0, 0, 0);
    for (int row = first + c * num_warps + warp; row < a.num_out_rows; row += a.num_channels * num_warps) {
        int4* dst = a.recv_x + (i64)row * a.hidden_int4;
        for (int i = lane; i < a.hidden_int4; i += 32) st_na_v4(dst + i, zero);
        for (int k = lane; k < S; k += 32) a.recv_x_scales[(i64)row * S + k] = 0.f;
        if (lane == 0 && (a.flags & DISPATCH_FLAG_WRITE_HANDLE)) a.recv_src_idx[row] = -1;
        if (a.recv_topk_idx != nullptr && lane < K) {
            a.recv_topk_idx[(i64)row * K + lane] = -1;
            if (a.recv_topk_weights != nullptr) a.recv_topk_weights[(i64)row * K + lane] = 0.f;
        }
    }
}

__device__ __forceinline__ u64 dispatch_slot(const DispatchArgs& a, u64 base, int src, int c, int i) {
    return ring_slot(a.ring, base, src, c, i);
}


// ------------------------------------------------------------------------------------------------
// Sender
// ------------------------------------------------------------------------------------------------

// One warp copies token `tok` to every rank in dmask. Lane r < R holds slot_r (its index among the
// channel's tokens for rank r). s_dst: this warp's scratch (destination row of each rank). A peer's
// row i >= cap waits for that peer's head (lane r's last head in head_seen) before it is written.
__device__ __forceinline__ void dispatch_copy_token(const DispatchArgs& a, int c, int tok, u32 dmask, int my_slot,
                                                    int local_base, u64* s_dst, u64 seq, u32& head_seen) {
    const int lane = lane_id();
    const int R = a.num_ranks, K = a.num_topk, S = a.num_scales;
    {
        const bool remote = lane < R && lane != a.rank && ((dmask >> lane) & 1u);
        const WaitSite site = {"dispatch", "dispatch head (receiver consumed)", a.rank, c, true};
        ring_wait_room(a.ring, flag_at(a.peer_bases[a.rank], CL_OFF_DISPATCH_HEAD, (remote ? lane : 0) * CL_MAX_CHANNELS + c),
                       my_slot, remote, seq, head_seen, lane, site, a.timeout_ns);
    }
    // The small fields are loaded first: their latency overlaps the row's instead of adding to it.
    float sc0 = 0.f, sc1 = 0.f;
    if (lane < S) sc0 = __ldg(a.x_scales + (i64)tok * S + lane);
    if (lane + 32 < S) sc1 = __ldg(a.x_scales + (i64)tok * S + lane + 32);
    i64 e = -1;
    float w = 0.f;
    if (lane < K) {
        e = __ldg(a.topk_idx + (i64)tok * K + lane);
        if (a.topk_weights != nullptr) w = __ldg(a.topk_weights + (i64)tok * K + lane);
    }
    if (lane < R && ((dmask >> lane) & 1u)) {
        u64 dst;
        if (lane == a.rank) {
            const int row = local_base + my_slot;
            dst = row < a.num_out_rows ? (u64)(a.recv_x + (i64)row * a.hidden_int4) : 0;  // 0: overflow, drop
        } else {
            dst = dispatch_slot(a, a.peer_bases[lane], a.rank, c, my_slot);
        }
        s_dst[lane] = dst;
    }
    // the local row index travels in lane `rank`'s my_slot
    const int local_row = local_base + __shfl_sync(FULL_MASK, my_slot, a.rank);
    __syncwarp();

    // hidden: read once, store to every destination
    const int4* src = a.x + (i64)tok * a.hidden_int4;
    for (int i = lane; i < a.hidden_int4; i += 32 * kDispatchUnroll) {
        int4 v[kDispatchUnroll];
#pragma unroll
        for (int u = 0; u < kDispatchUnroll; ++u)
            if (i + u * 32 < a.hidden_int4) v[u] = ld_nc_v4(src + i + u * 32);
        u32 m = dmask;
        while (m) {
            const int r = __ffs(m) - 1;
            m &= m - 1;
            int4* dst = reinterpret_cast<int4*>(s_dst[r]);
            if (dst == nullptr) continue;
#pragma unroll
            for (int u = 0; u < kDispatchUnroll; ++u)
                if (i + u * 32 < a.hidden_int4) st_na_v4(dst + i + u * 32, v[u]);
        }
    }
    // Small fields: plain stores (the round's release orders them before the tail, like the rows).
    u32 m = dmask;
    while (m) {
        const int r = __ffs(m) - 1;
        m &= m - 1;
        if (s_dst[r] == 0) continue;
        const bool local = r == a.rank;
        if (S > 0) {  // FP8 scales
            float* out = local ? a.recv_x_scales + (i64)local_row * S : reinterpret_cast<float*>(s_dst[r] + a.slot_off_scales);
            if (lane < S) out[lane] = sc0;
            if (lane + 32 < S) out[lane + 32] = sc1;
            for (int j = lane + 64; j < S; j += 32) out[j] = __ldg(a.x_scales + (i64)tok * S + j);
        }
        if (lane < K) {  // top-k: global ids -> the destination's local ids (-1 elsewhere), weights masked to 0
            const i64 lid = e - (i64)r * a.num_local_experts;
            const bool keep = e >= 0 && lid >= 0 && lid < a.num_local_experts;
            const int id = keep ? (int)lid : -1;
            const float wv = keep ? w : 0.f;
            if (local) {
                a.recv_topk_idx[(i64)local_row * K + lane] = (i64)id;
                if (a.recv_topk_weights != nullptr) a.recv_topk_weights[(i64)local_row * K + lane] = wv;
            } else {
                int* meta = reinterpret_cast<int*>(s_dst[r] + a.slot_off_meta);
                meta[1 + lane] = id;
                reinterpret_cast<float*>(meta)[1 + K + lane] = wv;
            }
        }
        if (lane == 0) {
            if (!local) reinterpret_cast<int*>(s_dst[r] + a.slot_off_meta)[0] = tok;
            else if (a.flags & DISPATCH_FLAG_WRITE_HANDLE) a.recv_src_idx[local_row] = tok;
        }
    }
    __syncwarp();  // s_dst is rewritten by the next token
}

// One block of 32 tokens [sb, block_end) as every sender warp sees it: lane l's destinations (bits),
// its slot per destination and its item (index among the tokens with a served destination);
// count / items move past the block.
struct TokenBlock {
    u32 bits;
    int item;
    int slot[CL_MAX_RANKS];
};

__device__ __forceinline__ TokenBlock scan_token_block(const DispatchArgs& a, int sb, int block_end, u32 serve,
                                                       int (&count)[CL_MAX_RANKS], int& items) {
    TokenBlock b;
    const int t = sb + lane_id();
    b.bits = 0;
    if (t < block_end)
        for (int r = 0; r < a.num_ranks; ++r) b.bits |= (u32)(a.is_token_in_rank[(i64)t * a.num_ranks + r] != 0) << r;
#pragma unroll
    for (int r = 0; r < CL_MAX_RANKS; ++r) {
        const u32 m = __ballot_sync(FULL_MASK, (b.bits >> r) & 1u);
        b.slot[r] = count[r] + __popc(m & lanemask_lt());
        count[r] += __popc(m);
    }
    const u32 any = __ballot_sync(FULL_MASK, (b.bits & serve) != 0);
    b.item = items + __popc(any & lanemask_lt());
    items += __popc(any);
    return b;
}

// The publisher's send_head row of token t (non-cached mode): its row in each destination, or -1.
__device__ __forceinline__ void write_send_head(const DispatchArgs& a, bool valid, int t, const TokenBlock& b,
                                                const int* s_head_base) {
    if (!(a.flags & DISPATCH_FLAG_WRITE_HANDLE) || !valid) return;
#pragma unroll
    for (int r = 0; r < CL_MAX_RANKS; ++r)
        if (r < a.num_ranks) a.send_head[(i64)t * a.num_ranks + r] = ((b.bits >> r) & 1u) ? s_head_base[r] + b.slot[r] : -1;
}

// This warp's tokens of the block (item % num_copy_warps == warp). s_progress (streaming sender):
// after every kStreamReleaseEvery-th token of the warp (unreleased counts them), lane 0
// release-stores the warp's next item.
__device__ __forceinline__ void copy_own_tokens(const DispatchArgs& a, int c, int sb, const TokenBlock& b, u32 serve,
                                                int num_copy_warps, int local_base, u64* s_dst, int* s_progress,
                                                int& unreleased, u64 seq, u32& head_seen) {
    const int warp = warp_id(), lane = lane_id();
    u32 mine = __ballot_sync(FULL_MASK, (b.bits & serve) != 0 && b.item % num_copy_warps == warp);
    while (mine) {
        const int l = __ffs(mine) - 1;
        mine &= mine - 1;
        const u32 dmask = __shfl_sync(FULL_MASK, b.bits, l) & serve;
        int my_slot = 0;
#pragma unroll
        for (int r = 0; r < CL_MAX_RANKS; ++r) {
            const int v = __shfl_sync(FULL_MASK, b.slot[r], l);
            if (lane == r) my_slot = v;
        }
        dispatch_copy_token(a, c, sb + l, dmask, my_slot, local_base, s_dst, seq, head_seen);
        if (s_progress != nullptr && ++unreleased >= kStreamReleaseEvery) {
            unreleased = 0;
            const int item = __shfl_sync(FULL_MASK, b.item, l);
            __syncwarp();  // every lane's stores of the token before lane 0's release
            if (lane == 0) st_release_cta_shared(s_progress + warp, item + num_copy_warps);
        }
    }
}

// The publisher warp: lane r < R (a peer) release-stores the count of tokens sent to it so far.
__device__ __forceinline__ void publish_tails(const DispatchArgs& a, int c, u64 seq, const int (&count)[CL_MAX_RANKS]) {
    const int lane = lane_id();
    if (lane >= a.num_ranks || lane == a.rank) return;
    int mine = 0;
#pragma unroll
    for (int r = 0; r < CL_MAX_RANKS; ++r)
        if (lane == r) mine = count[r];
    st_release_sys(flag_at(a.peer_bases[lane], CL_OFF_DISPATCH_TAIL, a.rank * CL_MAX_CHANNELS + c),
                   tail_word(seq, (u32)mine));
}

__device__ void dispatch_send(const DispatchArgs& a, int c, u64 seq) {
    __shared__ u64 s_dst_all[32][CL_MAX_RANKS];
    __shared__ int s_head_base[CL_MAX_RANKS];
    const int warp = warp_id(), lane = lane_id();
    const int num_warps = blockDim.x >> 5;
    const int publisher = num_warps - 1;
    const int num_copy_warps = num_warps - 1;
    const int R = a.num_ranks, C = a.num_channels, me = a.rank;
    const u64 own = a.peer_bases[me];
    int start, end;
    channel_range(a.num_tokens, C, c, &start, &end);

    if (warp == publisher) {
        // The previous call's receivers must be done with our slots before we overwrite them.
        const WaitSite site = {"dispatch", "dispatch done (previous call consumed)", me, c, false};
        const bool active = lane < R && lane != me;
        warp_wait_geq(flag_at(own, CL_OFF_DISPATCH_DONE, (active ? lane : 0) * CL_MAX_CHANNELS + c),
                      seq - 1, active, lane, site, a.timeout_ns);
        const WaitSite other = {"dispatch", "combine done (the last combine consumed the shared rings)", me, c, false};
        ring_wait_other_kind(own, CL_OFF_COMBINE_DONE, c, a.seq_counters[CL_SEQ_INDEX(CL_SEQ_COMBINE, 0, c)], active,
                             lane, other, a.timeout_ns);
        if (lane < R)  // row of this channel's first token in rank lane's recv_x
            s_head_base[lane] = rows_before(a.rank_prefix_matrix, R, me, lane) + a.channel_prefix_matrix[lane * C + c];
    }
    __syncthreads();
    // This call's signature, once the previous call's receivers are done (the wait above): copy warp
    // 0 writes it, and the first round's __syncthreads + tail release publish it like the rows.
    if (warp == 0 && lane < R && lane != me)
        st_volatile(signature_at(a.peer_bases[lane], CL_OFF_DISPATCH_SIG, me, c),
                    call_signature(CL_SIG_DISPATCH, seq, a.hidden_int4, a.num_scales, a.num_topk, C));
    const int local_base = s_head_base[me];
    u64* s_dst = s_dst_all[warp];

    int count[CL_MAX_RANKS];  // tokens so far per destination: identical in every warp
#pragma unroll
    for (int r = 0; r < CL_MAX_RANKS; ++r) count[r] = 0;
    int items = 0;  // tokens the sender copies so far (with a destination it serves)
    u32 head_seen = 0;  // lane r: rank r's last head this warp saw (rows it consumed)
    // destinations the sender copies to: all, or only the peers when the receiver does the local half
    const u32 serve = kLocalInReceiver ? ~(1u << me) : ~0u;
    const bool copier = warp < num_copy_warps;
#if CL_DISPATCH_STREAM_SEND
    // No round barriers: each copy warp streams its own tokens and, after each, release-stores its
    // next item (s_progress); the publisher acquires those words, and once every item of a block is
    // copied (the smallest next item is past the block) it releases the tails, at the round size.
    __shared__ int s_progress[32];
    int unreleased = 0;  // tokens this warp copied since its last release
    if (copier && lane == 0) s_progress[warp] = warp;  // its first item
    __syncthreads();  // the progress words, and the signature above, before any tail release
    for (int sb = start; sb < end; sb += 32) {
        const int block_end = min(sb + 32, end);
        const TokenBlock b = scan_token_block(a, sb, block_end, serve, count, items);
        if (warp == publisher) {
            write_send_head(a, sb + lane < block_end, sb + lane, b, s_head_base);
            int next;  // the smallest unfinished item: wait until it is past the block's end
            for (;;) {
                next = lane < num_copy_warps ? ld_acquire_cta_shared(s_progress + lane) : 0x7fffffff;
                for (int o = 16; o; o >>= 1) next = min(next, __shfl_xor_sync(FULL_MASK, next, o));
                if (next >= items) break;
            }
            __syncwarp();  // lane r's release below covers what the other lanes acquired
            // at the first block end past each round boundary (rounds are whole passes of the copy
            // warps, 31 tokens each by default, so they rarely end on a 32-token block), and at the end
            if ((block_end - start) / a.round_tokens != (sb - start) / a.round_tokens || block_end == end)
                publish_tails(a, c, seq, count);
        } else if (copier) {
            copy_own_tokens(a, c, sb, b, serve, num_copy_warps, local_base, s_dst, s_progress, unreleased, seq,
                            head_seen);
        }
    }
    __syncwarp();  // every lane's stores of its last tokens before lane 0's release
    if (copier && lane == 0) st_release_cta_shared(s_progress + warp, 0x7fffffff);  // none left
#else
    for (int round_start = start; round_start < end; round_start += a.round_tokens) {
        const int round_end = min(round_start + a.round_tokens, end);
        int unreleased = 0;  // unused: no progress words here
        for (int sb = round_start; sb < round_end; sb += 32) {
            const TokenBlock b = scan_token_block(a, sb, round_end, serve, count, items);
            if (warp == publisher)
                write_send_head(a, sb + lane < round_end, sb + lane, b, s_head_base);
            else if (copier)
                copy_own_tokens(a, c, sb, b, serve, num_copy_warps, local_base, s_dst, nullptr, unreleased, seq,
                                head_seen);
        }
        __syncthreads();  // every copy of this round is issued; the release below covers them
        if (warp == publisher) publish_tails(a, c, seq, count);
    }
#endif
}

// ------------------------------------------------------------------------------------------------
// Receiver
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void copy_row(int4* dst, const int4* src, int n) {
    for (int i = lane_id(); i < n; i += 32 * kDispatchUnroll) {
        int4 v[kDispatchUnroll];
#pragma unroll
        for (int u = 0; u < kDispatchUnroll; ++u)
            if (i + u * 32 < n) v[u] = ld_ring_v4(src + i + u * 32);
#pragma unroll
        for (int u = 0; u < kDispatchUnroll; ++u)
            if (i + u * 32 < n) st_na_v4(dst + i + u * 32, v[u]);
    }
}

// Where channel c's remote rows are, per source (starting after me, so ranks do not all read the
// same source first): its rank, first item and first row in recv_x. Thread 0 fills them, then the
// CTA syncs.
__device__ __forceinline__ void remote_rows_setup(const DispatchArgs& a, int c, int* s_src, int* s_off, int* s_base) {
    if (threadIdx.x == 0)
        channel_remote_rows(a.rank_prefix_matrix, a.recv_channel_prefix_matrix, a.num_ranks, a.num_channels,
                            a.rank, c, s_src, s_off, s_base);
    __syncthreads();
}

// Row i of source s (channel c) -> recv_x row `row`: small fields first (L2 loads, after this
// lane's acquire), so their latency hides under the row's.
__device__ __forceinline__ void dispatch_copy_remote_row(const DispatchArgs& a, int s, int c, int i, int row) {
    const int lane = lane_id();
    const int K = a.num_topk, S = a.num_scales;
    const u64 slot = dispatch_slot(a, a.peer_bases[a.rank], s, c, i);
    const float* scales = reinterpret_cast<const float*>(slot + a.slot_off_scales);
    const int* meta = reinterpret_cast<const int*>(slot + a.slot_off_meta);
    float sc0 = 0.f, sc1 = 0.f, wv = 0.f;
    int src = 0, id = -1;
    if (lane < S) sc0 = __ldcg(scales + lane);
    if (lane + 32 < S) sc1 = __ldcg(scales + lane + 32);
    if (lane == 0) src = __ldcg(meta);
    if (lane < K) {
        id = __ldcg(meta + 1 + lane);
        wv = __ldcg(reinterpret_cast<const float*>(meta) + 1 + K + lane);
    }
    copy_row(a.recv_x + (i64)row * a.hidden_int4, reinterpret_cast<const int4*>(slot), a.hidden_int4);
    if (lane < S) a.recv_x_scales[(i64)row * S + lane] = sc0;
    if (lane + 32 < S) a.recv_x_scales[(i64)row * S + lane + 32] = sc1;
    for (int k = lane + 64; k < S; k += 32) a.recv_x_scales[(i64)row * S + k] = __ldcg(scales + k);
    if (lane == 0 && (a.flags & DISPATCH_FLAG_WRITE_HANDLE)) a.recv_src_idx[row] = src;
    if (a.recv_topk_idx != nullptr && lane < K) {
        a.recv_topk_idx[(i64)row * K + lane] = (i64)id;
        if (a.recv_topk_weights != nullptr) a.recv_topk_weights[(i64)row * K + lane] = wv;
    }
}

// This warp's first rows of source s this call: same call, same slot geometry? (warp-uniform: lane
// 0 reports, the warp traps)
__device__ __forceinline__ void dispatch_check_signature(const DispatchArgs& a, int s, int c, u64 seq) {
    const u64 expected = call_signature(CL_SIG_DISPATCH, seq, a.hidden_int4, a.num_scales, a.num_topk, a.num_channels);
    const u64 seen = ld_volatile(signature_at(a.peer_bases[a.rank], CL_OFF_DISPATCH_SIG, s, c));
    if (seen != expected) signature_mismatch_trap("dispatch", a.rank, c, s, expected, seen, lane_id() == 0);
}

// The rows of channel c that remote ranks sent here: staging slots -> recv_x, items from `work`.
// The receiver calls it after its local half, and (CL_SHARE) the sender once its own rounds are
// published, each after remote_rows_setup (the whole CTA). Only for a channel whose rings do not
// wrap (items of one source after the other: a source's sender never waits for this receiver).
__shared__ int s_remote_src[CL_MAX_RANKS], s_remote_off[CL_MAX_RANKS + 1], s_remote_base[CL_MAX_RANKS];
__device__ void dispatch_recv_remote(const DispatchArgs& a, int c, u64 seq, WorkItems work) {
    int* s_src = s_remote_src;
    int* s_off = s_remote_off;
    int* s_base = s_remote_base;
    const int R = a.num_ranks, me = a.rank;
    const u64 own = a.peer_bases[me];
    const int num_items = s_off[R - 1];
    const WaitSite site = {"dispatch", "dispatch tail (sender progress)", me, c, true};
    int j = 0;
    u32 ready = 0;  // this lane's last acquired count for source s_src[j] (items come in rising order)
    for (int item = take_item(work); item < num_items; item = take_item(work)) {
        int jj = j;
        while (item >= s_off[jj + 1]) ++jj;
        if (jj != j) { j = jj; ready = 0; }
        const int s = s_src[j];
        const int i = item - s_off[j];
        if (__any_sync(FULL_MASK, (u32)i >= ready)) {
            const u64 v = warp_wait_geq(flag_at(own, CL_OFF_DISPATCH_TAIL, s * CL_MAX_CHANNELS + c),
                                        tail_word(seq, (u32)(i + 1)), true, s, site, a.timeout_ns);
            if (ready == 0) dispatch_check_signature(a, s, c, seq);
            ready = (u32)v;
        }
        const int row = s_base[j] + i;
        if (row >= a.num_out_rows) continue;  // more rows than num_worst_tokens: dropped
        dispatch_copy_remote_row(a, s, c, i, row);
    }
}

// Does a ring of channel c into this rank wrap this call (more rows from some source than cap)?
// After remote_rows_setup; the source's sender sees the same count (channel_prefix_matrix).
__device__ __forceinline__ bool dispatch_rings_wrap(const DispatchArgs& a) {
    for (int j = 0; j + 1 < a.num_ranks; ++j)
        if (s_remote_off[j + 1] - s_remote_off[j] > a.ring.cap) return true;
    return false;
}

// The remote rows of a channel whose rings wrap (after remote_rows_setup, whole CTA): copy warp w
// serves source j = w % (R - 1), rows w / (R - 1), + group size, ... in order, and after each row
// release-stores its next row (s_next); the last warp's lane j publishes source j's head = the
// smallest row any warp of group j has not finished, once it rose by head_batch rows (and at the
// end). A head lags by head_batch - 1 rows at most, and the engine keeps round + lag <= cap: the
// rows a sender's head wait needs are then always handed back.
static_assert(kDispatchThreads / 32 - 1 >= CL_MAX_RANKS - 1, "ring receivers need a copy warp per source");
__device__ void dispatch_recv_ring(const DispatchArgs& a, int c, u64 seq) {
    __shared__ int s_next[32];
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const int R = a.num_ranks, me = a.rank, G = R - 1;
    const int num_copy = num_warps - 1;
    const int j = warp % G, gr = warp / G, gs = (num_copy - j + G - 1) / G;
    if (warp < num_copy && lane == 0) s_next[warp] = gr;
    __syncthreads();
    if (warp < num_copy) {
        const int s = s_remote_src[j], n = s_remote_off[j + 1] - s_remote_off[j], base = s_remote_base[j];
        const u64* tail = flag_at(a.peer_bases[me], CL_OFF_DISPATCH_TAIL, s * CL_MAX_CHANNELS + c);
        const WaitSite site = {"dispatch", "dispatch tail (sender progress)", me, c, true};
        u32 ready = 0;
        for (int i = gr; i < n; i += gs) {
            if (__any_sync(FULL_MASK, (u32)i >= ready)) {  // lanes may have acquired different counts
                const u64 v = warp_wait_geq(tail, tail_word(seq, (u32)(i + 1)), true, s, site, a.timeout_ns);
                if (ready == 0) dispatch_check_signature(a, s, c, seq);
                ready = (u32)v;
            }
            if (base + i < a.num_out_rows) dispatch_copy_remote_row(a, s, c, i, base + i);
            __syncwarp();  // every lane's loads of the slot before lane 0 hands it back
            if (lane == 0) st_release_cta_shared(s_next + warp, i + gs);
        }
        if (lane == 0) st_release_cta_shared(s_next + warp, 0x7fffffff);
    } else {
        const int n = lane < G ? s_remote_off[lane + 1] - s_remote_off[lane] : 0;
        u64* head = flag_at(a.peer_bases[lane < G ? s_remote_src[lane] : me], CL_OFF_DISPATCH_HEAD,
                            me * CL_MAX_CHANNELS + c);
        int published = 0;
        bool done = lane >= G || n == 0;
        while (!__all_sync(FULL_MASK, done)) {
            if (!done) {
                int m = n;
                for (int w = lane; w < num_copy; w += G) m = min(m, ld_acquire_cta_shared(s_next + w));
                if (m - published >= a.head_batch || (m == n && m > published)) {
                    st_release_sys(head, tail_word(seq, (u32)m));
                    published = m;
                }
                done = published >= n;
            }
        }
    }
}

// Receiver CTA of channel c: the local half (x -> recv_x, CL_LOCAL_IN_RECEIVER), the remote
// rows, then the slots go back to the senders and rows past the received count are padded.
__device__ void dispatch_recv(const DispatchArgs& a, int c, u64 seq, WorkItems work, u32* smids) {
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const int R = a.num_ranks, C = a.num_channels, me = a.rank;
    const int* rpm = a.rank_prefix_matrix;
#if CL_LOCAL_IN_RECEIVER
    // The local half: tokens of this channel that stay here, x -> recv_x (no waiting), every warp
    // before the remote rows.
    {
        __shared__ u64 s_dst_all[32][CL_MAX_RANKS];
        int start, end;
        channel_range(a.num_tokens, C, c, &start, &end);
        const int local_base = rows_before(rpm, R, me, me) + a.channel_prefix_matrix[me * C + c];
        int count = 0;
        u32 no_head = 0;  // the local half waits for nobody
        for (int sb = start; sb < end; sb += 32) {
            const int t = sb + lane;
            const bool in = t < end && a.is_token_in_rank[(i64)t * R + me] != 0;
            const u32 m = __ballot_sync(FULL_MASK, in);
            const int slot = count + __popc(m & lanemask_lt());
            count += __popc(m);
            u32 mine = __ballot_sync(FULL_MASK, in && slot % num_warps == warp);
            while (mine) {
                const int l = __ffs(mine) - 1;
                mine &= mine - 1;
                dispatch_copy_token(a, c, sb + l, 1u << me, __shfl_sync(FULL_MASK, slot, l), local_base,
                                    s_dst_all[warp], seq, no_head);
            }
        }
    }
#endif
    remote_rows_setup(a, c, s_remote_src, s_remote_off, s_remote_base);
    if (dispatch_rings_wrap(a))
        dispatch_recv_ring(a, c, seq);
    else
        dispatch_recv_remote(a, c, seq, work);
    trace_point(smids, 1);
    __syncthreads();
#if CL_SHARE
    cluster_sync();  // the sender's items are done too
#endif
    // all slots of this channel are read: hand them back to the senders
    if (warp == 0 && lane < R && lane != me)
        st_release_sys(flag_at(a.peer_bases[lane], CL_OFF_DISPATCH_DONE, me * CL_MAX_CHANNELS + c), seq);

    // num_worst_tokens: rows past the received count
    dispatch_pad(a, c, rpm[(R - 1) * R + me]);
}

namespace commlib::intranode {

__global__ void CL_CLUSTER_DIMS __launch_bounds__(kDispatchThreads, kDispatchMinBlocks) dispatch(
    const int4* x, const float* x_scales, const i64* topk_idx, const float* topk_weights,
    const unsigned char* is_token_in_rank,
    const int* rank_prefix_matrix, const int* channel_prefix_matrix, const int* recv_channel_prefix_matrix,
    int4* recv_x, float* recv_x_scales, int* recv_src_idx, i64* recv_topk_idx, float* recv_topk_weights,
    int* send_head,
    int num_tokens, int hidden_int4, int num_scales, int num_topk, int num_local_experts, int num_out_rows,
    const u64* peer_bases, int rank, int num_ranks, int num_channels,
    u64 region_offset, u64 part_bytes, u64 ring_bytes, int ring_cap, int slot_bytes, int slot_off_scales,
    int slot_off_meta, int round_tokens, int flags, int head_batch, const int* abort_word, u64* seq_counters,
    u32* smids, u64 timeout_ns) {
    const Ring ring = {region_offset, part_bytes, ring_bytes, ring_cap, slot_bytes};
    const DispatchArgs a = {x, x_scales, topk_idx, topk_weights, is_token_in_rank,
                            rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                            recv_x, recv_x_scales, recv_src_idx, recv_topk_idx, recv_topk_weights, send_head,
                            num_tokens, hidden_int4, num_scales, num_topk, num_local_experts, num_out_rows,
                            peer_bases, rank, num_ranks, num_channels,
                            ring, slot_off_scales, slot_off_meta,
                            round_tokens, flags, head_batch, seq_counters, timeout_ns};
    __shared__ u64 s_seq;
    if (smids != nullptr && threadIdx.x == 0) smids[blockIdx.x] = get_smid();
    const int role = blockIdx.x & 1;  // 0 = sender, 1 = receiver
    const int num_pairs = gridDim.x >> 1;
    // num_worst_tokens calls cannot raise on the host: if the count exchange found bad input on any
    // rank (every rank sees the same word), nothing moves, every row is padding, and the sequence
    // counters stay put, exactly as if the call had not happened (the rejecting rank never ran it).
    if (abort_word != nullptr && ld_volatile(abort_word) >= 0) {
        if (role == 1)
            for (int c = blockIdx.x >> 1; c < num_channels; c += num_pairs) dispatch_pad(a, c, 0);
        return;
    }
    trace_point(smids, 0);
    for (int c = blockIdx.x >> 1; c < num_channels; c += num_pairs) {
        if (threadIdx.x == 0) s_seq = read_seq(seq_counters, CL_SEQ_DISPATCH, role, c);
        const WorkItems work = channel_work_items(role);
        __syncthreads();
        const u64 seq = s_seq;
        if (role == 0) {
            dispatch_send(a, c, seq);
            trace_point(smids, 1);
#if CL_SHARE
            remote_rows_setup(a, c, s_remote_src, s_remote_off, s_remote_base);
            if (!dispatch_rings_wrap(a)) dispatch_recv_remote(a, c, seq, work);  // wrapping: the receiver's groups
            cluster_sync();  // pairs with the receiver's, before it hands the slots back
#endif
        } else {
            dispatch_recv(a, c, seq, work, smids);
        }
        __syncthreads();
        if (threadIdx.x == 0) seq_counters[CL_SEQ_INDEX(CL_SEQ_DISPATCH, role, c)] = seq;
    }
    trace_point(smids, 2);
}

}  // namespace commlib::intranode
