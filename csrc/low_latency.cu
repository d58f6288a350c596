// low_latency.cu: decode-mode dispatch / combine (DeepEP v1's low-latency API) inside one node.
//
// Semantics: commlib/backends/low_latency/reference.py (LowLatencyReference); this file reproduces them bit for bit.
// Legend: T tokens of this rank, K top-k, E experts, R ranks, L = E / R local experts, H hidden,
// M = num_max_dispatch_tokens_per_rank. Expert g lives on rank g / L as local expert g % L.
//
// Each call has a sequence number per (kind, phase): state[] (local device memory, one array per
// Buffer) counts the finished ones (in shares: see cta_share), so calls and CUDA-graph replays
// advance it alike and every rank numbers its calls the same way. No launch takes a grid-wide
// ticket: every CTA finishes on its own. Call `seq` uses buffer half seq & 1; words carry seq, so
// nothing is ever reset.
//
// Buffer regions (byte offsets from a rank's low-latency IPC buffer; commlib/backends/low_latency/nvlink.py
// computes them and passes them in):
//   COUNT [half][local expert e][src s] u64 in rank d: (seq << 32) | rows, release-stored by src's
//       CTA 0 at the start of the call (the rows follow from the routing); acquire-polled by d's
//       dispatch receiver (the CTA that owns expert e).
//   ARRIVAL [half][e][s] u64 in rank d: (token, slot) units of (e, s) landed so far, over every call
//       on this half (never reset): src's sender adds one per unit with a reduction after that unit's
//       rows, meta words and one system fence. d's receiver waits until it reaches the total of
//       the previous call on this half (kept in d's state[], LL_CUM_BASE) + this call's COUNT.
//   DISPATCH_DONE [d] u64 in rank src: d's dispatch receive phases completed, in 2^-32 steps: each
//       CTA of d's receiver adds its share (cta_share) once it has read every staging row it took
//       (a whole launch adds 2^32). src's sender waits for (seq - 2) << 32 before it writes into
//       the same half again (so at most two calls are in flight, never corrupted).
//   DISPATCH half in rank d: token rows [src][M] (slot_bytes each: [row: bf16 2H or E4M3 H bytes]
//       [scales: float per 128 channels, or one UE8M0 byte per 128 channels]), written once per
//       (token, destination rank) by src's sender CTA that owns the token, however many of d's
//       experts the token picked; then meta words [e][src][M] u64: slot p of (e, src) = the p-th
//       (token, slot) pair of src routed to expert e (token order, then top-k slot order) holds
//       ll_meta_tag(seq) | that token's index. d's receiver copies row `meta` of src's token rows into
//       recv_x; the tag lets it read the meta words while it still waits for the rows' arrivals.
//   COMBINE_FLAG [half][g] u64 in rank src: = seq, release-stored by g's rank (the CTA owning local
//       expert g % L) after every row of g for src is written; acquire-polled by src's receiver.
//   COMBINE_DONE [h] u64 in the expert ranks: h's combine receive phases completed, in shares as
//       DISPATCH_DONE; expert ranks wait for (seq - 2) << 32 before writing.
//   COMBINE half [g][M] slots (bf16 2H) in rank src: slot p = expert g's output for src's p-th
//       pair routed to g (the dispatch's pos[t, k]).
//
// Dispatch sender: CTA 0 publishes the COUNT words; unit (token, part) u goes to CTA 1 + u % (grid
// - 1): the row leaves first, once per destination rank (FP8: cast in the kernel, amax per 128
// channels by shuffles), then the pairs' slots are scanned (ballots), the meta words written, one
// system fence, relaxed ARRIVAL reductions. Dispatch receiver: every CTA scans the COUNT words into
// recv_x's row order, takes an equal share of the rows, waits for the arrivals of the segments it
// touches and copies rows, scales and src_info in one pass. Combine: see ll_combine_send / _recv.
//
// phases: LL_SEND | LL_RECV in one launch (no hook), or one phase per launch (return_recv_hook:
// the sender returns at once, the hook launches the receiver; no SM waits in between).
#include "common.cuh"

// The variant's knobs (loader.DEFAULT_VARIANT, passed with -D).
#if !defined(CL_LL_PARTS) || !defined(CL_LL_TRACE) || !defined(CL_LL_FENCE)
#error "low_latency.cu compiles with the -D defines of commlib/cuda/loader.py options()"
#endif
#define LL_UNROLL 4
#define LL_MAX_EXPERTS 2048            // low_latency/nvlink.py MAX_EXPERTS
#define LL_SMEM_PAIRS 4096             // (token, slot) ids kept in shared memory for the slot scan
#define LL_SMEM_WANT 1024              // dispatch receiver: segments whose arrival targets stay in shared memory
constexpr int kLlThreads = 512;  // commlib/backends/low_latency/nvlink.py THREADS launches this many, 2 CTAs per SM
constexpr int kLlMaxParts = CL_LL_PARTS;  // dispatch: CTAs sharing one token row when the grid has CTAs to spare
#define LL_COMBINE_RECV_PARTS 2        // combine: CTAs sharing one token's sum when the grid has CTAs to spare
#define LL_RECV_ROWS 512               // rows whose sources the dispatch receiver keeps in shared memory at once

#define LL_SEND 1
#define LL_RECV 2

// CL_LL_TRACE=1 (loader.set_variant({"LL_TRACE": 1})): CTA thread 0 stores %globaltimer at
// 8 points of each kernel into state[LL_TRACE_BASE + ((kernel * LL_TRACE_CTAS) + cta) * 8 + point]
// (kernel 0 dispatch: start, send ready, first unit's rows stored, its slots scanned, send done
// (after its fence and arrivals), arrivals seen, recv rows done, end; kernel 1 combine: start, send ready, records written, first
// item's record seen, its partial stored, send done (flags released), first token's partials seen,
// end: commlib/backends/low_latency/nvlink.py TRACE_POINTS). python -m benchmarks.bench_low_latency --trace reads them.
#define LL_TRACE_BASE 64
#define LL_TRACE_CTAS 256
constexpr bool kLlTrace = CL_LL_TRACE;
#define LL_MARK(state, kernel, point)                                                                   \
    do {                                                                                                \
        if (kLlTrace && threadIdx.x == 0 && blockIdx.x < LL_TRACE_CTAS) {                               \
            u64 t_;                                                                                     \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                      \
            (state)[LL_TRACE_BASE + ((kernel) * LL_TRACE_CTAS + blockIdx.x) * 8 + (point)] = t_;        \
        }                                                                                               \
    } while (0)
