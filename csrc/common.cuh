// common.cuh: the device helpers every commlib kernel shares (PTX wrappers, waits, bf16 math).
//
// Compiled by NVRTC through CuPy (commlib/cuda/loader.py), which pastes this file in front of each
// kernel family, so it uses no host headers: only builtin types (int4, ...) and inline PTX.
// loader.py also defines the limits, the buffer-layout constants (CL_OFF_*) and the kernel
// variant's knobs with -D (loader.options()). None has a fallback here: a build that misses one
// fails to compile instead of running with a value the host does not know (tests/test_kernels_compile.py
// compiles every family from loader.default_builds()).
//
// CL_PLAIN=1 swaps the cache-hinted 16-byte loads/stores for plain C++ ones, so a benchmark
// can show what the hints buy (COMMLIB_PLAIN_LDST=1 at run time picks that build).
#pragma once

#if !defined(__CUDACC_RTC__)
#include <cstdio>  // nvcc checks only; NVRTC has device printf built in
#endif

typedef unsigned long long u64;
typedef unsigned int u32;
typedef long long i64;

// From loader.options():
//   CL_PLAIN               1: plain loads / stores (COMMLIB_PLAIN_LDST), 0: the PTX-hinted ones
//   CL_MAX_RANKS           NVLink peers of one node; rank masks fit one byte
//   CL_MAX_CHANNELS        num_sms <= 2 x this
//   Control region (the first CONTROL_BYTES of every rank's buffer), byte offsets (CONTROL_LAYOUT):
//   CL_OFF_DISPATCH_TAIL   u64 [src rank][channel]: sender progress, written by src
//   CL_OFF_DISPATCH_DONE   u64 [dst rank][channel]: "consumed up to seq", written by dst
//   CL_OFF_COMBINE_TAIL    u64 [src rank][channel]
//   CL_OFF_COMBINE_DONE    u64 [dst rank][channel]
//   CL_OFF_NOTIFY_FLAG     u64 [parity][src rank]
//   CL_OFF_DISPATCH_SIG    u64 [src rank][channel]: src sender's call_signature, written by src
//   CL_OFF_COMBINE_SIG     u64 [src rank][channel]
//   CL_OFF_DISPATCH_HEAD   u64 [dst rank][channel]: ring rows consumed, written by dst (Ring below)
//   CL_OFF_COMBINE_HEAD    u64 [dst rank][channel]
//   CL_OFF_NOTIFY_DATA     int [parity][src rank][slot_words]
//   CL_COMM_CLUSTER, CL_SHARE_WORK, CL_COMM_TRACE, CL_TRACE_OFFSET_WORDS, CL_TRACE_POINTS (below)
#if !defined(CL_PLAIN) || !defined(CL_MAX_RANKS) || !defined(CL_MAX_CHANNELS) || !defined(CL_OFF_DISPATCH_TAIL) || \
    !defined(CL_OFF_DISPATCH_DONE) || !defined(CL_OFF_COMBINE_TAIL) || !defined(CL_OFF_COMBINE_DONE) ||             \
    !defined(CL_OFF_NOTIFY_FLAG) || !defined(CL_OFF_DISPATCH_SIG) || !defined(CL_OFF_COMBINE_SIG) ||                 \
    !defined(CL_OFF_DISPATCH_HEAD) || !defined(CL_OFF_COMBINE_HEAD) ||                                                \
    !defined(CL_OFF_NOTIFY_DATA) || !defined(CL_COMM_CLUSTER) || !defined(CL_SHARE_WORK) ||                          \
    !defined(CL_COMM_TRACE) || !defined(CL_TRACE_OFFSET_WORDS) || !defined(CL_TRACE_POINTS)
#error "commlib kernels compile with the -D defines of commlib/cuda/loader.py options()"
#endif
constexpr bool kPlain = CL_PLAIN;
// Notify slot words (int32 offsets inside one source's slot).
#define CL_NW_NTPR 0                    // [R] the source's num_tokens_per_rank
#define CL_NW_BAD 8                     // bad top-k ids the source saw
#define CL_NW_SIG 9                     // [NW_SIG_WORDS] the source's call signature (notify.cu)
#define CL_NW_SIG_WORDS 7
#define CL_NW_CPM 16                    // [C] the source's channel prefix towards this rank
#define CL_NW_EXPERT (16 + CL_MAX_CHANNELS)  // [L] the source's tokens per local expert

