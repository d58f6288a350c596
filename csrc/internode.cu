// internode.cu: the internode engine's per-token work on the device (commlib/backends/internode.py,
// "device kernels"), so a dispatch issues a handful of launches instead of hundreds of torch ops.
//
// Legend: T tokens here, R ranks, M nodes, P ranks per node, E experts, K top-k, Kc the most network
// chunks, C channels, me this rank, W payload bytes of a row. Every buffer is contiguous.
//
// Kernels (commlib::internode::; the loader's names inter_<name>_kernel):
//   meta                     before the count exchange: the exchange row's counts (per rank, per node,
//                            per (node, chunk, local rank), per expert, tokens over the node limit,
//                            bad ids, T), each token's row among this rank's rows for every rank
//                            (`before`, the exclusive scan of is_token_in_rank) and its row in every
//                            node's stream (`spos`, -1 where it does not go)
//   digest                   after it: what the host needs of the gathered rows, in one short vector
//                            (exchange_digest in internode.py): an error flag, the chunk count, this
//                            rank's row totals and the splits of its streams, so the one host read
//                            does not grow with ranks x experts
//   pack                     after it: the handle's send_head, rank and channel prefix matrices, and
//                            every (token, node) row written once into the send buffer at its
//                            chunk-major slot, with its final row on each rank of that node
//                            (cached dispatch: the handle's send_head and the plan's slots)
//   land                     landed rows -> the outputs' columns at their final row (the row's own
//                            position word, or the row's index where the forwarder already placed it);
//                            expert ids made local, weights of other ranks' experts zeroed
//   recv_chan                the handle's recv_channel_prefix_matrix from the landed source indices
//   rows                     combine: rows (bf16 y [n, H], float32 w [n, K]) packed at given rows
//   home                     combine at home: per token float32 from +0, IEEE adds: the biases first
//                            (DeepEP v1's internode combine adds them there), then its node partials
//                            in node order; one bf16 rounding
// Integer counts come out as the torch spec in backends/internode.py computes them; the sums as
// reference.sum_rows followed by .to(torch.bfloat16), bit for bit.
#include "common.cuh"

typedef unsigned char u8;

// Exclusive scan of one flag per thread over a whole CTA (blockDim a multiple of 32, <= 1024).
// Returns this thread's prefix; *total gets the CTA's count. Uses s_warp[32].
__device__ __forceinline__ int cta_scan_flag(bool flag, int* s_warp, int* total) {
    const u32 bal = __ballot_sync(FULL_MASK, flag);
    const int lane = lane_id(), warp = warp_id(), nwarps = blockDim.x >> 5;
    if (lane == 0) s_warp[warp] = __popc(bal);
    __syncthreads();
    if (warp == 0) {
        const int v = lane < nwarps ? s_warp[lane] : 0;
        int incl = v;
        for (int d = 1; d < 32; d <<= 1) {
            const int o = __shfl_up_sync(FULL_MASK, incl, d);
            if (lane >= d) incl += o;
        }
        s_warp[lane] = incl - v;                     // exclusive prefix of warp `lane`
        if (lane == 31) s_warp[32] = incl;           // the CTA's count
    }
    __syncthreads();
    const int prefix = s_warp[warp] + __popc(bal & lanemask_lt());
    *total = s_warp[32];
    __syncthreads();                                 // s_warp is reused by the next call
    return prefix;
}