// state[]: completed phases per (kind, phase), in shares (cta_share); the trace; then the arrival
// totals [call seq & 3][local expert * R + source] u64 (low_latency/nvlink.py CUM_BASE)
#define LL_DISPATCH_SEND 0
#define LL_DISPATCH_RECV 1
#define LL_COMBINE_SEND 2
#define LL_COMBINE_RECV 3
#define LL_CUM_BASE (LL_TRACE_BASE + 2 * LL_TRACE_CTAS * 8)

#define LL_FP8_NONE 0                  // bf16 rows
#define LL_FP8_FLOAT 1                 // scale = amax / 448
#define LL_FP8_POW2 2                  // round_scale: rounded up to a power of two
#define LL_FP8_UE8M0 3                 // round_scale + exponents as bytes

struct LLDispatchArgs {
    const int4* x; const i64* topk_idx; int* pos;
    int4* recv_x; unsigned char* recv_scales; int* src_info; i64* layout_range; int* recv_count;
    int num_tokens, hidden, num_topk, num_experts, max_tokens, fp8_mode, pad_zero;
    const u64* peer_bases; int rank, num_ranks;
    u64 off_count, off_done, off_arrival, off_data, half_bytes;
    int words_per_half, slot_bytes, slot_off_scales;
    u64* state; u64 timeout_ns;
    const int* mask;   // shrink mode: [R] int32, nonzero = masked rank (nullptr: none)
};

struct LLCombineArgs {
    const int4* x; const i64* topk_idx; const float* topk_weights; const int* pos; const i64* layout_range;
    int4* out;
    int num_tokens, hidden, num_topk, num_experts, max_tokens;
    const u64* peer_bases; int rank, num_ranks;
    u64 off_done, off_data, half_bytes;
    u64* state; u64 timeout_ns;
    const int* mask;   // as LLDispatchArgs::mask
};

// ------------------------------------------------------------------------------------------------
// Helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void st_na_u64(u64* p, u64 v) {
    if constexpr (kPlain)
        *p = v;
    else
        asm volatile("st.global.L1::no_allocate.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

// exp2(ceil(log2(s))) for a positive normal float, exactly (the reference's round_scale).
__device__ __forceinline__ float pow2_ceil(float s) {
    const u32 b = __float_as_uint(s);
    const u32 e = b & 0x7f800000u;
    return __uint_as_float((b & 0x007fffffu) ? e + 0x00800000u : e);
}

// Four floats -> four E4M3 bytes (round to nearest even; |v| <= 448 here, so satfinite never clips).
__device__ __forceinline__ u32 pack_e4m3x4(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (u32)lo | ((u32)hi << 16);
}

__device__ __forceinline__ float abs_exact(float v) { return __uint_as_float(__float_as_uint(v) & 0x7fffffffu); }

// A dispatch half of rank d: token rows [source][M] (slot_bytes each: row, scales), then the meta
// words [local expert][source][M] u64 (seq-tagged token index of each (expert, source) slot). A token goes
// over NVLink once per destination rank, however many of that rank's experts it picked.
__device__ __forceinline__ u64 dispatch_meta_offset(int R, int M, int slot_bytes) {
    return ((u64)R * M * slot_bytes + 15) & ~(u64)15;
}

// Tags of the self-validating words in the halves. A half's layout follows each call's shapes, so
// before the writer's store the word may hold stale bytes of another layout: readers accept only
// the exact tag (warp_wait_tag), and bit 63 tells a meta word from a record.
#define LL_TAG_MASK 0xffffffff00000000ull
__device__ __forceinline__ u64 ll_meta_tag(u64 seq) { return ((seq & 0x7fffffffull) | 0x80000000ull) << 32; }
__device__ __forceinline__ u64 ll_record_tag(u64 seq) { return (seq & 0x7fffffffull) << 32; }

// A release fence at system scope: with the relaxed reductions after it, the PTX pattern of a
// release reduction. CL_LL_FENCE=1 (default) uses fence.acq_rel.sys; 0 the sequentially
// consistent __threadfence_system (fence.sc.sys), the stronger and older choice.
constexpr bool kLlAcqRelFence = CL_LL_FENCE;
__device__ __forceinline__ void ll_release_fence() {
    if constexpr (kLlAcqRelFence)
        asm volatile("fence.acq_rel.sys;" ::: "memory");
    else
        __threadfence_system();
}

// Relaxed: callers issue one system fence before a batch of these (a release reduction each would
// be a fence each, measured 18 us of sending per token batch instead of 6).
__device__ __forceinline__ void red_add_relaxed_sys(u64* p, u64 v) {
    asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

// Shrink mode (commlib/backends/low_latency/nvlink.py _device_mask): rank r is masked. No word of
// this file goes to or is awaited from a masked rank: its pairs with this rank carry nothing.
__device__ __forceinline__ bool ll_masked(const int* mask, int r) { return mask != nullptr && mask[r] != 0; }

// Each lane of warp 0 with lane < R waits until word[lane] >= expected (no-op when !enabled; masked
// ranks' words are not awaited).
__device__ __forceinline__ void wait_ranks(u64 base, u64 off, int R, u64 expected, bool enabled, WaitSite site,
                                           u64 timeout_ns, const int* mask) {
    const int lane = lane_id();
    const bool active = enabled && lane < R && !ll_masked(mask, lane);
    warp_wait_geq(flag_at(base, off, active ? lane : 0), expected, active, lane, site, timeout_ns);
}

// A phase's completion without a grid-wide ticket: CTA b of a G-CTA launch adds its share, and the
// shares of one launch add up to exactly 2^32 whatever G is, so a counter's high word is the number
// of completed launches and no CTA waits for another. (A ticket made the last CTA to arrive do the
// closing work after all the others, at the tail of every kernel.) A launch starts after the previous
// one on its stream has completed, so a CTA that reads a counter at its start sees the high word of
// the launches before it: its own launch cannot be complete before it has added its share.
__device__ __forceinline__ u64 cta_share() {
    const u64 b = blockIdx.x, G = gridDim.x;
    return ((b + 1) << 32) / G - (b << 32) / G;
}
__device__ __forceinline__ u64 read_state(const u64* state, int i) { return (ld_volatile(state + i) >> 32) + 1; }
__device__ __forceinline__ void cta_phase_done(u64* state, int i) {
    if (threadIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(state + i), cta_share());
}
// A receive phase's CTA has read every slot it took of this half: its share goes to the done word
// each rank's sender polls before reusing the half. What must come first is this CTA's loads of the
// half (a peer's later write must not be what they read): the barrier orders every thread's loads
// before thread 0's fence, which completes them before the reductions issue. A GPU-scope fence does
// that (a system-scope one would also wait for the CTA's outstanding stores system-wide).
// (Masked ranks get no share: their done words fall behind, which is why a rank unmasked again needs
// the resync of nvlink.py NVLinkLowLatency.barrier first.)
__device__ void cta_release_done(const u64* peer_bases, u64 off_done, int rank, int R, const int* mask) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const u64 share = cta_share();
        for (int d = 0; d < R; ++d)
            if (!ll_masked(mask, d)) red_add_relaxed_sys(flag_at(peer_bases[d], off_done, rank), share);
    }
}