// Sequence counters (loader.py sizes the array): u64 [kind][role][channel].
// CL_COMM_CLUSTER 2: the data kernels launch as thread-block clusters of two CTAs (a channel's
// sender and receiver), so a comm kernel takes SMs in pairs from one GPC. torch's persistent grouped
// GEMM (CUTLASS, 2x1 clusters) sizes its grid for all SMs but the carveout; comm CTAs scattered one
// per GPC leave odd free SMs behind, fewer cluster slots than that grid, and the GEMM's last clusters
// wait for a whole first wave (python -m experiments.bench_gemm_carveout --neighbour measures it).
#if CL_COMM_CLUSTER > 1
#define CL_CLUSTER_DIMS __cluster_dims__(CL_COMM_CLUSTER, 1, 1)
#else
#define CL_CLUSTER_DIMS
#endif

#define CL_SEQ_DISPATCH 0
#define CL_SEQ_COMBINE 1
#define CL_SEQ_NOTIFY 2
#define CL_SEQ_INDEX(kind, role, channel) (((kind) * 2 + (role)) * CL_MAX_CHANNELS + (channel))

#define FULL_MASK 0xffffffffu

// ------------------------------------------------------------------------------------------------
// Identity and time
// ------------------------------------------------------------------------------------------------

// Which SM this CTA runs on: the debug mode records it so a test can prove the SM budget.
__device__ __forceinline__ u32 get_smid() {
    u32 id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

// Nanoseconds on a clock shared by all SMs (clock64 is per SM and stops when the SM idles), so a
// wait's deadline means the same on every CTA. It ticks coarsely (~1 us), fine for timeouts.
__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ------------------------------------------------------------------------------------------------
// Bulk data: 16-byte vectors
// ------------------------------------------------------------------------------------------------

// Load of data nobody writes during this kernel, or written before an acquire we already did:
//   .nc                read-only (texture) path: does not compete with the coherent L1 traffic
//   .L1::no_allocate   the row is used once; keeping it in L1 only evicts things we reuse
//   .L2::256B          prefetch the whole 256-byte sector group: rows are read front to back
// asm volatile keeps it after the acquire loads that guard it (the compiler must not hoist it).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
    if constexpr (kPlain) return *p;  // ld.global: may allocate in L1, no prefetch hint
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Load of a ring slot: written again by its sender later in this kernel once the receiver handed it
// back (head), so it must never come from a line cached on a previous lap: L2 only in plain mode;
// the hinted load never allocates in L1 and is ordered after the tail acquire that guards it.
__device__ __forceinline__ int4 ld_ring_v4(const int4* p) {
    if constexpr (kPlain) return __ldcg(p);
    return ld_nc_v4(p);
}

// Store of a row nobody on this SM reads again: .L1::no_allocate skips L1. To a peer pointer this
// is a posted NVLink write; ordering against the progress word comes from the release store.
__device__ __forceinline__ void st_na_v4(int4* p, int4 v) {
    if constexpr (kPlain)
        *p = v;     // st.global: default (write-back) policy
    else
        asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
                     :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Shared-memory address of a generic pointer into this CTA's shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Progress words in shared memory between the warps of one CTA (release / acquire at CTA scope).
__device__ __forceinline__ void st_release_cta_shared(int* p, int v) {
    asm volatile("st.release.cta.shared::cta.b32 [%0], %1;" :: "r"(smem_addr(p)), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_cta_shared(const int* p) {
    int v;
    asm volatile("ld.acquire.cta.shared::cta.b32 %0, [%1];" : "=r"(v) : "r"(smem_addr(p)) : "memory");
    return v;
}

// Small fields (scales, ids, weights): plain volatile accesses keep program order against the
// asm volatile data path without pulling them through a cache we do not reuse.
template <typename T>
__device__ __forceinline__ T ld_volatile(const T* p) { return *(const volatile T*)p; }
template <typename T>
__device__ __forceinline__ void st_volatile(T* p, T v) { *(volatile T*)p = v; }

// ------------------------------------------------------------------------------------------------
// Flags between GPUs
// ------------------------------------------------------------------------------------------------

// Publish progress to another GPU: every write this thread performed (and, through the CTA
// barrier before it, every write of the CTA) becomes visible system-wide before the flag does.
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

// Read a flag another GPU publishes: later loads of this thread cannot be satisfied before it
// (so they see the rows the flag announces). The "memory" clobber stops compiler reordering too.
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// What a wait is for, printed when it times out.
struct WaitSite {
    const char* kernel;   // "dispatch", "combine", "notify"
    const char* counter;  // "dispatch tail", "dispatch done", ...
    int rank;             // this rank
    int channel;          // channel, -1 if none
    bool is_tail;         // the word is (seq << 32) | count (printed as such), else a plain sequence flag
};

// Warp-wide wait: each lane waits until *p_lane >= expected_lane (kExact: until the bits of
// *p_lane under `mask` equal expected_lane; lanes with active == false only take part). Every lane
// does its own acquire load, so every lane may read the data afterwards. The loop exits for the
// whole warp at once; on timeout one lane names what it waited for (rank, channel, counter, the
// peer rank = `peer`, expected vs seen; a progress word v is printed as seq = v >> 32 and count =
// v & 0xffffffff) and the kernel traps. Returns this lane's last value.
template <bool kExact>
__device__ __noinline__ u64 warp_wait_until(const u64* p_lane, u64 expected_lane, u64 mask, bool active, int peer,
                                            WaitSite site, u64 timeout_ns) {
    auto reached = [&](u64 v) { return kExact ? (v & mask) == expected_lane : v >= expected_lane; };
    u64 seen = active ? ld_acquire_sys(p_lane) : 0;
    bool ok = !active || reached(seen);
    if (__all_sync(FULL_MASK, ok)) return seen;
    const u64 start = global_timer_ns();
    while (true) {
        if (!ok) {
            seen = ld_acquire_sys(p_lane);
            ok = reached(seen);
        }
        if (__all_sync(FULL_MASK, ok)) return seen;
        const bool late = global_timer_ns() - start > timeout_ns;
        const u32 late_mask = __ballot_sync(FULL_MASK, late && !ok);
        if (late_mask) {
            const int lane = threadIdx.x & 31;
            if (lane == __ffs(late_mask) - 1) {
                if (kExact)
                    printf("[commlib] rank %d timeout in %s channel %d waiting for %s from rank %d: "
                           "expected tag %llx under mask %llx, seen %llx\n",
                           site.rank, site.kernel, site.channel, site.counter, peer, expected_lane, mask, seen);
                else if (site.is_tail)
                    printf("[commlib] rank %d timeout in %s channel %d waiting for %s from rank %d: "
                           "expected seq %llu count >= %llu, seen seq %llu count %llu\n",
                           site.rank, site.kernel, site.channel, site.counter, peer, expected_lane >> 32,
                           expected_lane & 0xffffffffull, seen >> 32, seen & 0xffffffffull);
                else
                    printf("[commlib] rank %d timeout in %s channel %d waiting for %s from rank %d: "
                           "expected >= %llu, seen %llu\n",
                           site.rank, site.kernel, site.channel, site.counter, peer, expected_lane, seen);
            }
            __syncwarp();
            asm volatile("trap;");
        }
    }
}
__device__ __forceinline__ u64 warp_wait_geq(const u64* p_lane, u64 expected_lane, bool active, int peer,
                                             WaitSite site, u64 timeout_ns) {
    return warp_wait_until<false>(p_lane, expected_lane, ~0ull, active, peer, site, timeout_ns);
}
// Self-validating words (tag in the bits under `mask`, payload in the rest) in a region whose layout
// can change from call to call: any stale bytes may sit there before the writer's store, so only
// the exact tag counts, never "at least".
__device__ __forceinline__ u64 warp_wait_tag(const u64* p_lane, u64 tag, u64 mask, bool active, int peer,
                                             WaitSite site, u64 timeout_ns) {
    return warp_wait_until<true>(p_lane, tag, mask, active, peer, site, timeout_ns);
}

// Progress words pack (seq << 32) | count so a stale word from an older call always compares
// smaller than any word of this call: no reset is ever needed.
__device__ __forceinline__ u64 tail_word(u64 seq, u32 count) { return (seq << 32) | (u64)count; }

// ------------------------------------------------------------------------------------------------
// Per-call signatures of the data kernels (cached dispatch and combine have no count exchange)
// ------------------------------------------------------------------------------------------------

// What a receiver must agree on with a sender before it reads the sender's staging slots: the
// slot geometry (hidden, FP8 scales, top-k entries), the channel split and the call. Each sender
// CTA writes it once per call into every destination's SIG word [src][channel] before its first
// tail release (same thread, so the release publishes it); each receiver warp compares it right
// after its first acquire of that source's tail, before it reads a row. Packed, so one word says it:
//   bits  0-15 call sequence number (low 16 bits)   bits 16-18 kind (1 dispatch, 2 combine)
//   bits 19-26 channels   bits 27-32 top-k   bits 33-42 FP8 scales per token   bits 43-63 hidden int4
#define CL_SIG_DISPATCH 1u
#define CL_SIG_COMBINE 2u
__device__ __forceinline__ u64 call_signature(u32 kind, u64 seq, int hidden_int4, int num_scales, int num_topk,
                                              int num_channels) {
    return (seq & 0xffffull) | ((u64)(kind & 7u) << 16) | ((u64)((u32)num_channels & 0xffu) << 19) |
           ((u64)((u32)num_topk & 0x3fu) << 27) | ((u64)((u32)num_scales & 0x3ffu) << 33) |
           ((u64)((u32)hidden_int4 & 0x1fffffu) << 43);
}

__device__ __forceinline__ u64* signature_at(u64 base, u64 region_offset, int src, int channel) {
    return reinterpret_cast<u64*>(base + region_offset) + (src * CL_MAX_CHANNELS + channel);
}

// A receiver found `seen` where it expected `expected` (0: the source never wrote one there): the
// calling lanes print (those with `print`), then trap, as the device timeout does: the host sees a
// CUDA error and the Buffer refuses further calls. Never returns (no registers kept across it).
__device__ __noinline__ __attribute__((noreturn)) void signature_mismatch_trap(const char* kernel, int rank,
                                                                               int channel, int peer, u64 expected,
                                                                               u64 seen, bool print) {
    if (print) {
        const u64 ke = (expected >> 16) & 7, ks = (seen >> 16) & 7;
        printf("[commlib] rank %d %s channel %d: signature mismatch with rank %d (expected %s seq %llu hidden %llu "
               "bytes scales %llu topk %llu channels %llu, seen %s seq %llu hidden %llu bytes scales %llu topk %llu "
               "channels %llu): the ranks' calls differ (hidden, dtype, top-k, Config or call order); none of its "
               "rows is read\n",
               rank, kernel, channel, peer, ke == 1 ? "dispatch" : ke == 2 ? "combine" : "none", expected & 0xffffull,
               (expected >> 43) * 16, (expected >> 33) & 0x3ffull, (expected >> 27) & 0x3full,
               (expected >> 19) & 0xffull, ks == 1 ? "dispatch" : ks == 2 ? "combine" : "none", seen & 0xffffull,
               (seen >> 43) * 16, (seen >> 33) & 0x3ffull, (seen >> 27) & 0x3full, (seen >> 19) & 0xffull);
    }
    __syncwarp(__activemask());  // the reporting lane prints before any lane of the warp traps
    asm volatile("trap;");
    __builtin_unreachable();
}

// warp_wait_geq on a progress word, then, for lanes with `check` (a receiver's first wait on that
// source this call), the source's signature word: it sits sig_delta words after the progress word
// (the SIG and TAIL regions are both [src][channel]), written before the release we just acquired.
// On a mismatch the first such lane reports (rank, kernel, channel, both signatures) and the warp
// traps. Whole warp, like warp_wait_geq; the check costs one load per source and call.
__device__ __noinline__ u64 warp_wait_geq_signed(const u64* p_lane, u64 expected_lane, bool active, int peer,
                                                 WaitSite site, u64 timeout_ns, int sig_delta, u64 expected_sig,
                                                 bool check) {
    const u64 v = warp_wait_geq(p_lane, expected_lane, active, peer, site, timeout_ns);
    const u64 seen = (active && check) ? ld_volatile(p_lane + sig_delta) : expected_sig;
    const u32 bad = __ballot_sync(FULL_MASK, seen != expected_sig);
    if (bad) signature_mismatch_trap(site.kernel, site.rank, site.channel, peer, expected_sig, seen,
                                     (threadIdx.x & 31) == __ffs(bad) - 1);
    return v;
}

// ------------------------------------------------------------------------------------------------
// BF16 <-> FP32 without cuda_bf16.h (NVRTC has no host headers; these are exact/IEEE)
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ float bf16_lo(u32 pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(u32 pair) { return __uint_as_float(pair & 0xffff0000u); }

// IEEE round-to-nearest add that ignores -ftz (CuPy compiles with -ftz=true; torch does not flush
// denormals, and combine must match torch bit for bit). Also never fused into an FMA.
__device__ __forceinline__ float add_rn(float a, float b) {
    float c;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(c) : "f"(a), "f"(b));
    return c;
}

// The same for multiply and divide (IEEE, no flush, never contracted): the low-latency combine's
// w * row and the FP8 cast's x / scale must round exactly as torch's separate kernels do.
__device__ __forceinline__ float mul_rn(float a, float b) {
    float c;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(c) : "f"(a), "f"(b));
    return c;
}
__device__ __forceinline__ float div_rn(float a, float b) {
    float c;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(c) : "f"(a), "f"(b));
    return c;
}

// Two floats -> two bf16 (round to nearest even, what torch's .to(bfloat16) does): lo in bits 0-15.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Accumulate 8 bf16 (one int4) into acc[0..7].
__device__ __forceinline__ void acc_bf16x8(float* acc, int4 v) {
    acc[0] = add_rn(acc[0], bf16_lo((u32)v.x)); acc[1] = add_rn(acc[1], bf16_hi((u32)v.x));
    acc[2] = add_rn(acc[2], bf16_lo((u32)v.y)); acc[3] = add_rn(acc[3], bf16_hi((u32)v.y));
    acc[4] = add_rn(acc[4], bf16_lo((u32)v.z)); acc[5] = add_rn(acc[5], bf16_hi((u32)v.z));
    acc[6] = add_rn(acc[6], bf16_lo((u32)v.w)); acc[7] = add_rn(acc[7], bf16_hi((u32)v.w));
}

__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
    int4 v;
    v.x = (int)pack_bf16x2(acc[0], acc[1]);
    v.y = (int)pack_bf16x2(acc[2], acc[3]);
    v.z = (int)pack_bf16x2(acc[4], acc[5]);
    v.w = (int)pack_bf16x2(acc[6], acc[7]);
    return v;
}

// Row sums, U vectors per lane at a time: this lane's vectors i0, i0 + 32, ..., i0 + 32 (U - 1) of an
// n-vector bf16 row. acc_row_part issues all U loads before the first add (U vectors in flight);
// vectors past the row's end are skipped. Used where rows are summed in float32 in a fixed order
// and rounded once (moe_rows.cu, ce.cu).
template <int U>
__device__ __forceinline__ void zero_acc(float (&acc)[U][8]) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
}

