// fanout.cu: the internode engine's fan-out inside a node over CUDA IPC (commlib/backends/fanout.py).
//
// Every local rank p of the node owns one peer-memory buffer that every process of the node maps
// (commlib/backends/nvlink/peer_memory.py); peer_bases[p] is its address in this process. Layout:
//   [signal_offset, + 8 * (CL_MAX_RANKS + 2))      the node barrier's signal area (common.cuh NodeSync:
//                                                  arrival[q], this rank's ticket and done count)
//   [data_offset, ...)                             rows (the landing buffer of this rank)
//
// Kernels (commlib::fanout::; the loader's names fanout_<name>_kernel):
//   notify    the barrier: all P local ranks meet (device side, CUDA-graph replayable)
//   dispatch  the forward step: each landed row -> its final row on every local rank that gets it
//   combine   the reduce step: per landed row, the sum (ascending p) of the local ranks' rows
// dispatch and combine also take the barrier's pieces (`sync`, common.cuh NODE_SYNC_*), so that a call
// needs no notify launch of its own: a dispatch's first forward enters the barrier before its stores
// and its last one the barrier after them; the combine rows kernel arrives after this rank's rows,
// the first reduce waits for every rank's.
// (named as DeepEP's kernels, so profilers and DeepEP's tests that read kernel names find
// `::notify`, `::dispatch` and `::combine` in an internode call)
//
// The protocol that makes plain stores and loads safe is in the Python module's docstring.
#include "common.cuh"

typedef unsigned char u8;
typedef unsigned short u16;

// Vectors of a row each lane keeps in flight.
constexpr int kForwardUnroll = 4;
constexpr int kReduceUnroll = 2;

namespace commlib::fanout {

// ------------------------------------------------------------------------------------------------
// Barrier: one CTA of one warp (lane q speaks for local rank q): common.cuh node_sync_begin with
// NODE_SYNC_ENTER (arrive at every local rank, release, system scope; wait until every own arrival
// >= this barrier's number, acquire). A peer that never comes traps after timeout_ns, naming it.
// ------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(32) notify(const u64* peer_bases, int local_rank, int P,
                                              u64 signal_offset, u64 timeout_ns) {
    __shared__ u64 s_base;
    node_sync_begin(NodeSync{peer_bases, local_rank, P, signal_offset, timeout_ns, NODE_SYNC_ENTER}, &s_base);
}