namespace commlib::internode {

// Row layout of the count exchange (InternodeBackend._row_len): [head n_sig][per rank R][over node
// limit][bad ids][per node M][per (node, chunk, local rank) M Kc P][per expert E][T].
// Grid: R + M + 1 CTAs. CTA r < R scans rank r's column; CTA R + m node m's; the last the rest.
__global__ void __launch_bounds__(1024) meta(
    const u8* __restrict__ tir, const i64* __restrict__ topk, const int* __restrict__ experts_in,
    const i64* __restrict__ head, int n_sig, int T, int R, int M, int P, int E, int K, int Kc, int ring,
    int max_nodes, i64* __restrict__ row, int* __restrict__ before, int* __restrict__ spos) {
    extern __shared__ int s_dyn[];                   // last CTA: [E]; node CTAs: [Kc * P]
    __shared__ int s_warp[33];
    const int b = blockIdx.x;
    i64* per_rank = row + n_sig;
    i64* per_node = per_rank + R + 2;
    i64* blocks = per_node + M;
    i64* per_expert = blocks + (i64)M * Kc * P;
    if (b < R + M) {
        const bool node = b >= R;
        const int col = node ? b - R : b;
        int carry = 0;
        for (int base = 0; base < T; base += blockDim.x) {
            const int t = base + threadIdx.x;
            bool f = false;
            if (t < T) {
                if (node) {
                    for (int p = 0; p < P; ++p) f |= tir[(i64)t * R + col * P + p] != 0;
                } else {
                    f = tir[(i64)t * R + col] != 0;
                }
            }
            int total;
            const int pre = carry + cta_scan_flag(f, s_warp, &total);
            if (t < T) {
                if (node) spos[(i64)t * M + col] = f ? pre : -1;
                else before[(i64)t * R + col] = pre;
            }
            carry += total;
        }
        if (!node) {
            if (threadIdx.x == 0) per_rank[col] = carry;
            return;
        }
        // node m: rows per chunk of its stream, then what each (chunk, local rank) gets
        const int m = col;
        const int crows = max(ring, (carry + Kc - 1) / Kc);
        for (int i = threadIdx.x; i < Kc * P; i += blockDim.x) s_dyn[i] = 0;
        __syncthreads();  // also orders this CTA's spos stores before its loads below
        for (int t = threadIdx.x; t < T; t += blockDim.x) {
            const int s = spos[(i64)t * M + m];
            if (s < 0) continue;
            const int k = s / crows;
            for (int p = 0; p < P; ++p)
                if (tir[(i64)t * R + m * P + p]) atomicAdd(&s_dyn[k * P + p], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) per_node[m] = carry;
        for (int i = threadIdx.x; i < Kc * P; i += blockDim.x) blocks[(i64)m * Kc * P + i] = s_dyn[i];
        return;
    }
    // the last CTA: head, tokens over the node limit, bad ids, per-expert counts, T
    for (int i = threadIdx.x; i < n_sig; i += blockDim.x) row[i] = head[i];
    for (int i = threadIdx.x; i < E; i += blockDim.x) s_dyn[i] = 0;
    if (threadIdx.x < 2) s_warp[threadIdx.x] = 0;
    __syncthreads();
    int over = 0, bad = 0;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        int nodes = 0;
        for (int m = 0; m < M; ++m) {
            bool f = false;
            for (int p = 0; p < P; ++p) f |= tir[(i64)t * R + m * P + p] != 0;
            nodes += f;
        }
        over += nodes > max_nodes;
        for (int k = 0; k < K; ++k) {
            const i64 e = topk[(i64)t * K + k];
            if (e < -1 || e >= E) ++bad;
            else if (e >= 0) atomicAdd(&s_dyn[(int)e], 1);
        }
    }
    if (over) atomicAdd(&s_warp[0], over);
    if (bad) atomicAdd(&s_warp[1], bad);
    __syncthreads();
    for (int i = threadIdx.x; i < E; i += blockDim.x) per_expert[i] = K ? (i64)s_dyn[i] : (i64)experts_in[i];
    if (threadIdx.x == 0) {
        per_rank[R] = s_warp[0];
        per_rank[R + 1] = s_warp[1];
        per_expert[E] = T;
    }
}

// What the host needs of the gathered exchange g [R, row_len] (exchange_digest in
// backends/internode.py is its specification). One CTA. out (int64): [error, chunks, rows received
// here, most rows a rank of this node receives][this rank's rows per node M][rows each rail peer sends
// this node M][this forwarder's rows per (chunk, local rank) Kc P][rows each forwarder of this node
// passes here per (chunk, forwarder) Kc P][tokens per expert of this rank Lx].
__global__ void __launch_bounds__(256) digest(
    const i64* __restrict__ g, int row_len, int n_sig, int me, int node, int loc, int R, int M, int P,
    int Kc, int ring, int Lx, i64* __restrict__ out) {
    __shared__ int s_error, s_chunks;
    __shared__ unsigned long long s_node_rows;
    if (threadIdx.x == 0) { s_error = 0; s_chunks = 0; s_node_rows = 0; }
    __syncthreads();
    const int width = n_sig + R + 2 + M;             // the row up to the (node, chunk, local rank) blocks
    const i64* mine = g + (i64)me * row_len;
    int error = 0, chunks = 0;
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const i64* row = g + (i64)r * row_len;
        error |= row[0] != 0 || row[n_sig + R] > 0 || row[n_sig + R + 1] > 0;
        for (int i = 1; i < n_sig; ++i) error |= row[i] != mine[i];
        for (int m = 0; m < M; ++m) {                // chunks of rank r's stream to node m
            const i64 c = row[width - M + m];
            const i64 rows = max((i64)max(1, ring), (c + Kc - 1) / Kc);
            chunks = max(chunks, (int)((c + rows - 1) / rows));
        }
    }
    if (error) atomicOr(&s_error, 1);
    if (chunks) atomicMax(&s_chunks, chunks);
    i64* o_mine = out + 4;
    i64* o_rail = o_mine + M;
    i64* o_send = o_rail + M;
    i64* o_recv = o_send + Kc * P;
    i64* o_expert = o_recv + Kc * P;
    for (int m = threadIdx.x; m < M; m += blockDim.x) {
        o_mine[m] = mine[width - M + m];
        o_rail[m] = g[(i64)(m * P + loc) * row_len + width - M + node];
    }
    const int blk = width + node * Kc * P;            // every row's blocks for this node
    for (int i = threadIdx.x; i < Kc * P; i += blockDim.x) {
        const int k = i / P, p = i % P;
        i64 send = 0, recv = 0;
        for (int n = 0; n < M; ++n) {
            send += g[(i64)(n * P + loc) * row_len + blk + i];          // this forwarder to local rank p
            recv += g[(i64)(n * P + p) * row_len + blk + k * P + loc];  // forwarder p to this rank
        }
        o_send[i] = send;
        o_recv[i] = recv;
    }
    const int ex = width + M * Kc * P + me * Lx;
    for (int i = threadIdx.x; i < Lx; i += blockDim.x) {
        i64 s = 0;
        for (int r = 0; r < R; ++r) s += g[(i64)r * row_len + ex + i];
        o_expert[i] = s;
    }
    for (int p = threadIdx.x; p < P; p += blockDim.x) {   // rows each rank of this node receives
        i64 s = 0;
        for (int r = 0; r < R; ++r) s += g[(i64)r * row_len + n_sig + node * P + p];
        if (p == loc) out[2] = s;
        atomicMax(&s_node_rows, (unsigned long long)s);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        out[0] = s_error;
        out[1] = s_chunks;
        out[3] = (i64)s_node_rows;
    }
}

