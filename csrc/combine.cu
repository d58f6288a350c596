// combine.cu: return every received row to its token's home rank and sum each token's rows there.
//
// Grid: num_sms CTAs; CTA pair p serves channels p, p + num_sms/2, ... of the dispatch handle's
// channel split. Even CTA = sender, odd CTA = receiver of the channel.
//
// Buffer regions (byte offsets from a rank's NVLink buffer base; common.cuh has the control ones):
//   Ring [src][c] (common.cuh, Ring; the bytes dispatch's rings use) in home rank h's staging:
//       row i = the i-th row src received from h on channel c (those rows are contiguous in src's x:
//       rank_prefix + recv_channel_prefix gives the range), in slot i % cap; written by rank src's
//       sender CTA c, read by h's receiver CTA c. Slot = [hidden bf16][K float32 weights].
//   COMBINE_HEAD [h][c] u64 in src's buffer: (seq << 32) | rows consumed, release-stored by h's
//       receiver (its head publisher warp) when a ring of the channel wraps; src's copy warps wait
//       for head >= i - cap + 1 before writing row i.
//   COMBINE_TAIL [src][c] u64 in h's buffer: (seq << 32) | rows written, release-stored by src's
//       sender after each round; acquire-polled by h's receiver warps for the rows they need.
//   COMBINE_DONE [h][c] u64 in src's buffer: = seq, release-stored by h's receiver CTA c after it
//       read every slot; src's sender waits for seq - 1 (and the last dispatch's DISPATCH_DONE on c)
//       before writing the next call's slots.
//
// Sender CTA: warps 0 .. W-2 copy rows (row j of the channel's concatenated per-destination list
// goes to warp j % (W-1) within its round); warp W-1 publishes the tails after each round.
// Receiver CTA: warp w sums tokens start + w, start + w + W, ... (or tokens from a counter, below):
// for token t and each rank r with send_head[t][r] >= 0, the row is x[send_head[t][me]] for
// r = me (no copy) and staging slot send_head[t][r] - rank_prefix[me - 1][r] - channel_prefix[r][c]
// of source r otherwise. The sum (DeepEP's order, V1 and V2): acc = 0.f; acc += bias0; acc += bias1;
// then acc += row of each such rank (fp32 IEEE adds), in rank order, or in sum_order[t]'s order when
// given (DispatchHandle.sum_order; common.cuh sum_place decodes it once per token into the warp's
// table of sources, biases then rows, s_src); cast to bf16 (round to nearest even). The weights: fp32
// from 0, the rows' order, no bias.
// Work sharing (CL_SHARE, common.cuh): tokens come from a counter in the receiver's shared
// memory; the sender CTA takes tokens too once its rows are published, and the receiver releases
// COMBINE_DONE only after a cluster barrier with it.
// Rings that wrap (a channel moves more rows than cap between two ranks): the receiver sums tokens
// in order across sources, so a sender must never let one destination's full ring hold back the
// others: its copy warps are split into one group per destination, each writing its rows in order,
// and the last warp publishes each destination's tail = the smallest row its group has not written.
// The receiver's copy warps stride the tokens; its last warp publishes each source's head = that
// source's rows of the tokens before the smallest token any warp is still on. No work sharing then.
#include "common.cuh"

// The variant's knobs (loader.DEFAULT_VARIANT, passed with -D).
#if !defined(CL_COMBINE_THREADS) || !defined(CL_COMBINE_MIN_BLOCKS) || !defined(CL_COMBINE_COPY_UNROLL) || \
    !defined(CL_COMBINE_SUM_UNROLL)
#error "combine.cu compiles with the -D defines of commlib/cuda/loader.py options()"
#endif
constexpr int kCombineThreads = CL_COMBINE_THREADS;
constexpr int kCombineMinBlocks = CL_COMBINE_MIN_BLOCKS;    // CTAs per SM the register budget allows
constexpr int kCombineCopyUnroll = CL_COMBINE_COPY_UNROLL;  // sender: 16-byte vectors in flight per lane
constexpr int kCombineSumUnroll = CL_COMBINE_SUM_UNROLL;    // receiver: vectors per rank, two ranks' loads in flight

