// fusedist/layers/fp8_rows.cuh -- the per-token e4m3 output of the layer kernels (add_rmsnorm,
// silu_mul), with the convention of the fused all-reduce + RMSNorm (comm/allreduce_rmsnorm.cuh)
// and of the plain-torch references (fusedist/ops/_rows.py fp8_rows):
//
//   scale = max(amax(|y|), 1e-12) / 448        one float32 per row, of the fp32 results y
//   q     = e4m3(y / scale)                     IEEE division, round to nearest even
//
// A NaN anywhere in the row makes amax, the scale and so every q of the row NaN (torch's amax
// and clamp_min propagate NaN; fmaxf would drop it). An infinite y makes the scale infinite:
// that element becomes NaN (inf / inf), the row's finite ones 0, as in torch.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

namespace fusedist {
namespace layers {

constexpr float kE4M3Max = 448.f;    // largest finite e4m3 value
constexpr float kFp8MinAmax = 1e-12f;

// max(a, b) that returns NaN when either is NaN.
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// nan_max of v over the block (blockDim.x a multiple of 32, <= 1024), returned to every thread.
// One call per kernel: its shared words are never reused.
__device__ __forceinline__ float block_max_once(float v) {
  __shared__ float warp_max[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  float m = 0.f;
  const int warps = blockDim.x / 32;
  for (int w = 0; w < warps; ++w) m = nan_max(m, warp_max[w]);
  return m;
}

// The row's scale from its amax (NaN stays NaN: fmaxf alone would turn it into the floor).
__device__ __forceinline__ float fp8_row_scale(float amax) {
  return (amax != amax ? amax : fmaxf(amax, kFp8MinAmax)) / kE4M3Max;
}

// y[0..kN) / scale as kN e4m3 bytes at dst (aligned to kN bytes: 4 or 8), one store.
// __NV_SATFINITE only matters for y / scale a rounding above 448 (it then rounds to 448, as
// torch does); NaN stays NaN.
template <int kN>
__device__ __forceinline__ void store_e4m3(uint8_t* dst, const float* y, float scale) {
  static_assert(kN == 4 || kN == 8, "4 or 8 values a store");
  uint32_t w[kN / 4] = {};
#pragma unroll
  for (int e = 0; e < kN; ++e) {
    const uint32_t b = __nv_cvt_float_to_fp8(__fdiv_rn(y[e], scale), __NV_SATFINITE, __NV_E4M3);
    w[e / 4] |= b << (8 * (e % 4));
  }
  if constexpr (kN == 8)
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  else
    *reinterpret_cast<uint32_t*>(dst) = w[0];
}

}  // namespace layers
}  // namespace fusedist