// The chunk-major slot of (token, node m) in the send rows: chunks k = 0, 1, ...; within a chunk
// node 0, 1, ...; within (k, m) the node stream's rows in token order. seg[k * M + m]: the first
// slot of (k, m); crows[m]: rows per chunk of node m's stream.
__device__ void chunk_geometry(const i64* send1, int M, int Kc, int ring, int* seg, int* crows) {
    for (int m = 0; m < M; ++m) crows[m] = max(ring, (int)((send1[m] + Kc - 1) / Kc));
    int acc = 0;
    for (int k = 0; k < Kc; ++k)
        for (int m = 0; m < M; ++m) {
            seg[k * M + m] = acc;
            acc += (int)max((i64)0, min((i64)crows[m], send1[m] - (i64)k * crows[m]));
        }
}

// Copy `words` 4-byte words, one warp.
__device__ __forceinline__ void warp_copy_words(u32* dst, const u32* src, int words) {
    for (int i = lane_id(); i < words; i += 32) dst[i] = src[i];
}

// Fresh (g != 0): g is the gathered exchange [R, row_len]; writes send_head [T, R], slot [T, M],
// rank_prefix [R, R] and chan_prefix [R, C] (CTA 0). Cached (g == 0): reads send_head and slot.
// Send row (send_stride bytes): x (x_bytes) | scales (s_bytes) | src_idx int32 | topk int64 [K] |
// weights float32 [K] (w != 0) | P int32 positions. Dynamic shared memory: ints [R + Kc M + M].
// With the forwarder, a cached dispatch's pack arrives at the node barrier its forwards wait for
// (common.cuh NodeSync, sync NODE_SYNC_ARRIVE_START; 0: none): this rank is past its earlier reads of
// every area, so the forwards of both streams (kept.py) may store once every rank's pack arrived.
__global__ void __launch_bounds__(512) pack(
    const i64* __restrict__ g, int row_len, int n_sig, int me, int T, int R, int M, int P, int Kc, int ring,
    int C, const u8* __restrict__ tir, const int* __restrict__ before, const int* __restrict__ spos,
    int* __restrict__ slot, int* __restrict__ send_head, int* __restrict__ rank_prefix,
    int* __restrict__ chan_prefix, const u8* __restrict__ x, int x_bytes, const u8* __restrict__ scales,
    int s_bytes, const i64* __restrict__ topk, const float* __restrict__ w, int K, u8* __restrict__ send,
    int send_stride, const u64* peer_bases, int local_rank, int num_local, u64 signal_offset, u64 timeout_ns,
    int sync) {
    __shared__ u64 s_base;
    const NodeSync ns{peer_bases, local_rank, num_local, signal_offset, timeout_ns, sync};
    node_sync_begin(ns, &s_base);
    extern __shared__ int s_dyn[];
    int* base = s_dyn;              // [R] rows of lower ranks on every rank
    int* seg = base + R;            // [Kc * M]
    int* crows = seg + Kc * M;      // [M]
    const bool fresh = g != nullptr;
    if (fresh) {
        const i64* mine = g + (i64)me * row_len + n_sig;
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            int s = 0;
            for (int q = 0; q < me; ++q) s += (int)g[(i64)q * row_len + n_sig + r];
            base[r] = s;
        }
        if (threadIdx.x == 0) chunk_geometry(mine + R + 2, M, Kc, ring, seg, crows);
        if (blockIdx.x == 0) {
            for (int r = threadIdx.x; r < R; r += blockDim.x) {
                int s = 0;
                for (int q = 0; q < R; ++q) {
                    s += (int)g[(i64)q * row_len + n_sig + r];
                    rank_prefix[q * R + r] = s;
                }
            }
            const int per = (T + C - 1) / C;
            for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
                const int r = i / C, start = min((i % C) * per, T);
                chan_prefix[i] = start < T ? before[(i64)start * R + r] : (int)mine[r];
            }
        }
        __syncthreads();
    }
    const int lane = lane_id();
    for (int t = blockIdx.x * (blockDim.x >> 5) + warp_id(); t < T; t += gridDim.x * (blockDim.x >> 5)) {
        if (fresh) {
            for (int r = lane; r < R; r += 32) {
                const i64 i = (i64)t * R + r;
                send_head[i] = tir[i] ? base[r] + before[i] : -1;
            }
            for (int m = lane; m < M; m += 32) {
                const int s = spos[(i64)t * M + m];
                const int k = s / crows[m];
                slot[(i64)t * M + m] = s < 0 ? -1 : seg[k * M + m] + s - k * crows[m];
            }
            __syncwarp();   // this warp's send_head / slot stores before its loads below
        }
        for (int m = 0; m < M; ++m) {
            const int sl = slot[(i64)t * M + m];
            if (sl < 0) continue;
            u8* dst = send + (i64)sl * send_stride;
            warp_copy_words((u32*)dst, (const u32*)(x + (i64)t * x_bytes), x_bytes >> 2);
            dst += x_bytes;
            if (s_bytes) warp_copy_words((u32*)dst, (const u32*)(scales + (i64)t * s_bytes), s_bytes >> 2);
            dst += s_bytes;
            if (lane == 0) *(int*)dst = t;
            dst += 4;
            if (K) {
                warp_copy_words((u32*)dst, (const u32*)(topk + (i64)t * K), 2 * K);
                dst += 8 * K;
                if (w) {
                    warp_copy_words((u32*)dst, (const u32*)(w + (i64)t * K), K);
                    dst += 4 * K;
                }
            }
            for (int p = lane; p < P; p += 32) ((int*)dst)[p] = send_head[(i64)t * R + m * P + p];
        }
    }
}