template <int U>
__device__ __forceinline__ void load_row_part(int4 (&v)[U], const int4* row, int i0, int n) {
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (i0 + 32 * u < n) v[u] = ld_nc_v4(row + i0 + 32 * u);
}

template <int U>
__device__ __forceinline__ void acc_row_part(float (&acc)[U][8], const int4* row, int i0, int n) {
    int4 v[U];
    load_row_part<U>(v, row, i0, n);
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (i0 + 32 * u < n) acc_bf16x8(acc[u], v[u]);
}

template <int U>
__device__ __forceinline__ void store_row_part(int4* out, const float (&acc)[U][8], int i0, int n) {
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (i0 + 32 * u < n) out[i0 + 32 * u] = pack_bf16x8(acc[u]);
}

// ------------------------------------------------------------------------------------------------
// Small helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }
__device__ __forceinline__ u32 lanemask_lt() { return (1u << (threadIdx.x & 31)) - 1u; }

// Bitwise OR of v over the warp (every lane calls it).
__device__ __forceinline__ u32 warp_or(u32 v) {
    u32 r;
    asm volatile("redux.sync.or.b32 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(FULL_MASK));
    return r;
}

// ------------------------------------------------------------------------------------------------
// Combine's summation order (DispatchHandle.sum_order), decoded once per token
// ------------------------------------------------------------------------------------------------
// order: nibble i names the rank summed i-th; a rank's key is its first nibble, 8 + rank where no
// nibble names it; the held ranks are summed by ascending key (order 0: rank order). Lane r (rank r,
// `held` = it has a row of the token; every lane calls it) gets its place in the sum, -1 if not held.
static_assert(CL_MAX_RANKS == 8, "a sum order names 8 ranks with 4 bits each in one u32; keys fit 16 bits");
__device__ __forceinline__ int sum_place(u32 order, bool held, int lane) {
    int key = CL_MAX_RANKS + lane;
#pragma unroll
    for (int i = CL_MAX_RANKS - 1; i >= 0; --i)
        if (((order >> (4 * i)) & 15u) == (u32)lane) key = i;
    const u32 keys = warp_or(held ? 1u << key : 0u);
    return held ? __popc(keys & ((1u << key) - 1u)) : -1;
}

// Nibble i = the rank summed i-th, for the places sum_place gave (every lane calls it).
__device__ __forceinline__ u32 sum_sequence(int place, int lane) {
    return warp_or(place >= 0 ? (u32)lane << (4 * place) : 0u);
}

// ------------------------------------------------------------------------------------------------
// Work shared by a channel's two CTAs (CL_SHARE_WORK, needs CL_COMM_CLUSTER 2)
// ------------------------------------------------------------------------------------------------
// A receiver moves about twice the bytes of its sender: it copies the local half as well as the
// received rows (dispatch), or reads every contributing row of a token (combine), while its sender
// only reads the rows it pushes. With sharing, the receiver's rows are items taken from a counter in
// the receiver CTA's shared memory, and the sender CTA, once its last round is published, takes
// items from the same counter through the cluster's shared-memory window. Each item is done by
// exactly one warp with the receiver's code, so results do not depend on who did it. A cluster
// barrier after the items (release / acquire) orders both CTAs' reads of the staging slots before
// the receiver hands them back to the senders.
#define CL_SHARE (CL_SHARE_WORK && CL_COMM_CLUSTER == 2)

// All threads of both CTAs of the cluster; memory before it is visible to the other CTA after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Address of shared variable p of CTA `cta` of this cluster, in the cluster's shared window.
__device__ __forceinline__ u32 cluster_shared_addr(const void* p, u32 cta) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(cta));
    return r;
}