// An expert id outside [-1, E) is a caller error the host cannot see without a sync: name it and
// trap (as torch's device-side asserts do); the Buffer turns the launch failure into CommlibError.
__device__ __noinline__ void bad_expert_id_trap(int rank, int t, int k, i64 e, int E) {
    printf("[commlib] rank %d low_latency_dispatch: topk_idx[%d, %d] = %lld is outside [-1, %d)\n", rank, t, k,
           (long long)e, E);
    asm volatile("trap;");
}

// Both kernels' body: the CTA reads its sequence numbers of the send and receive phases (state[]
// words send_word and send_word + 1) before it adds any share (cta_phase_done), then runs the
// phases asked for.
template <typename Args, void (*Send)(const Args&, u64), void (*Recv)(const Args&, u64)>
__device__ __forceinline__ void ll_run_phases(const Args& a, int phases, int kernel, int send_word) {
    __shared__ u64 s_seq[2];
    if (threadIdx.x == 0) {
        s_seq[0] = read_state(a.state, send_word);
        s_seq[1] = read_state(a.state, send_word + 1);
    }
    __syncthreads();
    LL_MARK(a.state, kernel, 0);
    if (phases & LL_SEND) Send(a, s_seq[0]);
    if (phases & LL_RECV) Recv(a, s_seq[1]);
    LL_MARK(a.state, kernel, 7);
}

// ------------------------------------------------------------------------------------------------
// Dispatch
// ------------------------------------------------------------------------------------------------