// Row i of `rows` (stride row_stride) goes to output row d = its int32 at byte pos_off (pos_off < 0:
// d = i); d outside [0, n_out) is skipped. Row layout: x | scales | src_idx | topk [K] | w [K] (the
// parts with a null output pointer are skipped, not their bytes). pos_out[i] = d when given.
__global__ void __launch_bounds__(512) land(
    const u8* __restrict__ rows, int n, int row_stride, int pos_off, int n_out, u8* __restrict__ x_out,
    int x_bytes, u8* __restrict__ s_out, int s_bytes, int* __restrict__ src_out, i64* __restrict__ topk_out,
    float* __restrict__ w_out, int K, int has_w, int expert_lo, int num_local, int* __restrict__ pos_out) {
    const int lane = lane_id();
    for (int i = blockIdx.x * (blockDim.x >> 5) + warp_id(); i < n; i += gridDim.x * (blockDim.x >> 5)) {
        const u8* src = rows + (i64)i * row_stride;
        const int d = pos_off < 0 ? i : *(const int*)(src + pos_off);
        if (pos_out && lane == 0) pos_out[i] = d;
        if (d < 0 || d >= n_out) continue;
        warp_copy_words((u32*)(x_out + (i64)d * x_bytes), (const u32*)src, x_bytes >> 2);
        src += x_bytes;
        if (s_out) warp_copy_words((u32*)(s_out + (i64)d * s_bytes), (const u32*)src, s_bytes >> 2);
        src += s_bytes;
        if (src_out && lane == 0) src_out[d] = *(const int*)src;
        src += 4;
        if (topk_out) {
            const i64* ids = (const i64*)src;   // 4-byte aligned only: two words per id
            const float* ws = (const float*)(src + 8 * K);
            for (int k = lane; k < K; k += 32) {
                const u32* p = (const u32*)(ids + k);
                const i64 e = (i64)((u64)p[0] | ((u64)p[1] << 32));
                const i64 local = e - expert_lo;
                const bool keep = e >= 0 && local >= 0 && local < num_local;
                topk_out[(i64)d * K + k] = keep ? local : -1;
                if (has_w) w_out[(i64)d * K + k] = keep ? ws[k] : 0.0f;
            }
        }
    }
}