// A warp's source of work items: a shared counter (counter != 0: cluster shared address, one
// atomic per item, taken by lane 0) or a fixed stride (first = warp, step = warps of the CTA).
struct WorkItems {
    u32 counter;
    int next, step;
};
__device__ __forceinline__ int take_item(WorkItems& w) {
    if (w.counter == 0) {
        const int v = w.next;
        w.next += w.step;
        return v;
    }
    int v = 0;
    if ((threadIdx.x & 31) == 0)
        asm volatile("atom.shared::cluster.add.u32 %0, [%1], 1;" : "=r"(v) : "r"(w.counter) : "memory");
    return __shfl_sync(FULL_MASK, v, 0);
}

// This CTA's work items for a channel (role 0 sender, 1 receiver), called by every thread of both
// CTAs at the top of each channel. With sharing, the receiver CTA's counter is reset and a cluster
// barrier passed before either CTA takes an item; otherwise each warp strides the items itself.
__device__ __forceinline__ WorkItems channel_work_items(int role) {
    WorkItems work = {0u, (int)(threadIdx.x >> 5), (int)(blockDim.x >> 5)};
#if CL_SHARE
    __shared__ u32 s_work;  // the channel's next item (the receiver CTA's is the one used)
    if (role == 1 && threadIdx.x == 0) s_work = 0;
    work.counter = cluster_shared_addr(&s_work, 1);
    cluster_sync();
#endif
    return work;
}

