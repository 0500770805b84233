/* cuda_attn_pool_issue.cuh: one warp stages one pool's rows (K or V) of a 32-key tile into shared
 * memory with cp.async (internal; included by cuda_attn_decode.cu for the flash-decoding kernel and
 * kv_span.cu for the span attention, which both stage K and V apart, each warp its own tile).
 * Ownership: nothing is allocated. Errors: none (device code; the callers' launches are checked). */
#pragma once

#include "kernels/cuda/cuda_attn_device.cuh"

/* The tile that m describes (tile_lookup) into dst, rows of kst elements, indexed by lane. contig:
 * the tile starts on a 16-key boundary of blocks of a multiple of 16 slots, so keys 16h .. 16h + 15
 * are consecutive slots of one block and a lane's rows are two base pointers plus compile-time
 * offsets (tile_issue's fast path); else one copy source per key, taken by shuffle from the lane
 * that looked it up. Keys that are not read get zero-filled rows without touching memory. */
template <int HD>
__device__ __forceinline__ void pool_issue(const bf16 *pool, const tile_meta &m, bool contig, bf16 *dst, int kst)
{
    constexpr int CH = HD / 8, S = 32 / CH; /* keys covered by one pass of the warp */
    static_assert(S >= 1 && S <= 16, "pool_issue: head_dim 16 .. 256");
    const int lane = threadIdx.x & 31;
    if (contig) {
        const unsigned vmask = __ballot_sync(FULL, m.row >= 0); /* bit j: key j of the tile is read */
        const int j0 = lane / CH, c = lane % CH;
        const long long base[2] = {m.base0 + j0 * HD + c * 8, m.base1 + j0 * HD + c * 8};
        bf16 *d = dst + j0 * kst + c * 8;
#pragma unroll
        for (int i = 0; i < AT_TILE / S; i++) {
            const int h = i * S / 16, off = (i * S) % 16; /* compile-time */
            const int bytes = (vmask >> (j0 + i * S)) & 1u ? 16 : 0;
            cp_async16(d + i * S * kst, pool + base[h] + off * HD, bytes);
        }
        return;
    }
#pragma unroll
    for (int idx = lane; idx < AT_TILE * CH; idx += 32) {
        const int j = idx / CH, c = idx % CH;
        const long long r = __shfl_sync(FULL, m.row, j);
        const bool ok = r >= 0;
        cp_async16(dst + j * kst + c * 8, ok ? pool + r + c * 8 : pool, ok ? 16 : 0);
    }
}