// out[s, c] = rows from source s whose token is below s's channel start c (min(ceil(T_s / C) c, T_s)):
// src_idx holds the rows grouped by source, token order within one (source s: rows [start_s, end_s)
// with end_s = sum over q <= s of g[q][n_sig + me]); T_s = g[s][row_len - 1]. One CTA.
__global__ void __launch_bounds__(256) recv_chan(
    const int* __restrict__ src_idx, const i64* __restrict__ g, int row_len, int n_sig, int me, int R, int C,
    int* __restrict__ out) {
    for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
        const int s = i / C, c = i % C;
        int start = 0;
        for (int q = 0; q < s; ++q) start += (int)g[(i64)q * row_len + n_sig + me];
        const int end = start + (int)g[(i64)s * row_len + n_sig + me];
        const int Ts = (int)g[(i64)s * row_len + row_len - 1];
        const int bound = min(((Ts + C - 1) / C) * c, Ts);
        int lo = start, hi = end;   // first row in [start, end) with token >= bound
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (src_idx[mid] < bound) lo = mid + 1;
            else hi = mid;
        }
        out[i] = lo - start;
    }
}

// out row j (stride out_stride) = y row d | w row d, d = pos[j] (pos == 0: d = j): the combine row
// (_Packer y bf16 [H], w float32 [K]). y_bytes = 2 H. Into the forwarder's area (P > 1) it also takes the
// node barrier's pieces (common.cuh NodeSync; sync 0: none): a barrier before its stores (every peer past
// its reads of this rank's area) and an arrival after them (the first reduce waits for every rank's).
__global__ void __launch_bounds__(512) rows(
    const int* __restrict__ pos, int n, const u8* __restrict__ y, int y_bytes, const float* __restrict__ w, int K,
    u8* __restrict__ out, int out_stride, const u64* peer_bases, int local_rank, int P, u64 signal_offset,
    u64 timeout_ns, int sync) {
    __shared__ u64 s_base;
    __shared__ int s_last;
    const NodeSync ns{peer_bases, local_rank, P, signal_offset, timeout_ns, sync};
    node_sync_begin(ns, &s_base);
    for (int j = blockIdx.x * (blockDim.x >> 5) + warp_id(); j < n; j += gridDim.x * (blockDim.x >> 5)) {
        const int d = pos ? pos[j] : j;
        u8* dst = out + (i64)j * out_stride;
        warp_copy_words((u32*)dst, (const u32*)(y + (i64)d * y_bytes), y_bytes >> 2);
        if (K) warp_copy_words((u32*)(dst + y_bytes), (const u32*)(w + (i64)d * K), K);
    }
    node_sync_end(ns, &s_base, &s_last);
}

