// common.cuh: the device helpers every commlib kernel shares (PTX wrappers, waits, bf16 math).
//
// Compiled by NVRTC through CuPy (commlib/kernels.py), which pastes this file in front of each
// kernel family, so it uses no host headers: only builtin types (int4, ...) and inline PTX.
// kernels.py also defines the buffer-layout constants (COMMLIB_OFF_*) with -D; the defaults below
// only let `nvcc -c csrc/X.cu` check a file on its own.
//
// COMMLIB_PLAIN=1 swaps the cache-hinted 16-byte loads/stores for plain C++ ones, so a benchmark
// can show what the hints buy (COMMLIB_PLAIN_LDST=1 at run time picks that build).
#pragma once

#if !defined(__CUDACC_RTC__)
#include <cstdio>  // nvcc checks only; NVRTC has device printf built in
#endif

typedef unsigned long long u64;
typedef unsigned int u32;
typedef long long i64;

#ifndef COMMLIB_PLAIN
#define COMMLIB_PLAIN 0
#endif

// Limits shared with commlib/kernels.py (it passes the same numbers with -D).
#ifndef COMMLIB_MAX_RANKS
#define COMMLIB_MAX_RANKS 8          // NVLink peers of one node; rank masks fit one byte
#endif
#ifndef COMMLIB_MAX_CHANNELS
#define COMMLIB_MAX_CHANNELS 128     // num_sms <= 256
#endif
// Control region (the first CONTROL_BYTES of every rank's buffer), byte offsets.
#ifndef COMMLIB_OFF_DISPATCH_TAIL
#define COMMLIB_OFF_DISPATCH_TAIL 0          // u64 [src rank][channel]: sender progress, written by src
#define COMMLIB_OFF_DISPATCH_DONE 8192       // u64 [dst rank][channel]: "consumed up to seq", written by dst
#define COMMLIB_OFF_COMBINE_TAIL 16384       // u64 [src rank][channel]
#define COMMLIB_OFF_COMBINE_DONE 24576       // u64 [dst rank][channel]
#define COMMLIB_OFF_NOTIFY_FLAG 32768        // u64 [parity][src rank]
#define COMMLIB_OFF_NOTIFY_DATA 53248        // int [parity][src rank][slot_words]
#endif
#ifndef COMMLIB_OFF_DISPATCH_SIG
#define COMMLIB_OFF_DISPATCH_SIG 36864       // u64 [src rank][channel]: src sender's call_signature, written by src
#define COMMLIB_OFF_COMBINE_SIG 45056        // u64 [src rank][channel]
#endif
// Notify slot words (int32 offsets inside one source's slot).
#define COMMLIB_NW_NTPR 0                    // [R] the source's num_tokens_per_rank
#define COMMLIB_NW_BAD 8                     // bad top-k ids the source saw
#define COMMLIB_NW_SIG 9                     // [NW_SIG_WORDS] the source's call signature (notify.cu)
#define COMMLIB_NW_SIG_WORDS 7
#define COMMLIB_NW_CPM 16                    // [C] the source's channel prefix towards this rank
#define COMMLIB_NW_EXPERT (16 + COMMLIB_MAX_CHANNELS)  // [L] the source's tokens per local expert

// Sequence counters (kernels.py sizes the array): u64 [kind][role][channel].
// COMMLIB_COMM_CLUSTER 2: the data kernels launch as thread-block clusters of two CTAs (a channel's
// sender and receiver), so a comm kernel takes SMs in pairs from one GPC. torch's persistent grouped
// GEMM (CUTLASS, 2x1 clusters) sizes its grid for all SMs but the carveout; comm CTAs scattered one
// per GPC leave odd free SMs behind, fewer cluster slots than that grid, and the GEMM's last clusters
// wait for a whole first wave (benchmarks/bench_gemm_carveout.py --neighbour measures it).
#ifndef COMMLIB_COMM_CLUSTER
#define COMMLIB_COMM_CLUSTER 2
#endif
#if COMMLIB_COMM_CLUSTER > 1
#define COMMLIB_CLUSTER_DIMS __cluster_dims__(COMMLIB_COMM_CLUSTER, 1, 1)
#else
#define COMMLIB_CLUSTER_DIMS
#endif