__device__ void ll_dispatch_send(const LLDispatchArgs& a, u64 seq) {
    __shared__ u64 s_dst[CL_MAX_RANKS];   // this token's row slot in each destination rank (0: none)
    __shared__ int s_pair_rank[32];            // destination rank of each top-k slot (-1: none)
    __shared__ int s_pair_le[32];              // its local expert there
    __shared__ int s_pair_e[32];               // expert of each top-k slot (-1: none)
    __shared__ int s_pair_cnt[32];             // pairs of earlier tokens to that expert
    __shared__ u32 s_need;                     // ranks holding one of this token's experts
    __shared__ int s_hist[LL_MAX_EXPERTS];
    __shared__ int s_ids[LL_SMEM_PAIRS];
    const int warp = warp_id(), lane = lane_id();
    const int R = a.num_ranks, K = a.num_topk, E = a.num_experts, L = E / R, M = a.max_tokens;
    const int half = (int)(seq & 1);
    const u64 own = a.peer_bases[a.rank];
    const u64 data = a.off_data + (u64)half * a.half_bytes;
    const u64 meta_off = dispatch_meta_offset(R, M, a.slot_bytes);
    // Work units (token, part): with CTAs to spare, CTA 0 only publishes the counts and the others
    // split each row into `parts` (FP8: whole 128-channel blocks); every unit adds its own arrival,
    // so the count word tells receivers `parts` too (bits 24-31).
    const int first = (int)gridDim.x > a.num_tokens ? 1 : 0;
    const int senders = (int)gridDim.x - first;
    const int n_blocks = a.hidden / 128;
    const int parts = max(1, min(min(kLlMaxParts, senders / max(a.num_tokens, 1)), max(n_blocks, 1)));
    // Every receiver must be done with this half (call seq - 2) before this CTA stores into it. The
    // last warp waits, without a barrier here: the other warps meanwhile load their first row and its
    // routing, and the barriers before CTA 0's count stores and before each unit's stores order the
    // wait first.
    const bool has_units = blockIdx.x == 0 || (int)blockIdx.x - first < a.num_tokens * parts;
    if (has_units && warp == (int)(blockDim.x >> 5) - 1) {
        const WaitSite site = {"low_latency_dispatch", "ll dispatch done (call seq - 2 consumed)", a.rank, -1, false};
        wait_ranks(own, a.off_done, R, (seq - 2) << 32, seq > 2, site, a.timeout_ns, a.mask);
    }
    // The routing goes to shared memory (ids outside [0, E) as -1) before the slot scan: it reads up
    // to T * K ids per pair, which from global memory is a chain of dependent L2 round trips.
    const int pairs = a.num_tokens * K;
    const bool ids_in_smem = pairs <= LL_SMEM_PAIRS;
    bool ids_loaded = false;
    if (blockIdx.x == 0) {
        // Rows per (expert, this source), clamped to M, are known from the routing alone: publish
        // them now. Readiness is the arrival words below, so receivers start on an expert as soon
        // as its rows are in, not after every CTA of the grid has finished sending.
        for (int g = threadIdx.x; g < E; g += blockDim.x) s_hist[g] = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
            const i64 e = a.topk_idx[j];
            if (e < -1 || e >= E) bad_expert_id_trap(a.rank, j / K, j % K, e, E);
            if (e >= 0) atomicAdd(&s_hist[e], 1);
        }
        __syncthreads();
        for (int g = threadIdx.x; g < E; g += blockDim.x) {
            const int d = g / L, le = g % L;
            if (!ll_masked(a.mask, d))
                st_release_sys(flag_at(a.peer_bases[d], a.off_count, half * a.words_per_half + le * R + a.rank),
                               tail_word(seq, ((u32)parts << 24) | (u32)min(s_hist[g], M)));
        }
    }
    LL_MARK(a.state, 0, 1);

    const int n_vec = a.hidden / 8;  // 16-byte vectors of bf16 input
    for (int u = (int)blockIdx.x - first; u >= 0 && u < a.num_tokens * parts; u += senders) {
        const int t = u % a.num_tokens, q = u / a.num_tokens;   // token t, part q of its row
        const int4* src = a.x + (i64)t * n_vec;
        // this thread's vectors v = v0 + threadIdx.x + i * blockDim.x; the first two are loaded now,
        // so their HBM latency overlaps the routing reads (FP8: parts start on 128-channel blocks)
        const bool fp8 = a.fp8_mode != LL_FP8_NONE;
        const int v0 = fp8 ? q * n_blocks / parts * 16 : (int)((i64)q * n_vec / parts);
        const int v1 = fp8 ? (q + 1) * n_blocks / parts * 16 : (int)((i64)(q + 1) * n_vec / parts);
        int4 pre0 = make_int4(0, 0, 0, 0), pre1 = make_int4(0, 0, 0, 0);
        if (v0 + (int)threadIdx.x < v1) pre0 = ld_nc_v4(src + v0 + threadIdx.x);
        if (v0 + (int)(threadIdx.x + blockDim.x) < v1) pre1 = ld_nc_v4(src + v0 + threadIdx.x + blockDim.x);
        auto row_vec = [&](int it, int v) {
            return it == 0 ? pre0 : it == 1 ? pre1 : (v < v1 ? ld_nc_v4(src + v) : make_int4(0, 0, 0, 0));
        };
        // the token's experts and the ranks holding them: its row goes to those ranks right away (its
        // slot there is (source, token), known without the slot scan, which follows while the row is
        // in flight)
        if (threadIdx.x < (unsigned)K) {
            const i64 g = a.topk_idx[(i64)t * K + threadIdx.x];
            s_pair_e[threadIdx.x] = (g >= 0 && g < E) ? (int)g : -1;
            s_pair_cnt[threadIdx.x] = 0;
        }
        if (threadIdx.x == 0) s_need = 0u;
        __syncthreads();
        if (threadIdx.x < (unsigned)K && s_pair_e[threadIdx.x] >= 0 && !ll_masked(a.mask, s_pair_e[threadIdx.x] / L))
            atomicOr(&s_need, 1u << (s_pair_e[threadIdx.x] / L));
        __syncthreads();
        if (threadIdx.x < (unsigned)R) {
            const int d = (int)threadIdx.x;
            s_dst[d] = (s_need >> d) & 1u ? a.peer_bases[d] + data + ((u64)a.rank * M + t) * (u64)a.slot_bytes : 0;
        }
        __syncthreads();
        if (!fp8) {
            int it = 0;
            for (int v = v0 + (int)threadIdx.x; v < v1; v += blockDim.x, ++it) {
                const int4 val = row_vec(it, v);
                for (int r = 0; r < R; ++r) {
                    const u64 d = s_dst[r];
                    if (d != 0) st_na_v4(reinterpret_cast<int4*>(d) + v, val);
                }
            }
        } else {
            // 16 lanes = one 128-channel block (parts start on blocks, so half-warps are never split)
            int it = 0;
            for (int base = v0 + warp * 32; base < v1; base += blockDim.x, ++it) {
                const int v = base + lane;
                const bool active = v < v1;
                const int4 val = row_vec(it, v);
                float f[8] = {bf16_lo((u32)val.x), bf16_hi((u32)val.x), bf16_lo((u32)val.y), bf16_hi((u32)val.y),
                              bf16_lo((u32)val.z), bf16_hi((u32)val.z), bf16_lo((u32)val.w), bf16_hi((u32)val.w)};
                float amax = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) amax = fmaxf(amax, abs_exact(f[i]));
#pragma unroll
                for (int off = 8; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, off));
                float scale = div_rn(fmaxf(amax, 1e-4f), 448.f);
                if (a.fp8_mode >= LL_FP8_POW2) scale = pow2_ceil(scale);
                const u32 lo = pack_e4m3x4(div_rn(f[0], scale), div_rn(f[1], scale), div_rn(f[2], scale),
                                           div_rn(f[3], scale));
                const u32 hi = pack_e4m3x4(div_rn(f[4], scale), div_rn(f[5], scale), div_rn(f[6], scale),
                                           div_rn(f[7], scale));
                const u64 q = (u64)lo | ((u64)hi << 32);
                if (active) {
                    const int block = v >> 4;
                    for (int r = 0; r < R; ++r) {
                        const u64 d = s_dst[r];
                        if (d == 0) continue;
                        st_na_u64(reinterpret_cast<u64*>(d) + v, q);
                        if ((lane & 15) == 0) {
                            if (a.fp8_mode == LL_FP8_UE8M0)
                                st_volatile(reinterpret_cast<unsigned char*>(d + a.slot_off_scales) + block,
                                            (unsigned char)((__float_as_uint(scale) >> 23) & 0xffu));
                            else
                                st_volatile(reinterpret_cast<float*>(d + a.slot_off_scales) + block, scale);
                        }
                    }
                }
            }
        }
        if (u == (int)blockIdx.x - first) LL_MARK(a.state, 0, 2);
        // pair (t, k)'s slot: how many pairs before it go to the same expert. The earlier tokens' pairs
        // are counted by every warp at once (32 ids per ballot, one ballot per slot k), then the
        // earlier slots of token t itself. The routing goes to shared memory on a CTA's first unit.
        if (ids_in_smem && !ids_loaded) {
            for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
                const i64 e = a.topk_idx[j];
                s_ids[j] = (e >= 0 && e < E) ? (int)e : -1;
            }
            ids_loaded = true;
            __syncthreads();
        }
        for (int base = warp * 32; base < t * K; base += blockDim.x) {
            const int j = base + lane;
            int id = -1;
            if (j < t * K) {
                if (ids_in_smem) {
                    id = s_ids[j];
                } else {
                    const i64 e = a.topk_idx[j];
                    id = (e >= 0 && e < E) ? (int)e : -1;
                }
            }
            for (int k = 0; k < K; ++k) {
                const int e = s_pair_e[k];
                const u32 hits = __ballot_sync(FULL_MASK, e >= 0 && id == e);
                if (lane == 0 && hits) atomicAdd(&s_pair_cnt[k], __popc(hits));
            }
        }
        __syncthreads();
        if (threadIdx.x < (unsigned)K) {
            const int k = (int)threadIdx.x, e = s_pair_e[k];
            int count = s_pair_cnt[k];
            for (int k2 = 0; k2 < k; ++k2) count += s_pair_e[k2] == e;
            // beyond M (repeated ids) or on a masked rank: dropped (pos -1, so the combine skips it too)
            const int p = (e >= 0 && count < M && !ll_masked(a.mask, e / L)) ? count : -1;
            if (q == 0) a.pos[(i64)t * K + k] = p;
            int d = -1;
            if (p >= 0) {  // the pair's meta word (part 0): which token of this source is slot p of (e, rank)
                d = e / L;
                const int le = e % L;
                if (q == 0)
                    st_volatile(reinterpret_cast<u64*>(a.peer_bases[d] + data + meta_off) +
                                    ((u64)(le * R + a.rank) * M + p), ll_meta_tag(seq) | (u32)t);
                s_pair_le[k] = le;
            }
            s_pair_rank[k] = d;
        }
        if (u == (int)blockIdx.x - first) LL_MARK(a.state, 0, 3);
        __syncthreads();  // every thread's stores of this token are issued
        if (threadIdx.x == 0) {
            // one arrival per (token, slot) at its expert's rank; the fence orders the CTA's row and
            // meta stores (ordered before it by the barrier; fences are cumulative) before them
            ll_release_fence();
            for (int k = 0; k < K; ++k) {
                const int d = s_pair_rank[k];
                if (d >= 0)
                    red_add_relaxed_sys(flag_at(a.peer_bases[d], a.off_arrival,
                                                half * a.words_per_half + s_pair_le[k] * R + a.rank), 1);
            }
        }
        __syncthreads();  // s_dst / s_pair_* are rewritten for the next token
    }

    LL_MARK(a.state, 0, 4);
    cta_phase_done(a.state, LL_DISPATCH_SEND);
}