struct CombineArgs {
    const int4* x; const float* topk_weights; const int* send_head;
    const int* rank_prefix_matrix; const int* channel_prefix_matrix; const int* recv_channel_prefix_matrix;
    const int4* bias0; const int4* bias1; const u32* sum_order;
    int4* combined_x; float* combined_topk_weights;
    int num_tokens, hidden_int4, num_topk;
    const u64* peer_bases; int rank, num_ranks, num_channels;
    Ring ring; int slot_off_weights, round_rows, ring_batch;
    const u64* seq_counters;
    u64 timeout_ns;
};

__device__ __forceinline__ u64 combine_slot(const CombineArgs& a, u64 base, int src, int c, int i) {
    return ring_slot(a.ring, base, src, c, i);
}

// Row `row` of x (and its weights) -> slot i of my ring in a home rank's staging (whole warp).
__device__ __forceinline__ void combine_copy_row(const CombineArgs& a, int row, u64 slot) {
    const int lane = lane_id(), K = a.num_topk;
    const float wv = (a.topk_weights != nullptr && lane < K) ? __ldg(a.topk_weights + (i64)row * K + lane) : 0.f;
    const int4* src = a.x + (i64)row * a.hidden_int4;
    int4* dst = reinterpret_cast<int4*>(slot);
    for (int v0 = lane; v0 < a.hidden_int4; v0 += 32 * kCombineCopyUnroll) {
        int4 v[kCombineCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCombineCopyUnroll; ++u)
            if (v0 + u * 32 < a.hidden_int4) v[u] = ld_nc_v4(src + v0 + u * 32);
#pragma unroll
        for (int u = 0; u < kCombineCopyUnroll; ++u)
            if (v0 + u * 32 < a.hidden_int4) st_na_v4(dst + v0 + u * 32, v[u]);
    }
    if (a.topk_weights != nullptr && lane < K) reinterpret_cast<float*>(slot + a.slot_off_weights)[lane] = wv;
}


// ------------------------------------------------------------------------------------------------
// Sender
// ------------------------------------------------------------------------------------------------

// The sender of a channel whose rings wrap (after the tables, whole CTA): copy warp w writes the
// rows of destination j = w % (R - 1), rows w / (R - 1), + group size, ... in order, each once that
// destination's head leaves room, and release-stores its next row (s_next); the last warp's lane j
// publishes destination j's tail = the smallest row group j has not written, once it rose by
// ring_batch rows (and at the end), after this call's signature, which the same lane wrote before.
// Tails and heads lag by ring_batch - 1 rows at most each; the engine keeps 2 * ring_batch <= cap + 1,
// so a destination's head always leaves room for the row its receiver waits on.
static_assert(kCombineThreads / 32 - 1 >= CL_MAX_RANKS - 1, "ring senders need a copy warp per destination");
__device__ void combine_send_ring(const CombineArgs& a, int c, u64 seq, const int* s_dst, const int* s_off,
                                  const int* s_base) {
    __shared__ int s_next[32];
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const int R = a.num_ranks, me = a.rank, G = R - 1;
    const int num_copy = num_warps - 1;
    const int j = warp % G, gr = warp / G, gs = (num_copy - j + G - 1) / G;
    const u64 own = a.peer_bases[me];
    if (warp < num_copy && lane == 0) s_next[warp] = gr;
    __syncthreads();
    if (warp < num_copy) {
        const int d = s_dst[j], n = s_off[j + 1] - s_off[j], base = s_base[j];
        const u64* head = flag_at(own, CL_OFF_COMBINE_HEAD, d * CL_MAX_CHANNELS + c);
        const WaitSite site = {"combine", "combine head (receiver consumed)", me, c, true};
        u32 head_seen = 0;  // lane 0's
        for (int i = gr; i < n; i += gs) {
            ring_wait_room(a.ring, head, i, lane == 0, seq, head_seen, d, site, a.timeout_ns);
            combine_copy_row(a, base + i, combine_slot(a, a.peer_bases[d], me, c, i));
            __syncwarp();  // every lane's stores of the row before lane 0's release
            if (lane == 0) st_release_cta_shared(s_next + warp, i + gs);
        }
        if (lane == 0) st_release_cta_shared(s_next + warp, 0x7fffffff);
    } else {
        const int n = lane < G ? s_off[lane + 1] - s_off[lane] : 0;
        u64* tail = flag_at(a.peer_bases[lane < G ? s_dst[lane] : me], CL_OFF_COMBINE_TAIL, me * CL_MAX_CHANNELS + c);
        int published = 0;
        bool done = lane >= G || n == 0;
        while (!__all_sync(FULL_MASK, done)) {
            if (!done) {
                int m = n;
                for (int w = lane; w < num_copy; w += G) m = min(m, ld_acquire_cta_shared(s_next + w));
                if (m - published >= a.ring_batch || (m == n && m > published)) {
                    st_release_sys(tail, tail_word(seq, (u32)m));
                    published = m;
                }
                done = published >= n;
            }
        }
    }
}