#define COMMLIB_SEQ_DISPATCH 0
#define COMMLIB_SEQ_COMBINE 1
#define COMMLIB_SEQ_NOTIFY 2
#define COMMLIB_SEQ_INDEX(kind, role, channel) (((kind) * 2 + (role)) * COMMLIB_MAX_CHANNELS + (channel))

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

// COMMLIB_COMM_L2_EVICT_FIRST 1 (kernel variant, off): the bulk loads and stores below carry an L2
// evict-first policy, so rows streamed once leave L2 before the lines of the compute beside them.
#ifndef COMMLIB_COMM_L2_EVICT_FIRST
#define COMMLIB_COMM_L2_EVICT_FIRST 0
#endif

__device__ __forceinline__ u64 l2_evict_first() {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));  // not volatile: may be hoisted
    return policy;
}

// Load of data nobody writes during this kernel, or written before an acquire we already did:
//   .nc                read-only (texture) path: does not compete with the coherent L1 traffic
//   .L1::no_allocate   the row is used once; keeping it in L1 only evicts things we reuse
//   .L2::256B          prefetch the whole 256-byte sector group: rows are read front to back
// asm volatile keeps it after the acquire loads that guard it (the compiler must not hoist it).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
#if COMMLIB_PLAIN
    return *p;  // ld.global: may allocate in L1, no prefetch hint
#elif COMMLIB_COMM_L2_EVICT_FIRST
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(l2_evict_first()));
    return v;
#else
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#endif
}

// Store of a row nobody on this SM reads again: .L1::no_allocate skips L1. To a peer pointer this
// is a posted NVLink write; ordering against the progress word comes from the release store.
__device__ __forceinline__ void st_na_v4(int4* p, int4 v) {
#if COMMLIB_PLAIN
    *p = v;     // st.global: default (write-back) policy
#elif COMMLIB_COMM_L2_EVICT_FIRST
    asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.s32 [%0], {%1, %2, %3, %4}, %5;"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(l2_evict_first()) : "memory");
#else
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#endif
}

// ------------------------------------------------------------------------------------------------
// Bulk row copies (TMA, cp.async.bulk): one lane of a warp moves a row global -> shared -> global in
// COMMLIB_BULK_CHUNK-byte pieces, two pieces in flight per warp, so a 32-warp CTA keeps ~190 KB of a
// local copy in flight instead of the ~64 KB its registers hold. The hope was a comm SM whose rate
// depends less on the memory latency that memory-bound compute beside it drives up. Measured on
// 2 x H200 (docs/pipeline.md): exact, but 6% slower alone and more sensitive to L2 / HBM traffic
// (benchmarks/bench_comm_interference.py), so COMMLIB_DISPATCH_BULK stays 0.
// ------------------------------------------------------------------------------------------------
#ifndef COMMLIB_BULK_CHUNK
#define COMMLIB_BULK_CHUNK 3072
#endif
#define COMMLIB_BULK_BAR_BYTES 1024  // 32 warps x 2 mbarriers x 8 bytes, then the pieces
#define COMMLIB_BULK_SMEM (COMMLIB_BULK_BAR_BYTES + 32 * 2 * COMMLIB_BULK_CHUNK)

struct BulkPipe {
    u32 bars;    // shared address of this warp's two mbarriers
    u32 data;    // shared address of this warp's two pieces
    u32 phase;   // bit s: parity of mbarrier s's next completion
};

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

// The kernel's dynamic shared memory (kernels.dynamic_smem bytes): the bulk pipes or the async rings.
__device__ __forceinline__ unsigned char* dynamic_smem_base() {
    extern __shared__ __align__(128) unsigned char commlib_dynamic_smem[];
    return commlib_dynamic_smem;
}