// The receive phase spreads rows, not experts, over the grid: every CTA reads the E count words
// (published at the start of each source's send), scans them into the global row order (local
// expert, then source, then slot: recv_x's order), takes an equal share of the rows, waits for the
// arrival words of the (expert, source) segments its share touches, and copies. At the decode shape
// that is ~4 rows per CTA instead of up to ~16 for the CTA of a popular expert.
__device__ __forceinline__ int segment_of(const int* prefix, int n, int r) {  // last j < n with prefix[j] <= r
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (prefix[mid] <= r) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// In place: s[0..n) counts -> exclusive prefix sums, s[n] = total (every thread of the CTA calls it).
__device__ void cta_exclusive_scan(int* s, int n) {
    __shared__ int s_warp[32];
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const int per = (n + blockDim.x - 1) / blockDim.x;
    const int j0 = threadIdx.x * per, j1 = min(j0 + per, n);
    int local = 0;
    for (int j = j0; j < j1; ++j) local += s[j];
    int incl = local;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, incl, off);
        if (lane >= off) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < num_warps ? s_warp[lane] : 0;
        int wi = w;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(FULL_MASK, wi, off);
            if (lane >= off) wi += y;
        }
        if (lane < num_warps) s_warp[lane] = wi - w;
    }
    __syncthreads();
    int run = s_warp[warp] + incl - local;
    for (int j = j0; j < j1; ++j) {
        const int c = s[j];
        s[j] = run;
        run += c;
    }
    if (threadIdx.x == blockDim.x - 1) s[n] = run;
    __syncthreads();
}