// CL_COMM_TRACE 1: the data kernels also record %globaltimer points per CTA, after the
// %smid words of the debug buffer (nvlink/engine.py last_trace): [CTA][start, own work done, end].
constexpr bool kCommTrace = CL_COMM_TRACE;
constexpr int kTraceOffsetWords = CL_TRACE_OFFSET_WORDS;  // u32 words of %smid before the trace
constexpr int kTracePoints = CL_TRACE_POINTS;
__device__ __forceinline__ void trace_point(u32* smids, int point) {
    if (kCommTrace && smids != nullptr && threadIdx.x == 0)
        reinterpret_cast<u64*>(smids + kTraceOffsetWords)[blockIdx.x * kTracePoints + point] = global_timer_ns();
}

// Channel c owns tokens [c * per, min((c + 1) * per, T)) with per = ceil(T / C) (layout.channel_starts).
__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int c, int* start, int* end) {
    const int per = (num_tokens + num_channels - 1) / num_channels;
    const int s = min(c * per, num_tokens);
    *start = s;
    *end = min(s + per, num_tokens);
}

__device__ __forceinline__ u64* flag_at(u64 base, u64 offset, int index) {
    return reinterpret_cast<u64*>(base + offset) + index;
}

// ------------------------------------------------------------------------------------------------
// Rings (dispatch and combine): staging is [source rank][channel][slot], a ring of `cap` slots per
// (source, channel) in a fixed byte range: part_bytes per source (num_nvl_bytes / ranks), ring_bytes
// per channel (part_bytes / channels), so the bytes of a (source, channel) ring depend on the
// channel count only; dispatch and combine share them. Row i of a (source, channel) goes to slot
// i % cap. The sender publishes its tail (rows written), the receiver its head (rows consumed,
// DISPATCH_HEAD / COMBINE_HEAD [dst][channel] in the sender's buffer, (seq << 32) | count); a sender
// writes row i only once head >= i - cap + 1. A ring "wraps" in a call when more than cap rows go
// through it: both ends know the count, so both take the ring path for that channel.
// ------------------------------------------------------------------------------------------------
struct Ring {
    u64 region_offset, part_bytes, ring_bytes;
    int cap, slot_bytes;
};
__device__ __forceinline__ u64 ring_slot(const Ring& g, u64 base, int src, int c, int i) {
    return base + g.region_offset + (u64)src * g.part_bytes + (u64)c * g.ring_bytes + (u64)(i % g.cap) * (u64)g.slot_bytes;
}