// Every warp of the CTA calls it once, before any bulk copy (dyn: the kernel's dynamic shared memory).
__device__ __forceinline__ BulkPipe bulk_pipe_init(unsigned char* dyn) {
    const int warp = threadIdx.x >> 5;
    BulkPipe bp;
    bp.bars = smem_addr(dyn) + warp * 16;
    bp.data = smem_addr(dyn) + COMMLIB_BULK_BAR_BYTES + warp * 2 * COMMLIB_BULK_CHUNK;
    bp.phase = 0;
    if ((threadIdx.x & 31) == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bp.bars) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bp.bars + 8) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    return bp;
}

__device__ __forceinline__ void bulk_load_piece(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void bulk_wait_piece(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// The warp's pieces may be rewritten once every bulk store issued so far has read them.
__device__ __forceinline__ void bulk_wait_reads() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Every bulk store issued so far is done (before the kernel ends or a flag publishes them).
__device__ __forceinline__ void bulk_wait_writes() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Orders this thread's generic-proxy accesses (an acquire of the data's flag) before its bulk copies.
__device__ __forceinline__ void bulk_fence_after_acquire() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
// Every bulk store this thread issued is done, and ordered before its later generic-proxy accesses
// (and, through a CTA barrier, a release that publishes them to other GPUs).
__device__ __forceinline__ void bulk_publish_writes() {
    bulk_wait_writes();
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// dst[0, n) = src[0, n) (int4 units, 16-byte aligned rows), called by the whole warp; lane 0 drives it.
__device__ __forceinline__ void bulk_copy_row(int4* dst, const int4* src, int n, BulkPipe& bp) {
    if ((threadIdx.x & 31) == 0) {
        const u32 total = (u32)n * 16u;
        const u32 pieces = (total + COMMLIB_BULK_CHUNK - 1) / COMMLIB_BULK_CHUNK;
        const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
        unsigned char* d = reinterpret_cast<unsigned char*>(dst);
        bulk_wait_reads();  // the previous row's stores are done with both pieces
        for (u32 k = 0; k < 2 && k < pieces; ++k)
            bulk_load_piece(bp.data + k * COMMLIB_BULK_CHUNK, s + k * COMMLIB_BULK_CHUNK,
                            min((u32)COMMLIB_BULK_CHUNK, total - k * COMMLIB_BULK_CHUNK), bp.bars + k * 8);
        for (u32 k = 0; k < pieces; ++k) {
            const u32 b = k & 1u, off = k * COMMLIB_BULK_CHUNK, bytes = min((u32)COMMLIB_BULK_CHUNK, total - off);
            bulk_wait_piece(bp.bars + b * 8, (bp.phase >> b) & 1u);
            bp.phase ^= 1u << b;
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"(d + off), "r"(bp.data + b * COMMLIB_BULK_CHUNK), "r"(bytes) : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            if (k + 2 < pieces) {
                bulk_wait_reads();  // piece b is free again
                const u32 noff = (k + 2) * COMMLIB_BULK_CHUNK;
                bulk_load_piece(bp.data + b * COMMLIB_BULK_CHUNK, s + noff,
                                min((u32)COMMLIB_BULK_CHUNK, total - noff), bp.bars + b * 8);
            }
        }
    }
    __syncwarp();
}

// ------------------------------------------------------------------------------------------------
// Deep row streams (COMMLIB_DISPATCH_ASYNC_DEPTH / COMMLIB_COMBINE_ASYNC_DEPTH = D > 0): cp.async
// (LDGSTS, 16 bytes per lane) fills a ring of D vectors per lane in dynamic shared memory, so a lane
// keeps D loads in flight without holding them in registers (the register-staged copies above keep
// UNROLL = 4: 64 KB per 1024-thread CTA; D = 12 keeps 192 KB). At a few comm SMs the copies are
// latency-bound, and latency is what memory-bound compute beside the comm kernels drives up.
// cp.async is a generic-proxy access of this thread: a lane's acquire of a progress word orders its
// later cp.async reads of the rows, as it does for ld. Each lane reads back only its own ring slots,
// so no warp barrier is needed. Ring: [warp][slot D][lane] int4, slot-major so a warp's 32 lanes
// hit 32 consecutive 16-byte words.
// ------------------------------------------------------------------------------------------------
#define COMMLIB_ASYNC_SLOT_BYTES 512  // one int4 per lane

template <int D>
__device__ __forceinline__ u32 async_ring() {  // this warp's ring (the kernel's dynamic shared memory)
    return smem_addr(dynamic_smem_base()) + (threadIdx.x >> 5) * (D * COMMLIB_ASYNC_SLOT_BYTES);
}
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ int4 ld_shared_v4(u32 addr) {
    int4 v;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// Lane-strided stream over `count` vectors: vector q of this lane comes from src(q) through the ring
// and goes to use(q, value), in order; src is called once per q, in rising order. Whole warp or
// single lanes alike (no warp-level sync).
template <int D, typename Src, typename Use>
__device__ __forceinline__ void async_stream(int count, Src src, Use use) {
    const u32 ring = async_ring<D>() + (threadIdx.x & 31) * 16;
#pragma unroll
    for (int q = 0; q < D; ++q) {  // one group per vector, empty ones too
        if (q < count) cp_async_16(ring + q * COMMLIB_ASYNC_SLOT_BYTES, src(q));
        cp_async_commit();
    }
    int slot = 0;
    for (int q = 0; q < count; ++q) {
        // every group but the newest D - 1 is complete: vector q has landed
        asm volatile("cp.async.wait_group %0;" :: "n"(D - 1) : "memory");
        const u32 at = ring + slot * COMMLIB_ASYNC_SLOT_BYTES;
        use(q, ld_shared_v4(at));  // use() consumes the value before the slot is refilled below
        if (q + D < count) cp_async_16(at, src(q + D));
        cp_async_commit();
        slot = slot + 1 == D ? 0 : slot + 1;
    }
}

// This lane's vectors i = lane, lane + 32, ... of an n-vector row.
__device__ __forceinline__ int lane_vectors(int n) {
    const int lane = threadIdx.x & 31;
    return n > lane ? (n - lane + 31) / 32 : 0;
}

// dst[0, n) = src[0, n) (int4 units), whole warp.
template <int D>
__device__ __forceinline__ void async_copy_row(int4* dst, const int4* src, int n) {
    const int lane = threadIdx.x & 31;
    async_stream<D>(lane_vectors(n), [&](int q) { return src + lane + 32 * q; },
                    [&](int q, int4 v) { st_na_v4(dst + lane + 32 * q, v); });
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
#ifndef COMMLIB_WAIT_BACKOFF_NS
#define COMMLIB_WAIT_BACKOFF_NS 0  // the flag waits of ce_sync and notify (kernel variant WAIT_BACKOFF_NS)
#endif
// backoff_ns > 0: the warp sleeps about that long (__nanosleep) between polls. For waits in kernels
// that have nothing else to do (the copy-engine path's ce_sync, the count exchange): a spinning warp
// takes issue slots from whatever CTA shares its SM, a GEMM's beside the dual pipeline's comm stream
// (benchmarks/probe_power.py: one spinning warp cost a full-GPU GEMM loop 6%).
template <bool kExact>
__device__ __noinline__ u64 warp_wait_until(const u64* p_lane, u64 expected_lane, u64 mask, bool active, int peer,
                                            WaitSite site, u64 timeout_ns, u32 backoff_ns = 0) {
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
        if (backoff_ns) __nanosleep(backoff_ns);
    }
}
__device__ __forceinline__ u64 warp_wait_geq(const u64* p_lane, u64 expected_lane, bool active, int peer,
                                             WaitSite site, u64 timeout_ns, u32 backoff_ns = 0) {
    return warp_wait_until<false>(p_lane, expected_lane, ~0ull, active, peer, site, timeout_ns, backoff_ns);
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
#define COMMLIB_SIG_DISPATCH 1u
#define COMMLIB_SIG_COMBINE 2u
__device__ __forceinline__ u64 call_signature(u32 kind, u64 seq, int hidden_int4, int num_scales, int num_topk,
                                              int num_channels) {
    return (seq & 0xffffull) | ((u64)(kind & 7u) << 16) | ((u64)((u32)num_channels & 0xffu) << 19) |
           ((u64)((u32)num_topk & 0x3fu) << 27) | ((u64)((u32)num_scales & 0x3ffu) << 33) |
           ((u64)((u32)hidden_int4 & 0x1fffffu) << 43);
}

__device__ __forceinline__ u64* signature_at(u64 base, u64 region_offset, int src, int channel) {
    return reinterpret_cast<u64*>(base + region_offset) + (src * COMMLIB_MAX_CHANNELS + channel);
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

// ------------------------------------------------------------------------------------------------
// Work shared by a channel's two CTAs (COMMLIB_SHARE_WORK, needs COMMLIB_COMM_CLUSTER 2)
// ------------------------------------------------------------------------------------------------
// A receiver moves about twice the bytes of its sender: it copies the local half as well as the
// received rows (dispatch), or reads every contributing row of a token (combine), while its sender
// only reads the rows it pushes. With sharing, the receiver's rows are items taken from a counter in
// the receiver CTA's shared memory, and the sender CTA, once its last round is published, takes
// items from the same counter through the cluster's shared-memory window. Each item is done by
// exactly one warp with the receiver's code, so results do not depend on who did it. A cluster
// barrier after the items (release / acquire) orders both CTAs' reads of the staging slots before
// the receiver hands them back to the senders.
#ifndef COMMLIB_SHARE_WORK
#define COMMLIB_SHARE_WORK 0
#endif
#define COMMLIB_SHARE (COMMLIB_SHARE_WORK && COMMLIB_COMM_CLUSTER == 2)

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
#if COMMLIB_SHARE
    __shared__ u32 s_work;  // the channel's next item (the receiver CTA's is the one used)
    if (role == 1 && threadIdx.x == 0) s_work = 0;
    work.counter = cluster_shared_addr(&s_work, 1);
    cluster_sync();
#endif
    return work;
}

// COMMLIB_COMM_TRACE 1: the data kernels also record %globaltimer points per CTA, after the
// %smid words of the debug buffer (nvlink.py last_trace): [CTA][start, own work done, end].
#ifndef COMMLIB_COMM_TRACE
#define COMMLIB_COMM_TRACE 0
#endif
#ifndef COMMLIB_TRACE_OFFSET_WORDS      // kernels.py passes both
#define COMMLIB_TRACE_OFFSET_WORDS 256  // u32 words of %smid before the trace
#define COMMLIB_TRACE_POINTS 3
#endif
__device__ __forceinline__ void trace_point(u32* smids, int point) {
#if COMMLIB_COMM_TRACE
    if (smids != nullptr && threadIdx.x == 0)
        reinterpret_cast<u64*>(smids + COMMLIB_TRACE_OFFSET_WORDS)[blockIdx.x * COMMLIB_TRACE_POINTS + point] =
            global_timer_ns();
#endif
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

// The per-CTA sequence number of this call for (kind, role, channel): the counters live in local
// device memory, so CUDA-graph replays advance them too, and every rank runs the same calls.
__device__ __forceinline__ u64 read_seq(const u64* seq_counters, int kind, int role, int channel) {
    return seq_counters[COMMLIB_SEQ_INDEX(kind, role, channel)] + 1;
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