// ------------------------------------------------------------------------------------------------
// Forward: a warp per landed row j (grid-stride). Row j = W payload bytes, then P int32 positions
// (its final row on local rank p, -1: p does not get it). A window [lo, hi) of final rows: the
// payload is loaded once (not at all when no p's position is in the window) and stored to every p
// with lo <= pos < hi at peer_bases[p] + data_offset + (pos - lo) * dst_stride (the host puts the
// window's first area row into data_offset; one window of everything: lo 0, hi INT_MAX). V: int4
// when every size, stride and base is 16-byte aligned, else u32 (the host checks multiples of 4).
// pos_out (nullptr: none): row j's P positions also stored at pos_out[j * P + p], whatever the window
// (what combine reads later: the landed rows themselves are the call's scratch).
// ------------------------------------------------------------------------------------------------
template <typename V>
__device__ __forceinline__ void forward_rows(const u8* landed, int J, int row_stride, int W, int P,
                                             const u64* peer_bases, u64 data_offset, int dst_stride, int lo,
                                             int hi, int* pos_out) {
    constexpr int U = kForwardUnroll;
    const int lane = lane_id();
    const int warps = blockDim.x >> 5;
    const int n = W / (int)sizeof(V);
    const u64 base_lane = lane < P ? peer_bases[lane] + data_offset : 0;
    for (int j = blockIdx.x * warps + warp_id(); j < J; j += gridDim.x * warps) {
        const u8* row = landed + (i64)j * row_stride;
        const int pos_lane = lane < P ? reinterpret_cast<const int*>(row + W)[lane] : -1;
        if (pos_out != nullptr && lane < P) pos_out[(i64)j * P + lane] = pos_lane;
        const bool in_window = pos_lane >= lo && pos_lane < hi;  // (pos -1 is below every lo >= 0)
        if (!__any_sync(FULL_MASK, in_window)) continue;          // warp-uniform: no store, no load
        V* dst[CL_MAX_RANKS];
#pragma unroll
        for (int p = 0; p < CL_MAX_RANKS; ++p) {
            const int q = __shfl_sync(FULL_MASK, in_window ? pos_lane - lo : -1, p);
            const u64 b = __shfl_sync(FULL_MASK, base_lane, p);
            dst[p] = (p < P && q >= 0) ? reinterpret_cast<V*>(b + (u64)q * (u64)dst_stride) : nullptr;
        }
        const V* src = reinterpret_cast<const V*>(row);
        for (int i0 = lane; i0 < n; i0 += 32 * U) {
            V v[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (i0 + 32 * u < n) v[u] = src[i0 + 32 * u];
#pragma unroll
            for (int p = 0; p < CL_MAX_RANKS; ++p)
                if (dst[p] != nullptr)
#pragma unroll
                    for (int u = 0; u < U; ++u)
                        if (i0 + 32 * u < n) dst[p][i0 + 32 * u] = v[u];
        }
    }
}

__global__ void __launch_bounds__(1024) dispatch(const u8* landed, int J, int row_stride, int W,
                                                int P, const u64* peer_bases, u64 data_offset,
                                                int dst_stride, int lo, int hi, int* pos_out, int local_rank,
                                                u64 signal_offset, u64 timeout_ns, int sync) {
    __shared__ u64 s_base;
    __shared__ int s_last;
    const NodeSync ns{peer_bases, local_rank, P, signal_offset, timeout_ns, sync};
    node_sync_begin(ns, &s_base);   // ENTER on a call's first forward: every peer past its reads of its area
    u64 bits = (u64)W | (u64)row_stride | (u64)dst_stride | reinterpret_cast<u64>(landed) | data_offset;
    for (int p = 0; p < P; ++p) bits |= peer_bases[p];
    if ((bits & 15) == 0)
        forward_rows<int4>(landed, J, row_stride, W, P, peer_bases, data_offset, dst_stride, lo, hi, pos_out);
    else
        forward_rows<u32>(landed, J, row_stride, W, P, peer_bases, data_offset, dst_stride, lo, hi, pos_out);
    // This thread's stores into the peers are performed system-wide before it exits (the barrier
    // kernel after it fences again before its release: belt and braces, one fence per thread).
    __threadfence_system();
    node_sync_end(ns, &s_base, &s_last);   // ARRIVE_END | WAIT_END on a call's last forward
}

// ------------------------------------------------------------------------------------------------
// Reduce (combine mirror): out row j = bf16(sum over p ascending with pos[j, p] >= 0 of peer p's row
// pos[j, p], y part) then the float32 sum of the w part, both from +0.0f with IEEE adds (add_rn: no
// flush, no FMA), i.e. commlib.backends.reference.sum_rows (index_add_ per local rank, in rank
// order, into zeros) and .to(torch.bfloat16). A row: H bf16 then K float32, packed (w at byte 2H).
// The y part goes by vectors V of sizeof(V) / 2 bf16: int4 (8) when H % 8 == 0 and every stride and
// base is 16-byte aligned, u32 (2) when H is even and they are 4-byte aligned, else u16 (1). The
// K weights go as two u16 halves each (at byte 2H, 4-byte aligned only when H is even).
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void acc_vec(float* acc, int4 v) { acc_bf16x8(acc, v); }
__device__ __forceinline__ void acc_vec(float* acc, u32 v) {
    acc[0] = add_rn(acc[0], bf16_lo(v));
    acc[1] = add_rn(acc[1], bf16_hi(v));
}
__device__ __forceinline__ void acc_vec(float* acc, u16 v) { acc[0] = add_rn(acc[0], __uint_as_float((u32)v << 16)); }

template <typename V> __device__ __forceinline__ V pack_vec(const float* acc);
template <> __device__ __forceinline__ int4 pack_vec<int4>(const float* acc) { return pack_bf16x8(acc); }
template <> __device__ __forceinline__ u32 pack_vec<u32>(const float* acc) { return pack_bf16x2(acc[0], acc[1]); }
template <> __device__ __forceinline__ u16 pack_vec<u16>(const float* acc) {
    return (u16)(pack_bf16x2(acc[0], 0.f) & 0xffffu);
}

__device__ __forceinline__ float load_f32_halves(u64 addr) {
    const u16* h = reinterpret_cast<const u16*>(addr);
    return __uint_as_float((u32)__ldcg(h) | ((u32)__ldcg(h + 1) << 16));
}
__device__ __forceinline__ void store_f32_halves(u8* addr, float v) {
    const u32 b = __float_as_uint(v);
    u16* h = reinterpret_cast<u16*>(addr);
    h[0] = (u16)(b & 0xffffu);
    h[1] = (u16)(b >> 16);
}

template <typename V>
__device__ __forceinline__ void reduce_rows(const int* pos, int J, int P, const u64* peer_bases, u64 data_offset,
                                            int src_stride, int H, int K, u8* out, int out_stride) {
    constexpr int U = kReduceUnroll;
    constexpr int E = (int)sizeof(V) / 2;  // bf16 per vector
    const int lane = lane_id();
    const int warps = blockDim.x >> 5;
    const int n = H / E;
    const u64 base_lane = lane < P ? peer_bases[lane] + data_offset : 0;
    for (int j = blockIdx.x * warps + warp_id(); j < J; j += gridDim.x * warps) {
        const int pos_lane = lane < P ? pos[(i64)j * P + lane] : -1;
        u64 src[CL_MAX_RANKS];  // peer p's row, 0: p holds none of row j
#pragma unroll
        for (int p = 0; p < CL_MAX_RANKS; ++p) {
            const int q = __shfl_sync(FULL_MASK, pos_lane, p);
            const u64 b = __shfl_sync(FULL_MASK, base_lane, p);
            src[p] = (p < P && q >= 0) ? b + (u64)q * (u64)src_stride : 0;
        }
        u8* orow = out + (i64)j * out_stride;
        for (int i0 = lane; i0 < n; i0 += 32 * U) {
            float acc[U][E];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int e = 0; e < E; ++e) acc[u][e] = 0.f;
#pragma unroll
            for (int p = 0; p < CL_MAX_RANKS; ++p) {  // ascending p: the reference's order
                if (src[p] == 0) continue;
                const V* row = reinterpret_cast<const V*>(src[p]);
                V v[U];
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (i0 + 32 * u < n) v[u] = __ldcg(row + i0 + 32 * u);
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (i0 + 32 * u < n) acc_vec(acc[u], v[u]);
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (i0 + 32 * u < n) reinterpret_cast<V*>(orow)[i0 + 32 * u] = pack_vec<V>(acc[u]);
        }
        for (int k = lane; k < K; k += 32) {
            float acc = 0.f;
#pragma unroll
            for (int p = 0; p < CL_MAX_RANKS; ++p)
                if (src[p] != 0) acc = add_rn(acc, load_f32_halves(src[p] + 2 * (u64)H + 4 * (u64)k));
            store_f32_halves(orow + 2 * (i64)H + 4 * (i64)k, acc);
        }
    }
}

__global__ void __launch_bounds__(1024) combine(const int* pos, int J, int P,
                                               const u64* peer_bases, u64 data_offset,
                                               int src_stride, int H, int K, u8* out,
                                               int out_stride, int local_rank, u64 signal_offset,
                                               u64 timeout_ns, int sync) {
    __shared__ u64 s_base;
    node_sync_begin(NodeSync{peer_bases, local_rank, P, signal_offset, timeout_ns, sync}, &s_base);
    u64 bits = (u64)src_stride | (u64)out_stride | reinterpret_cast<u64>(out) | data_offset;
    for (int p = 0; p < P; ++p) bits |= peer_bases[p];
    if (H % 8 == 0 && (bits & 15) == 0)
        reduce_rows<int4>(pos, J, P, peer_bases, data_offset, src_stride, H, K, out, out_stride);
    else if (H % 2 == 0 && (bits & 3) == 0)
        reduce_rows<u32>(pos, J, P, peer_bases, data_offset, src_stride, H, K, out, out_stride);
    else
        reduce_rows<u16>(pos, J, P, peer_bases, data_offset, src_stride, H, K, out, out_stride);
}

}  // namespace commlib::fanout