// Before a warp writes row i (lane r: row of destination r, `want` lanes only) into rank r's ring:
// wait until r's receiver has consumed row i - cap. head_seen caches lane r's last head (count).
__device__ __forceinline__ void ring_wait_room(const Ring& g, const u64* heads_lane, int row, bool want,
                                               u64 seq, u32& head_seen, int peer, WaitSite site, u64 timeout_ns) {
    const u32 need = row >= g.cap ? (u32)(row - g.cap + 1) : 0u;
    const bool act = want && need > head_seen;
    if (__any_sync(FULL_MASK, act)) {
        const u64 v = warp_wait_geq(heads_lane, tail_word(seq, need), act, peer, site, timeout_ns);
        if (act) head_seen = (u32)v;
    }
}

// A sender's first write of a call into rank `lane`'s ring of channel c: that rank's receivers of
// the previous call of the other kind on this channel must be done with those bytes too (the kinds
// share the rings; the same kind's previous call is waited for by the caller). other_seq: this rank's
// sender count of the other kind on channel c (what the peer's receiver releases when done).
__device__ __forceinline__ void ring_wait_other_kind(u64 own, u64 other_done_offset, int c, u64 other_seq, bool active,
                                                     int peer, WaitSite site, u64 timeout_ns) {
    warp_wait_geq(flag_at(own, other_done_offset, (active ? peer : 0) * CL_MAX_CHANNELS + c), other_seq,
                  active && other_seq > 0, peer, site, timeout_ns);
}