__device__ void ll_dispatch_recv(const LLDispatchArgs& a, u64 seq) {
    __shared__ int s_prefix[LL_MAX_EXPERTS + 1];  // rows before segment j = (local expert, source) = e * R + s
    __shared__ int s_parts[CL_MAX_RANKS];    // units per pair of each source (its count words' bits 24-31)
    __shared__ u64 s_want[LL_SMEM_WANT];          // arrival total segment j reaches in this call (j < LL_SMEM_WANT)
    __shared__ int s_tok[LL_RECV_ROWS];           // token of each row of the current chunk
    __shared__ int s_row[LL_RECV_ROWS];           // its row in recv_x
    __shared__ u32 s_src[LL_RECV_ROWS];           // its staging slot (16-byte units from the half's start)
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const int R = a.num_ranks, E = a.num_experts, L = E / R, M = a.max_tokens, RM = R * M;
    const int half = (int)(seq & 1);
    const u64 own = a.peer_bases[a.rank];
    const u64 data = a.off_data + (u64)half * a.half_bytes;
    const u64 meta_off = dispatch_meta_offset(R, M, a.slot_bytes);
    const bool fp8 = a.fp8_mode != LL_FP8_NONE;
    const int n_out = (fp8 ? a.hidden : 2 * a.hidden) / 16;                  // 16-byte vectors of a row
    const int n_scale_words = !fp8 ? 0 : (a.fp8_mode == LL_FP8_UE8M0 ? a.hidden / 512 : a.hidden / 128);
    u32* recv_scales = reinterpret_cast<u32*>(a.recv_scales);
    const u64* counts = flag_at(own, a.off_count, half * a.words_per_half);
    const u64* arrivals = flag_at(own, a.off_arrival, half * a.words_per_half);
    const u64* arrived_before = a.state + LL_CUM_BASE + (seq & 3) * LL_MAX_EXPERTS;  // totals after call seq - 2

    // every (expert, source) count word of this call (E of them, one per warp lane)
    for (int base = warp * 32; base < E; base += blockDim.x) {
        const int j = base + lane;
        const bool active = j < E;
        const WaitSite site = {"low_latency_dispatch", "ll dispatch count (channel = local expert)", a.rank,
                               active ? j / R : -1, true};
        // the previous total is loaded before the poll, so its latency hides behind it
        const u64 before = active && j < LL_SMEM_WANT ? arrived_before[j] : 0;
        // a masked source sends nothing: no rows, its arrival total stays (never awaited)
        const bool live = active && !ll_masked(a.mask, j % R);
        const u64 v = warp_wait_geq(counts + (live ? j : 0), tail_word(seq, 0), live, active ? j % R : -1, site,
                                    a.timeout_ns);
        if (active) {
            const int rows = live ? (int)min((u32)(v & 0xffffffull), (u32)M) : 0;
            const u64 parts = live ? ((v >> 24) & 0xffull) : 0;
            s_prefix[j] = rows;
            if (j < R) s_parts[j] = (int)parts;
            if (j < LL_SMEM_WANT) s_want[j] = before + (u64)rows * parts;
        }
    }
    __syncthreads();
    cta_exclusive_scan(s_prefix, E);
    const int n_rows = s_prefix[E];
    auto seg_rows = [&](int j) { return s_prefix[j + 1] - s_prefix[j]; };
    auto want = [&](int j) {
        return j < LL_SMEM_WANT ? s_want[j] : arrived_before[j] + (u64)seg_rows(j) * (u64)s_parts[j % R];
    };

    // per local expert: layout_range, recv_count, src_info padding (zeros past recv_count if asked)
    for (int e = blockIdx.x; e < L; e += gridDim.x) {
        const int first = s_prefix[e * R], total = s_prefix[e * R + R] - first;
        if (threadIdx.x < (unsigned)R) {
            const int j = e * R + (int)threadIdx.x;
            a.layout_range[j] = ((i64)(s_prefix[j] - first) << 32) | (i64)seg_rows(j);
        }
        if (threadIdx.x == 0) a.recv_count[e] = total;
        for (int i = total + threadIdx.x; i < RM; i += blockDim.x) a.src_info[(i64)e * RM + i] = -1;
        if (a.pad_zero) {  // rows past recv_count: zeros, as the reference (costly at decode shapes: off by default)
            const int4 zero = make_int4(0, 0, 0, 0);
            for (int i = total + warp; i < RM; i += num_warps) {
                const i64 row = (i64)e * RM + i;
                for (int v = lane; v < n_out; v += 32) a.recv_x[row * n_out + v] = zero;
                for (int w = lane; w < n_scale_words; w += 32) recv_scales[row * n_scale_words + w] = 0u;
            }
        }
    }

    // this CTA's share of the rows; the last warp waits until every segment it touches has fully
    // arrived, while the first warps read the rows' meta words (tagged: they need no arrival); the
    // barrier after those orders both before the copy
    const int r0 = (int)((i64)blockIdx.x * n_rows / gridDim.x), r1 = (int)((i64)(blockIdx.x + 1) * n_rows / gridDim.x);
    if (r0 < r1 && warp == num_warps - 1) {
        const int j_lo = segment_of(s_prefix, E, r0), j_hi = segment_of(s_prefix, E, r1 - 1);
        for (int jb = j_lo; jb <= j_hi; jb += 32) {
            const int j = jb + lane;
            const int cnt = j <= j_hi ? seg_rows(j) : 0;
            const WaitSite site = {"low_latency_dispatch", "ll dispatch rows arrived (channel = local expert)", a.rank,
                                   j / R, true};
            warp_wait_geq(arrivals + (cnt > 0 ? j : 0), cnt > 0 ? want(j) : 0, cnt > 0, j % R, site, a.timeout_ns);
        }
    }
    const int per_row = n_out + n_scale_words + 1;   // a row's items: data vectors, scale words, src_info
    const u64* meta = reinterpret_cast<const u64*>(own + data + meta_off);
    for (int c0 = r0; c0 < r1; c0 += LL_RECV_ROWS) {
        const int rows = min(LL_RECV_ROWS, r1 - c0);
        for (int base = warp * 32; base < rows; base += blockDim.x) {
            // slot p of (e, s): its meta word names the source's token, whose row that source wrote
            // once into this rank's token area
            const int i = base + lane;
            const bool active = i < rows;
            const int r = c0 + (active ? i : 0), j = segment_of(s_prefix, E, r);
            const int e = j / R, s = j - e * R, p = r - s_prefix[j];
            const WaitSite site = {"low_latency_dispatch", "ll dispatch meta word (channel = local expert)", a.rank,
                                   e, true};
            const u64* word = meta + ((u64)j * M + p);
            u64 w = active ? ld_acquire_sys(word) : 0;   // present by now in the common case: no call
            if (__any_sync(FULL_MASK, active && (w & LL_TAG_MASK) != ll_meta_tag(seq)))
                w = warp_wait_tag(word, ll_meta_tag(seq), LL_TAG_MASK, active, s, site, a.timeout_ns);
            if (active) {
                const int t = (int)(u32)w;
                if (t >= M) {  // a tag that matched by chance (2^-32): refuse rather than read out of bounds
                    printf("[commlib] rank %d low_latency_dispatch: corrupt meta word %llx (expert %d, source %d)\n",
                           a.rank, (unsigned long long)w, e, s);
                    asm volatile("trap;");
                }
                s_tok[i] = t;
                s_row[i] = e * RM + (r - s_prefix[e * R]);
                s_src[i] = (u32)((((u64)s * M + t) * (u64)a.slot_bytes) >> 4);
            }
        }
        __syncthreads();
        if (c0 == r0) LL_MARK(a.state, 0, 5);
        const int items = rows * per_row;
        for (int base = threadIdx.x; base < items; base += blockDim.x * LL_UNROLL) {
            int4 val[LL_UNROLL];
            int kind[LL_UNROLL];
            i64 at[LL_UNROLL];
#pragma unroll
            for (int u = 0; u < LL_UNROLL; ++u) {
                const int it = base + u * blockDim.x;
                kind[u] = -1;
                if (it >= items) continue;
                const int i = it / per_row, w = it - i * per_row;
                const u64 slot = own + data + ((u64)s_src[i] << 4);
                const i64 row = s_row[i];
                if (w < n_out) {
                    val[u] = __ldcg(reinterpret_cast<const int4*>(slot) + w);
                    kind[u] = 0;
                    at[u] = row * n_out + w;
                } else if (w < n_out + n_scale_words) {
                    val[u].x = (int)__ldcg(reinterpret_cast<const u32*>(slot + a.slot_off_scales) + (w - n_out));
                    kind[u] = 1;
                    at[u] = row * n_scale_words + (w - n_out);
                } else {
                    val[u].x = s_tok[i];
                    kind[u] = 2;
                    at[u] = row;
                }
            }
#pragma unroll
            for (int u = 0; u < LL_UNROLL; ++u) {
                if (kind[u] == 0) st_na_v4(a.recv_x + at[u], val[u]);
                else if (kind[u] == 1) recv_scales[at[u]] = (u32)val[u].x;
                else if (kind[u] == 2) a.src_info[at[u]] = val[u].x;
            }
        }
        __syncthreads();  // s_tok / s_row / s_src are rewritten for the next chunk
    }

    LL_MARK(a.state, 0, 6);
    // the arrival totals call seq + 2 starts from (segments spread over the grid; only launches on
    // this half read them, one at a time)
    u64* arrived_after = a.state + LL_CUM_BASE + ((seq + 2) & 3) * LL_MAX_EXPERTS;
    // every word, not only this call's E: a later call with more experts starts from them too
    for (int j = (int)(blockIdx.x + threadIdx.x * gridDim.x); j < LL_MAX_EXPERTS; j += (int)(gridDim.x * blockDim.x))
        arrived_after[j] = j < E ? want(j) : arrived_before[j];
    cta_release_done(a.peer_bases, a.off_done, a.rank, R, a.mask);
    cta_phase_done(a.state, LL_DISPATCH_RECV);
}