// Token t: y = bf16(0 + float(b0) + float(b1), + float(back row slot.y) for m ascending with
// slot[t, m] >= 0); w = the float32 sum of the rows' w from 0 (K > 0). back rows: y bf16 [H] | w float32 [K].
// H even (the rows' y as bf16 pairs).
__global__ void __launch_bounds__(512) home(
    const u8* __restrict__ back, int back_stride, const int* __restrict__ slot, int T, int M, int H, int K,
    const u32* __restrict__ b0, const u32* __restrict__ b1, u32* __restrict__ out_y, float* __restrict__ out_w) {
    const int lane = lane_id();
    const int pairs = H >> 1;
    for (int t = blockIdx.x * (blockDim.x >> 5) + warp_id(); t < T; t += gridDim.x * (blockDim.x >> 5)) {
        const int* sl = slot + (i64)t * M;
        for (int i = lane; i < pairs; i += 32) {
            float lo = 0.0f, hi = 0.0f;
            if (b0) { const u32 v = b0[(i64)t * pairs + i]; lo = add_rn(lo, bf16_lo(v)); hi = add_rn(hi, bf16_hi(v)); }
            if (b1) { const u32 v = b1[(i64)t * pairs + i]; lo = add_rn(lo, bf16_lo(v)); hi = add_rn(hi, bf16_hi(v)); }
            for (int m = 0; m < M; ++m) {
                const int s = sl[m];
                if (s < 0) continue;
                const u32 v = ((const u32*)(back + (i64)s * back_stride))[i];
                lo = add_rn(lo, bf16_lo(v));
                hi = add_rn(hi, bf16_hi(v));
            }
            out_y[(i64)t * pairs + i] = pack_bf16x2(lo, hi);
        }
        for (int k = lane; k < K; k += 32) {
            float acc = 0.0f;
            for (int m = 0; m < M; ++m) {
                const int s = sl[m];
                if (s >= 0) acc = add_rn(acc, ((const float*)(back + (i64)s * back_stride + 2 * H))[k]);
            }
            out_w[(i64)t * K + k] = acc;
        }
    }
}

}  // namespace commlib::internode