// The per-CTA sequence number of this call for (kind, role, channel): the counters live in local
// device memory, so CUDA-graph replays advance them too, and every rank runs the same calls.
__device__ __forceinline__ u64 read_seq(const u64* seq_counters, int kind, int role, int channel) {
    return seq_counters[CL_SEQ_INDEX(kind, role, channel)] + 1;
}

// ------------------------------------------------------------------------------------------------
// Row bookkeeping shared by dispatch (receiver) and combine (sender)
// ------------------------------------------------------------------------------------------------

// rank_prefix_matrix[s - 1][r]: rows rank r receives from ranks before s.
__device__ __forceinline__ int rows_before(const int* rpm, int num_ranks, int s, int r) {
    return s > 0 ? rpm[(s - 1) * num_ranks + r] : 0;
}

// Channel c's share of the rows rank `me` received from each remote rank, remote ranks taken in
// the order me+1, me+2, ... (so ranks do not all start on the same peer). For the j-th of them:
// out_rank[j] = the rank, out_base[j] = its first row in me's recv_x, out_off[j] = where its rows
// start in the channel's work list; out_off[R - 1] = the list's length.
__device__ __forceinline__ void channel_remote_rows(const int* rpm, const int* recv_channel_prefix, int R, int C,
                                                    int me, int c, int* out_rank, int* out_off, int* out_base) {
    int off = 0;
    for (int j = 0; j < R - 1; ++j) {
        const int s = (me + 1 + j) % R;
        const int before = rows_before(rpm, R, s, me);
        const int total_s = rpm[s * R + me] - before;
        const int lo = recv_channel_prefix[s * C + c];
        const int hi = c + 1 < C ? recv_channel_prefix[s * C + c + 1] : total_s;
        out_rank[j] = s;
        out_off[j] = off;
        out_base[j] = before + lo;
        off += hi - lo;
    }
    out_off[R - 1] = off;
}

// ------------------------------------------------------------------------------------------------
// The node barrier in pieces (the internode forwarder: csrc/fanout.cu, and internode.cu's combine rows)
//
// Every local rank p of a node owns a signal area at peer_bases[p] + signal_offset (mapped by every
// process of the node): arrival u64 [CL_MAX_RANKS] (barriers local rank q entered, added by q), then
// its ticket u64 (barriers it entered, << 32) and its done count u64 (CTAs of the running kernel past
// their work). A kernel that takes part in barriers gets `sync` flags:
//   NODE_SYNC_ENTER       a whole barrier at its start: the first CTA to start arrives (the kernels
//                         before it on the stream are complete), every CTA waits for every local
//                         rank's arrival (waiting CTAs hold their SMs: such kernels keep their grids
//                         small, and no CTA waits on one that may not have started)
//   NODE_SYNC_ARRIVE_END  arrive at its end, once every CTA's stores are visible system-wide (the
//                         last CTA to finish arrives)
//   NODE_SYNC_WAIT_END    with ARRIVE_END: that CTA then waits (a whole barrier at the end)
//   NODE_SYNC_WAIT_START  every CTA waits at its start for the barrier this rank arrived at last
//                         (the other half of an earlier kernel's ARRIVE_END or ARRIVE_START)
//   NODE_SYNC_ARRIVE_START  the first CTA to start arrives, nobody waits: ENTER's first half, whose
//                         other half is a later kernel's WAIT_START (every kernel that waits for it
//                         runs after this one on its stream, or on a stream forked after it)
// The barriers a kernel enters (ENTER, ARRIVE_START, ARRIVE_END) are numbered from its ticket: every CTA adds to
// it once at its start, CTA 0 n << 32 - (grid - 1) (n barriers), the others 1, so it grows by n << 32
// and each CTA decodes the number before this kernel's from what it read, in any order (CTA 0 reads
// a small low half; another reads one >= 2^31 only after CTA 0's add, high half then + n - 1); the
// one CTA that reads a low half of 0 added first (it runs: it arrives for ENTER). A rank
// is at most one barrier ahead of a peer (it needs everyone's arrival to leave one; an ARRIVE_END is
// followed by a wait before the next arrival), so waiting for ">= barrier number" never confuses two.
// Nothing host-side changes between calls: graph replays advance the tickets like eager calls.
// ------------------------------------------------------------------------------------------------
#define NODE_SYNC_ENTER 1
#define NODE_SYNC_ARRIVE_END 2
#define NODE_SYNC_WAIT_END 4
#define NODE_SYNC_WAIT_START 8
#define NODE_SYNC_ARRIVE_START 16
#define NODE_SYNC_TICKET CL_MAX_RANKS      // u64 index of the ticket after the arrival array
#define NODE_SYNC_DONE (CL_MAX_RANKS + 1)  // u64 index of the done count

