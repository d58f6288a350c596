// moe_rows.cu: the expert stage's per-row reduction (commlib.training.moe.experts.routed_experts), one pass over HBM.
//
//   dst[n, :] = bf16( sum over k < K with pos[n, k] >= 0 of float(src[pos[n, k], :]) )
//
// summed in float32 in slot order k = 0, 1, ... from +0.0 (IEEE adds, never flushed or contracted),
// rounded once to bf16. A row without a valid slot gets zeros. src holds the (row, slot) outputs of
// the grouped GEMMs in expert order; pos[n, k] is the src row of slot k of row n (-1: the slot's
// expert is not on this rank). The same kernel is the backward of the gather that builds the GEMMs'
// input (x[rows[m]]): there dst is the gradient of x and src the gradient of the gathered rows.
//
// torch's way (float32 zeros, index_add_ of the float32-cast rows, a cast back) moves ~5x the bytes:
// it writes and rereads an [N, H] float32 tensor three times and an [M, H] float32 copy once. Here
// each src row is read once and each dst row written once. With at most two terms per row the result
// is bit-identical to torch's in any order (float addition commutes, +0.0 + a == a); with more terms
// it is torch's sum in slot order (torch's CUDA index_add_ adds in whatever order its atomics land).
//
// One warp per row; lane l loads pos[n, l] (K <= 32) and the warp broadcasts each slot's row (every lane
// runs every iteration, also past a short row's end, for the shuffle). Each lane keeps ROW_UNROLL
// vectors of 8 values in flight per slot.
#include "common.cuh"

constexpr int kRowUnroll = 4;  // rows' vectors in flight per lane

namespace commlib::moe {

__global__ void __launch_bounds__(256) slot_sum_bf16(const int4* __restrict__ src, const int* __restrict__ pos,
                                                     int4* __restrict__ dst, int num_rows, int num_slots,
                                                     int row_int4) {
    constexpr int U = kRowUnroll;
    const int lane = lane_id();
    const int warps = blockDim.x >> 5;
    for (int n = blockIdx.x * warps + warp_id(); n < num_rows; n += gridDim.x * warps) {
        const int mine = lane < num_slots ? __ldg(pos + (i64)n * num_slots + lane) : -1;
        int4* out = dst + (i64)n * row_int4;
        for (int base = 0; base < row_int4; base += 32 * U) {  // the whole warp iterates: shfl below
            const int i0 = base + lane;
            float acc[U][8];
            zero_acc<U>(acc);
            for (int k = 0; k < num_slots; ++k) {
                const int p = __shfl_sync(FULL_MASK, mine, k);
                if (p < 0) continue;  // the same p for the whole warp: no divergence
                acc_row_part<U>(acc, src + (i64)p * row_int4, i0, row_int4);
            }
            store_row_part<U>(out, acc, i0, row_int4);
        }
    }
}

}  // namespace commlib::moe