__device__ void combine_send(const CombineArgs& a, int c, u64 seq) {
    __shared__ int s_dst[CL_MAX_RANKS], s_off[CL_MAX_RANKS + 1], s_base[CL_MAX_RANKS];
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const int publisher = num_warps - 1, num_copy_warps = num_warps - 1;
    const int R = a.num_ranks, C = a.num_channels, me = a.rank, K = a.num_topk;
    const u64 own = a.peer_bases[me];
    const int* rpm = a.rank_prefix_matrix;
    if (warp == publisher) {
        const WaitSite site = {"combine", "combine done (previous call consumed)", me, c, false};
        const bool active = lane < R && lane != me;
        warp_wait_geq(flag_at(own, CL_OFF_COMBINE_DONE, (active ? lane : 0) * CL_MAX_CHANNELS + c),
                      seq - 1, active, lane, site, a.timeout_ns);
        const WaitSite other = {"combine", "dispatch done (the last dispatch consumed the shared rings)", me, c, false};
        ring_wait_other_kind(own, CL_OFF_DISPATCH_DONE, c, a.seq_counters[CL_SEQ_INDEX(CL_SEQ_DISPATCH, 0, c)], active,
                             lane, other, a.timeout_ns);
        if (lane == 0)  // home ranks, starting after me so the ranks spread over the links
            channel_remote_rows(rpm, a.recv_channel_prefix_matrix, R, C, me, c, s_dst, s_off, s_base);
    }
    __syncthreads();
    // this call's signature, before any tail: the same lane's first release below publishes it
    if (warp == publisher && lane < R - 1)
        st_volatile(signature_at(a.peer_bases[s_dst[lane]], CL_OFF_COMBINE_SIG, me, c),
                    call_signature(CL_SIG_COMBINE, seq, a.hidden_int4, 0, K, C));
    const int num_items = s_off[R - 1];
    bool wraps = false;
    for (int j = 0; j + 1 < R; ++j) wraps |= s_off[j + 1] - s_off[j] > a.ring.cap;
    if (wraps) {
        combine_send_ring(a, c, seq, s_dst, s_off, s_base);
        return;
    }
    for (int round_start = 0; round_start < num_items; round_start += a.round_rows) {
        const int round_end = min(round_start + a.round_rows, num_items);
        if (warp != publisher) {
            int j = 0;
            for (int item = round_start + warp; item < round_end; item += num_copy_warps) {
                while (item >= s_off[j + 1]) ++j;
                const int i = item - s_off[j];
                combine_copy_row(a, s_base[j] + i, combine_slot(a, a.peer_bases[s_dst[j]], me, c, i));
            }
        }
        __syncthreads();  // the round's rows are issued; the release below covers them
        if (warp == publisher && lane < R - 1) {
            const int lo = s_off[lane], hi = s_off[lane + 1];
            if (round_start < hi && round_end > lo)  // this round wrote rows for destination lane
                st_release_sys(flag_at(a.peer_bases[s_dst[lane]], CL_OFF_COMBINE_TAIL, me * CL_MAX_CHANNELS + c),
                               tail_word(seq, (u32)(min(round_end, hi) - lo)));
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Receiver
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void load_vectors(int4 (&v)[kCombineSumUnroll], const int4* p, int i, int n) {
#pragma unroll
    for (int u = 0; u < kCombineSumUnroll; ++u)
        v[u] = (i + u * 32 < n) ? ld_ring_v4(p + i + u * 32) : make_int4(0, 0, 0, 0);
}

// Tokens of channel c, taken from `work`: sum each token's rows into combined_x. The whole CTA
// calls it: the receiver, and (CL_SHARE) the sender once its own rounds are published. s_tok (rings
// that wrap): this warp release-stores there the token it takes next, once the last one is summed.
__device__ void combine_recv_tokens(const CombineArgs& a, int c, u64 seq, WorkItems work, int* s_tok = nullptr) {
    __shared__ u64 s_src_all[32][CL_MAX_RANKS + 2];  // per warp: the token's sources in summation order
    __shared__ u64 s_w_all[32][CL_MAX_RANKS];        // per warp: weights pointer of the row summed i-th
    const int warp = warp_id(), lane = lane_id();
    const int R = a.num_ranks, C = a.num_channels, me = a.rank, K = a.num_topk;
    const int H4 = a.hidden_int4;
    const u64 own = a.peer_bases[me];
    u64* s_src = s_src_all[warp];
    u64* s_w = s_w_all[warp];
    int start, end;
    channel_range(a.num_tokens, C, c, &start, &end);

    // lane r < R: where rank r's rows for this channel start in my staging
    const int r_lane = lane < R ? lane : 0;
    const int slot_base = lane < R ? rows_before(a.rank_prefix_matrix, R, me, r_lane) + a.channel_prefix_matrix[r_lane * C + c] : 0;
    const u64* tail = flag_at(own, CL_OFF_COMBINE_TAIL, r_lane * CL_MAX_CHANNELS + c);
    const WaitSite site = {"combine", "combine tail (sender progress)", me, c, true};
    u32 ready = 0;  // lane r: rows of rank r acquired so far

    for (int t = start + take_item(work); t < end; t = start + take_item(work)) {
        if (s_tok != nullptr) {
            __syncwarp();  // every lane's loads of the last token's slots before lane 0 hands them back
            if (lane == 0) st_release_cta_shared(s_tok + warp, t);
        }
        const int h = lane < R ? __ldg(a.send_head + (i64)t * R + lane) : -1;
        const bool valid = h >= 0;
        const int rows = __popc(__ballot_sync(FULL_MASK, valid));  // of the token
        const int place = sum_place(a.sum_order != nullptr ? __ldg(a.sum_order + t) : 0u, valid, lane);
        // s_src: the biases first (lanes 30, 31), then the rows at their places
        const int nb = (a.bias0 != nullptr) + (a.bias1 != nullptr);
        if (lane == 30 && a.bias0 != nullptr) s_src[0] = (u64)(a.bias0 + (i64)t * H4);
        if (lane == 31 && a.bias1 != nullptr) s_src[nb - 1] = (u64)(a.bias1 + (i64)t * H4);
        u32 need = 0;
        if (valid) {
            if (lane == me) {
                s_src[nb + place] = (u64)(a.x + (i64)h * H4);
                s_w[place] = (u64)(a.topk_weights + (i64)h * K);
            } else {
                const int i = h - slot_base;
                const u64 slot = combine_slot(a, own, lane, c, i);
                s_src[nb + place] = slot;
                s_w[place] = slot + a.slot_off_weights;
                need = (u32)(i + 1);
            }
        }
        if (__any_sync(FULL_MASK, need > ready)) {
            const bool act = need > ready;
            // ready == 0: this warp's first rows of rank r_lane; is it the same call, same slot geometry?
            const u64 v = warp_wait_geq_signed(tail, tail_word(seq, need), act, r_lane, site, a.timeout_ns,
                                               (CL_OFF_COMBINE_SIG - CL_OFF_COMBINE_TAIL) / 8,
                                               call_signature(CL_SIG_COMBINE, seq, H4, 0, K, C), ready == 0);
            if (act) ready = (u32)v;
        }
        __syncwarp();
        // weights first: their loads overlap the rows'; summed in the rows' order
        float wsum = 0.f;
        if (a.combined_topk_weights != nullptr && lane < K) {
            float wr[CL_MAX_RANKS];
#pragma unroll
            for (int j = 0; j < CL_MAX_RANKS; ++j)
                wr[j] = j < rows ? __ldcg(reinterpret_cast<const float*>(s_w[j]) + lane) : 0.f;
#pragma unroll
            for (int j = 0; j < CL_MAX_RANKS; ++j)
                if (j < rows) wsum = add_rn(wsum, wr[j]);
        }

        const int num_src = nb + rows;
        int4* out = a.combined_x + (i64)t * H4;
        for (int i = lane; i < H4; i += 32 * kCombineSumUnroll) {
            float acc[kCombineSumUnroll][8];
#pragma unroll
            for (int u = 0; u < kCombineSumUnroll; ++u)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
            // two sources at a time: their loads are in flight together, the adds stay in order
            for (int j = 0; j < num_src; j += 2) {
                const bool two = j + 1 < num_src;
                int4 va[kCombineSumUnroll], vb[kCombineSumUnroll];
                load_vectors(va, reinterpret_cast<const int4*>(s_src[j]), i, H4);
                if (two) load_vectors(vb, reinterpret_cast<const int4*>(s_src[j + 1]), i, H4);
#pragma unroll
                for (int u = 0; u < kCombineSumUnroll; ++u) acc_bf16x8(acc[u], va[u]);
                if (two) {
#pragma unroll
                    for (int u = 0; u < kCombineSumUnroll; ++u) acc_bf16x8(acc[u], vb[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < kCombineSumUnroll; ++u)
                if (i + u * 32 < H4) st_na_v4(out + i + u * 32, pack_bf16x8(acc[u]));
        }
        if (a.combined_topk_weights != nullptr && lane < K) a.combined_topk_weights[(i64)t * K + lane] = wsum;
        __syncwarp();  // s_src / s_w are rewritten by the next token
    }
    if (s_tok != nullptr && lane == 0) st_release_cta_shared(s_tok + warp, 0x7fffffff);
}

// Rows rank r sent me on channel c (dispatch), i.e. what it returns here now.
__device__ __forceinline__ int combine_rows_from(const CombineArgs& a, int r, int c) {
    const int R = a.num_ranks, C = a.num_channels, me = a.rank;
    const int* cpm = a.channel_prefix_matrix;
    const int total = a.rank_prefix_matrix[me * R + r] - rows_before(a.rank_prefix_matrix, R, me, r);
    return (c + 1 < C ? cpm[r * C + c + 1] : total) - cpm[r * C + c];
}

__device__ __forceinline__ bool combine_rings_wrap(const CombineArgs& a, int c) {
    for (int r = 0; r < a.num_ranks; ++r)
        if (r != a.rank && combine_rows_from(a, r, c) > a.ring.cap) return true;
    return false;
}

// The receiver of a channel whose rings wrap (whole CTA): copy warps stride the tokens; the last
// warp publishes, for each source r (lane r), r's rows of the tokens before the smallest token a
// copy warp is still on, once that rose by ring_batch rows and at the end (heads are counted as the
// tokens pass: send_head >= 0).
__device__ void combine_recv_ring(const CombineArgs& a, int c, u64 seq) {
    __shared__ int s_tok[32];
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const int R = a.num_ranks, me = a.rank;
    const int num_copy = num_warps - 1;
    int start, end;
    channel_range(a.num_tokens, a.num_channels, c, &start, &end);
    if (warp < num_copy && lane == 0) s_tok[warp] = start + warp;
    __syncthreads();
    if (warp < num_copy) {
        const WorkItems work = {0u, warp, num_copy};
        combine_recv_tokens(a, c, seq, work, s_tok);
        return;
    }
    const bool peer = lane < R && lane != me;
    u64* head = flag_at(a.peer_bases[peer ? lane : me], CL_OFF_COMBINE_HEAD, me * CL_MAX_CHANNELS + c);
    int scanned = start, consumed = 0, published = 0;
    while (true) {
        int t = lane < num_copy ? ld_acquire_cta_shared(s_tok + lane) : 0x7fffffff;
        for (int o = 16; o; o >>= 1) t = min(t, __shfl_xor_sync(FULL_MASK, t, o));
        t = min(t, end);
        __syncwarp();  // lane r's release below covers what the other lanes acquired
        if (peer) {
            for (; scanned < t; ++scanned) consumed += __ldg(a.send_head + (i64)scanned * R + lane) >= 0;
            if (consumed - published >= a.ring_batch || (t >= end && consumed > published)) {
                st_release_sys(head, tail_word(seq, (u32)consumed));
                published = consumed;
            }
        }
        if (t >= end) break;
    }
}

// Receiver CTA of channel c: the tokens, then the slots go back to the senders.
__device__ void combine_recv(const CombineArgs& a, int c, u64 seq, WorkItems work, u32* smids) {
    const int warp = warp_id(), lane = lane_id();
    if (combine_rings_wrap(a, c))
        combine_recv_ring(a, c, seq);
    else
        combine_recv_tokens(a, c, seq, work);
    trace_point(smids, 1);
    __syncthreads();
#if CL_SHARE
    cluster_sync();  // the sender's tokens are done too
#endif
    // every slot of this channel is read: hand them back to the senders
    if (warp == 0 && lane < a.num_ranks && lane != a.rank)
        st_release_sys(flag_at(a.peer_bases[lane], CL_OFF_COMBINE_DONE, a.rank * CL_MAX_CHANNELS + c), seq);
}

namespace commlib::intranode {

__global__ void CL_CLUSTER_DIMS __launch_bounds__(kCombineThreads, kCombineMinBlocks) combine(
    const int4* x, const float* topk_weights, const int* send_head,
    const int* rank_prefix_matrix, const int* channel_prefix_matrix, const int* recv_channel_prefix_matrix,
    const int4* bias0, const int4* bias1, const u32* sum_order, int4* combined_x, float* combined_topk_weights,
    int num_tokens, int hidden_int4, int num_topk,
    const u64* peer_bases, int rank, int num_ranks, int num_channels,
    u64 region_offset, u64 part_bytes, u64 ring_bytes, int ring_cap, int slot_bytes, int slot_off_weights,
    int round_rows, int ring_batch, u64* seq_counters, u32* smids, u64 timeout_ns) {
    const Ring ring = {region_offset, part_bytes, ring_bytes, ring_cap, slot_bytes};
    const CombineArgs a = {x, topk_weights, send_head, rank_prefix_matrix, channel_prefix_matrix,
                           recv_channel_prefix_matrix, bias0, bias1, sum_order, combined_x, combined_topk_weights,
                           num_tokens, hidden_int4, num_topk, peer_bases, rank, num_ranks, num_channels,
                           ring, slot_off_weights, round_rows, ring_batch, seq_counters, timeout_ns};
    __shared__ u64 s_seq;
    if (smids != nullptr && threadIdx.x == 0) smids[blockIdx.x] = get_smid();
    const int role = blockIdx.x & 1;
    const int num_pairs = gridDim.x >> 1;
    trace_point(smids, 0);
    for (int c = blockIdx.x >> 1; c < num_channels; c += num_pairs) {
        if (threadIdx.x == 0) s_seq = read_seq(seq_counters, CL_SEQ_COMBINE, role, c);
        const WorkItems work = channel_work_items(role);
        __syncthreads();
        const u64 seq = s_seq;
        if (role == 0) {
            combine_send(a, c, seq);
            trace_point(smids, 1);
#if CL_SHARE
            if (!combine_rings_wrap(a, c)) combine_recv_tokens(a, c, seq, work);  // wrapping: the receiver's warps
            cluster_sync();  // pairs with the receiver's, before it hands the slots back
#endif
        } else {
            combine_recv(a, c, seq, work, smids);
        }
        __syncthreads();
        if (threadIdx.x == 0) seq_counters[CL_SEQ_INDEX(CL_SEQ_COMBINE, role, c)] = seq;
    }
    trace_point(smids, 2);
}

}  // namespace commlib::intranode