struct NodeSync {
    const u64* peer_bases;  // peer_bases[p]: local rank p's buffer in this process (nullptr: no sync)
    int local_rank, P;
    u64 signal_offset, timeout_ns;
    int flags;
    __device__ __forceinline__ u64* signal(int p) const {
        return reinterpret_cast<u64*>(peer_bases[p] + signal_offset);
    }
    __device__ __forceinline__ int entered() const {
        return ((flags & (NODE_SYNC_ENTER | NODE_SYNC_ARRIVE_START)) ? 1 : 0) + ((flags & NODE_SYNC_ARRIVE_END) ? 1 : 0);
    }
};

__device__ __forceinline__ void node_red_add_release_sys(u64* p, u64 v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// One warp: lane q < P adds this rank's arrival at local rank q (after a system-wide fence, so every
// write this thread saw or made, and through the CTA barrier before it the CTA's, comes first).
__device__ __forceinline__ void node_arrive(const NodeSync& s) {
    asm volatile("fence.sc.sys;" ::: "memory");
    const int lane = lane_id();
    if (lane < s.P) node_red_add_release_sys(s.signal(lane) + s.local_rank, 1ull);
}

// One warp: until every own arrival[q] >= barrier (acquire, system scope); traps after the timeout.
__device__ __forceinline__ void node_wait(const NodeSync& s, u64 barrier) {
    const int lane = lane_id();
    const u64* own = s.signal(s.local_rank);
    warp_wait_until<false>(own + lane, barrier, ~0ull, lane < s.P, lane, WaitSite{"fanout", "node barrier",
                           s.local_rank, -1, false}, s.timeout_ns);
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// At a kernel's start, every thread of every CTA (before any early exit). *s_base (shared memory):
// the barriers this rank entered before this kernel; node_sync_end reads it.
__device__ __forceinline__ void node_sync_begin(const NodeSync& s, u64* s_base) {
    if (s.flags == 0) return;
    const int n = s.entered();
    __shared__ int s_first;
    if (threadIdx.x == 0) {
        u64* ticket = s.signal(s.local_rank) + NODE_SYNC_TICKET;
        u64 base;
        int first = 0;
        if (n) {
            const u64 add = blockIdx.x == 0 ? ((u64)n << 32) - (u64)(gridDim.x - 1) : 1ull;
            const u64 old = atomicAdd(reinterpret_cast<unsigned long long*>(ticket), (unsigned long long)add);
            base = (old >> 32) - ((blockIdx.x != 0 && (old & 0xffffffffull) >= 0x80000000ull) ? (u64)(n - 1) : 0ull);
            first = (old & 0xffffffffull) == 0;
        } else {
            base = ld_volatile(ticket) >> 32;   // (no kernel of this rank's stream adds to it meanwhile)
        }
        *s_base = base;
        s_first = first;
    }
    __syncthreads();
    if ((s.flags & (NODE_SYNC_ENTER | NODE_SYNC_ARRIVE_START)) && s_first && threadIdx.x < 32) node_arrive(s);
    __syncthreads();
    if (s.flags & (NODE_SYNC_ENTER | NODE_SYNC_WAIT_START)) {
        if (threadIdx.x < 32) node_wait(s, *s_base + ((s.flags & NODE_SYNC_ENTER) ? 1 : 0));
        __syncthreads();
    }
}

// At a kernel's end, every thread of every CTA (no early exit before it). *s_last: shared scratch.
__device__ __forceinline__ void node_sync_end(const NodeSync& s, const u64* s_base, int* s_last) {
    if (!(s.flags & NODE_SYNC_ARRIVE_END)) return;
    __threadfence_system();   // this thread's stores (into peers, or rows peers read) system-wide
    __syncthreads();
    if (threadIdx.x == 0) {
        u64* done = s.signal(s.local_rank) + NODE_SYNC_DONE;
        const u64 before = atomicAdd(reinterpret_cast<unsigned long long*>(done), 1ull);
        *s_last = before == (u64)(gridDim.x - 1);
        if (*s_last) st_volatile(done, 0ull);   // every CTA has added: the next kernel starts from 0
    }
    __syncthreads();
    if (!*s_last || threadIdx.x >= 32) return;
    node_arrive(s);
    if (s.flags & NODE_SYNC_WAIT_END) node_wait(s, *s_base + (u64)s.entered());
}