namespace commlib::low_latency {

__global__ void __launch_bounds__(kLlThreads, 2) dispatch(
    const int4* x, const i64* topk_idx, int* pos,
    int4* recv_x, unsigned char* recv_scales, int* src_info, i64* layout_range, int* recv_count,
    int num_tokens, int hidden, int num_topk, int num_experts, int max_tokens, int fp8_mode, int pad_zero,
    int phases, const u64* peer_bases, int rank, int num_ranks,
    u64 off_count, u64 off_done, u64 off_arrival, u64 off_data, u64 half_bytes,
    int words_per_half, int slot_bytes, int slot_off_scales,
    u64* state, u64 timeout_ns, const int* mask) {
    const LLDispatchArgs a = {x, topk_idx, pos, recv_x, recv_scales, src_info, layout_range, recv_count,
                              num_tokens, hidden, num_topk, num_experts, max_tokens, fp8_mode, pad_zero,
                              peer_bases, rank, num_ranks, off_count, off_done, off_arrival, off_data, half_bytes,
                              words_per_half, slot_bytes, slot_off_scales, state, timeout_ns, mask};
    ll_run_phases<LLDispatchArgs, ll_dispatch_send, ll_dispatch_recv>(a, phases, 0, LL_DISPATCH_SEND);
}

// ------------------------------------------------------------------------------------------------
// Combine
// ------------------------------------------------------------------------------------------------

// A combine half of rank s (csrc offsets from the half's start; every rank computes the same):
//   FLAG [d][M] u64: = seq once rank d's partial of s's token t is in s's slot (d, t)
//   RECORD [src][M][2K] u64 in the expert rank: source src's top-k slots of token t, two words each,
//       both tagged with the call: (ll_record_tag(seq) | local expert * M + pos, 0xffffffff when the slot
//       is not on this rank) and (ll_record_tag(seq) | weight bits). Self-validating words need no fence or flag: the
//       reader polls the words themselves.
//   SLOT [d][M] (2H bytes) in rank s: rank d's partial of token t, summed in fp32 and sent as bf16
//       (the issue's BF16 combine; DeepEP's internode combine forwards bf16 partial sums too)
__device__ __forceinline__ u64 combine_record_offset(int R, int M) { return (u64)R * M * 8; }
__device__ __forceinline__ u64 combine_slot_offset(int R, int M, int K) {
    return ((u64)R * M * 8 * (u64)(2 * K + 1) + 15) & ~(u64)15;
}
#define LL_NO_SLOT 0xffffffffu

// acc[0..7] = acc + w * row (8 bf16 channels), each op rounded once, in this order (the reference's).
__device__ __forceinline__ void fma_bf16x8_rn(float* acc, float w, int4 r) {
    acc[0] = add_rn(acc[0], mul_rn(w, bf16_lo((u32)r.x))); acc[1] = add_rn(acc[1], mul_rn(w, bf16_hi((u32)r.x)));
    acc[2] = add_rn(acc[2], mul_rn(w, bf16_lo((u32)r.y))); acc[3] = add_rn(acc[3], mul_rn(w, bf16_hi((u32)r.y)));
    acc[4] = add_rn(acc[4], mul_rn(w, bf16_lo((u32)r.z))); acc[5] = add_rn(acc[5], mul_rn(w, bf16_hi((u32)r.z)));
    acc[6] = add_rn(acc[6], mul_rn(w, bf16_lo((u32)r.w))); acc[7] = add_rn(acc[7], mul_rn(w, bf16_hi((u32)r.w)));
}

// Send: (1) this rank's records: token t's top-k slots, to every rank (t < M; tokens past T get
// empty records, so expert ranks need no count); (2) items (s, t), s every rank including this one:
// the partial of s's token t over this rank's experts, acc = 0; acc = acc + w * row in top-k order
// (fp32), written as bf16 into s's slot (this rank, t) with a flag. Expert rows are read straight
// from x, so x may be reused once the send phase is done (the hook only reads the slots).
__device__ void ll_combine_send(const LLCombineArgs& a, u64 seq) {
    __shared__ const int4* s_row[32];
    __shared__ float s_w[32];
    __shared__ int s_n;
    const int warp = warp_id(), lane = lane_id(), num_warps = blockDim.x >> 5;
    const int R = a.num_ranks, K = a.num_topk, E = a.num_experts, L = E / R, M = a.max_tokens, RM = R * M;
    const int half = (int)(seq & 1);
    const u64 own = a.peer_bases[a.rank];
    const u64 data = a.off_data + (u64)half * a.half_bytes;
    const u64 rec_off = data + combine_record_offset(R, M), slot_off = data + combine_slot_offset(R, M, K);
    const u64 slot_bytes = (u64)a.hidden * 2;
    const int n_vec = a.hidden / 8;
    if (warp == 0) {  // every source has read this half (call seq - 2), its records and slots alike
        const WaitSite site = {"low_latency_combine", "ll combine done (call seq - 2 consumed)", a.rank, -1, false};
        wait_ranks(own, a.off_done, R, (seq - 2) << 32, seq > 2, site, a.timeout_ns, a.mask);
    }
    __syncthreads();
    LL_MARK(a.state, 1, 1);
    // records: the last CTAs (at R * M CTAs, those of this rank's own items) write them, so the CTAs
    // of the peers' items go straight to polling
    for (int t = (int)gridDim.x - 1 - (int)blockIdx.x; t >= 0 && t < M; t += gridDim.x) {
        u32 loc = LL_NO_SLOT, wbits = 0;
        int dk = -1;
        if (lane < K && t < a.num_tokens) {
            const i64 g = a.topk_idx[(i64)t * K + lane];
            const int p = (g >= 0 && g < E) ? a.pos[(i64)t * K + lane] : -1;
            if (p >= 0) {
                dk = (int)(g / L);
                loc = (u32)((int)(g % L) * M + p);
                wbits = __float_as_uint(a.topk_weights[(i64)t * K + lane]);
            }
        }
        for (int d = warp; d < R; d += num_warps) {
            if (ll_masked(a.mask, d)) continue;
            u64* rec = flag_at(a.peer_bases[d], rec_off, (a.rank * M + t) * 2 * K);
            if (lane < K) {
                st_volatile(rec + 2 * lane, ll_record_tag(seq) | (dk == d ? loc : LL_NO_SLOT));
                st_volatile(rec + 2 * lane + 1, ll_record_tag(seq) | (dk == d ? wbits : 0u));
            }
        }
    }
    LL_MARK(a.state, 1, 2);
    for (int i = blockIdx.x; i < RM; i += gridDim.x) {
        const int s = (a.rank + 1 + i / M) % R, t = i % M;   // the peers' tokens first, this rank's last
        if (ll_masked(a.mask, s)) continue;                   // no records from it, no partials for it
        if (warp == 0) {
            const u64* rec = flag_at(own, rec_off, (s * M + t) * 2 * K);
            const WaitSite site = {"low_latency_combine", "ll combine record (channel = token)", a.rank, t, false};
            const bool in = lane < K;
            const u64 w_loc = warp_wait_tag(rec + 2 * (in ? lane : 0), ll_record_tag(seq), LL_TAG_MASK, in, s, site,
                                            a.timeout_ns);
            const u64 w_wt = warp_wait_tag(rec + 2 * (in ? lane : 0) + 1, ll_record_tag(seq), LL_TAG_MASK, in, s, site,
                                           a.timeout_ns);
            const u32 loc = in ? (u32)w_loc : LL_NO_SLOT;
            const bool mine = loc != LL_NO_SLOT;
            const u32 mask = __ballot_sync(FULL_MASK, mine);
            if (mine) {  // compacted in top-k order
                const int j = __popc(mask & lanemask_lt());
                const int le = (int)(loc / (u32)M), p = (int)(loc % (u32)M);
                const int start = (int)(a.layout_range[(i64)le * R + s] >> 32);
                s_row[j] = a.x + ((i64)le * RM + start + p) * n_vec;
                s_w[j] = __uint_as_float((u32)w_wt);
            }
            if (lane == 0) s_n = __popc(mask);
        }
        __syncthreads();
        if (i == (int)blockIdx.x) LL_MARK(a.state, 1, 3);
        const int n = s_n;
        if (n > 0) {
            int4* dst = reinterpret_cast<int4*>(a.peer_bases[s] + slot_off + ((u64)a.rank * M + t) * slot_bytes);
            for (int v = threadIdx.x; v < n_vec; v += blockDim.x) {
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                for (int j0 = 0; j0 < n; j0 += LL_UNROLL) {  // LL_UNROLL rows' loads in flight, then the sums in order
                    int4 r[LL_UNROLL];
#pragma unroll
                    for (int u = 0; u < LL_UNROLL; ++u)
                        r[u] = j0 + u < n ? ld_nc_v4(s_row[j0 + u] + v) : make_int4(0, 0, 0, 0);
#pragma unroll
                    for (int u = 0; u < LL_UNROLL; ++u)
                        if (j0 + u < n) fma_bf16x8_rn(acc, s_w[j0 + u], r[u]);
                }
                st_na_v4(dst + v, pack_bf16x8(acc));
            }
            if (i == (int)blockIdx.x) LL_MARK(a.state, 1, 4);
            __syncthreads();  // the whole partial is written
            if (threadIdx.x == 0) st_release_sys(flag_at(a.peer_bases[s], data, a.rank * M + t), seq);
        }
        __syncthreads();  // s_* are rewritten for the next item
    }
    LL_MARK(a.state, 1, 5);
    cta_phase_done(a.state, LL_COMBINE_SEND);
}

// Receive: token t's output = bf16(acc), acc = 0; acc = acc + float(P_d) for every rank d holding
// one of its slots, in rank order (P_d: d's bf16 partial). With CTAs to spare, `parts` CTAs share a
// token (each a range of channels).
__device__ void ll_combine_recv(const LLCombineArgs& a, u64 seq) {
    __shared__ int s_n[CL_MAX_RANKS];
    const int warp = warp_id(), lane = lane_id();
    const int R = a.num_ranks, K = a.num_topk, E = a.num_experts, L = E / R, M = a.max_tokens;
    const int half = (int)(seq & 1);
    const u64 own = a.peer_bases[a.rank];
    const u64 data = a.off_data + (u64)half * a.half_bytes;
    const u64 slot_off = data + combine_slot_offset(R, M, K);
    const u64 slot_bytes = (u64)a.hidden * 2;
    const int n_vec = a.hidden / 8;
    const int T = a.num_tokens;
    const int parts = max(1, min(LL_COMBINE_RECV_PARTS, (int)gridDim.x / max(T, 1)));
    for (int u = blockIdx.x; u < T * parts; u += gridDim.x) {
        const int t = u % T, q = u / T;
        if (warp == 0) {
            int dk = -1;
            if (lane < K) {
                const i64 g = a.topk_idx[(i64)t * K + lane];
                const int p = (g >= 0 && g < E) ? a.pos[(i64)t * K + lane] : -1;
                if (p >= 0) dk = (int)(g / L);
            }
            int n = 0;
            for (int k = 0; k < K; ++k) n += __shfl_sync(FULL_MASK, dk, k) == lane;  // lane d: t's slots on rank d
            const WaitSite site = {"low_latency_combine", "ll combine partial (channel = token)", a.rank, t, false};
            if (lane < R && ll_masked(a.mask, lane)) n = 0;   // its experts are left out of the sum
            const bool active = lane < R && n > 0;
            warp_wait_tag(flag_at(own, data, (active ? lane : 0) * M + t), seq, ~0ull, active, lane, site, a.timeout_ns);
            if (lane < R) s_n[lane] = n;
        }
        __syncthreads();
        if (u == (int)blockIdx.x) LL_MARK(a.state, 1, 6);
        const int v0 = (int)((i64)q * n_vec / parts), v1 = (int)((i64)(q + 1) * n_vec / parts);
        for (int v = v0 + (int)threadIdx.x; v < v1; v += blockDim.x) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int d0 = 0; d0 < R; d0 += LL_UNROLL) {  // LL_UNROLL partials' loads in flight, then the sums in rank order
                int4 r[LL_UNROLL];
#pragma unroll
                for (int i = 0; i < LL_UNROLL; ++i) {
                    const int d = d0 + i;
                    r[i] = d < R && s_n[d] > 0
                        ? __ldcg(reinterpret_cast<const int4*>(own + slot_off + ((u64)d * M + t) * slot_bytes) + v)
                        : make_int4(0, 0, 0, 0);
                }
#pragma unroll
                for (int i = 0; i < LL_UNROLL; ++i)
                    if (d0 + i < R && s_n[d0 + i] > 0) acc_bf16x8(acc, r[i]);
            }
            a.out[(i64)t * n_vec + v] = pack_bf16x8(acc);
        }
        __syncthreads();  // s_n is rewritten for the next unit
    }
    cta_release_done(a.peer_bases, a.off_done, a.rank, R, a.mask);  // the expert ranks may reuse this half (call seq + 2)
    cta_phase_done(a.state, LL_COMBINE_RECV);
}

__global__ void __launch_bounds__(kLlThreads, 2) combine(
    const int4* x, const i64* topk_idx, const float* topk_weights, const int* pos, const i64* layout_range,
    int4* out, int num_tokens, int hidden, int num_topk, int num_experts, int max_tokens,
    int phases, const u64* peer_bases, int rank, int num_ranks,
    u64 off_done, u64 off_data, u64 half_bytes,
    u64* state, u64 timeout_ns, const int* mask) {
    const LLCombineArgs a = {x, topk_idx, topk_weights, pos, layout_range, out,
                             num_tokens, hidden, num_topk, num_experts, max_tokens,
                             peer_bases, rank, num_ranks, off_done, off_data, half_bytes, state, timeout_ns, mask};
    ll_run_phases<LLCombineArgs, ll_combine_send, ll_combine_recv>(a, phases, 1, LL_COMBINE_SEND);
}

}  // namespace commlib::low_latency
