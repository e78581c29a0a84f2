// fusedist/layers/quantize_rows.cuh -- dynamic per-token FP8 quantization of an activation, the
// input side of the row-wise FP8 GEMMs (fusedist.nn.quant.quantize_rows's convention):
//
//   scale = max(amax(|x|), 1e-30) / 448     one float32 per row; 1 for a row of zeros
//   q     = e4m3(x / scale)                 IEEE division, round to nearest even, +-448 saturated
//
// A NaN in a row makes its scale and every q of it NaN; an infinite x makes the scale infinite
// (that element NaN, the row's finite ones 0), as the torch ops of quantize_rows give. One block
// owns a row: thread i takes 16-byte vectors i, i + blockDim.x, ... for the amax (a block
// reduction), then loads them again (L1 / L2: read moments before) and stores e4m3 bytes. No
// shared memory beyond the reduction's 32 words, no limit on the row's width.
// quantize_groups_kernel (below) gives one scale per group of k instead of per row.
#pragma once
#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger
#include "fusedist/common/vec.cuh"
#include "fusedist/layers/fp8_rows.cuh"

namespace fusedist {
namespace layers {

constexpr int kQuantizeRowsMaxThreads = 256;
constexpr float kQuantizeRowsMinAmax = 1e-30f;

struct QuantizeRowsParams {
  const Vec16* x;
  uint8_t* out;        // e4m3 [tokens, out_stride]
  float* scale;        // [tokens]
  int vectors;         // k / elements per vector
  int64_t in_stride;   // 16-byte vectors between rows of x
  int64_t out_stride;  // bytes between rows of out
  int groups;          // quantize_groups_kernel: scales per row (scale is [tokens, groups])
};

// The row's scale from its amax: NaN stays NaN, 0 gives 1, else max(amax, 1e-30) / 448.
__device__ __forceinline__ float quantize_rows_scale(float amax) {
  if (amax != amax) return amax;
  if (amax == 0.f) return 1.f;
  return __fdiv_rn(fmaxf(amax, kQuantizeRowsMinAmax), kE4M3Max);
}

// Vector c of the row as kPer floats (converted, not added to 0: -0 stays -0, as in torch).
template <typename T>
__device__ __forceinline__ void load_row_vec(const Vec16* in, int c, float* y) {
  const Vec16 v = in[c];
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < ElemTraits<T>::kPerVec; ++i) y[i] = ElemTraits<T>::to_float(e[i]);
}

template <typename T>
__global__ void __launch_bounds__(kQuantizeRowsMaxThreads)
    quantize_rows_kernel(const __grid_constant__ QuantizeRowsParams p) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int64_t row = blockIdx.x;
  const Vec16* in = p.x + row * p.in_stride;
  pdl_wait();  // x is the previous kernel's output
  pdl_trigger();
  float amax = 0.f;
  for (int c = threadIdx.x; c < p.vectors; c += blockDim.x) {
    float y[kPer];
    load_row_vec<T>(in, c, y);
#pragma unroll
    for (int e = 0; e < kPer; ++e) amax = nan_max(amax, fabsf(y[e]));
  }
  const float scale = quantize_rows_scale(block_max_once(amax));
  if (threadIdx.x == 0) p.scale[row] = scale;
  uint8_t* q = p.out + row * p.out_stride;
  for (int c = threadIdx.x; c < p.vectors; c += blockDim.x) {
    float y[kPer];
    load_row_vec<T>(in, c, y);
    store_e4m3<kPer>(q + int64_t(c) * kPer, y, scale);
  }
}

// The same convention per group of kGroupVec consecutive vectors of a row (the 1 x 128 form
// that pairs with 128 x 128 weight blocks: 16 bf16 vectors): one pass, each thread one vector,
// the group's amax by xor shuffles inside its lanes (kGroupVec divides 32 and blockDim.x is a
// multiple of 32, so a group never straddles warps; a group is wholly inside or past the row,
// vectors being a multiple of kGroupVec). Block (row, j) takes vectors [j * blockDim.x, ...).
template <typename T, int kGroupVec>
__global__ void __launch_bounds__(kQuantizeRowsMaxThreads)
    quantize_groups_kernel(const __grid_constant__ QuantizeRowsParams p) {
  static_assert(kGroupVec >= 1 && kGroupVec <= 32 && (kGroupVec & (kGroupVec - 1)) == 0,
                "a group is a power-of-two number of lanes of one warp");
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int64_t row = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const bool valid = c < p.vectors;
  pdl_wait();  // x is the previous kernel's output
  pdl_trigger();
  float y[kPer];
  if (valid) {
    load_row_vec<T>(p.x + row * p.in_stride, c, y);
  } else {
#pragma unroll
    for (int e = 0; e < kPer; ++e) y[e] = 0.f;
  }
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) amax = nan_max(amax, fabsf(y[e]));
#pragma unroll
  for (int o = kGroupVec / 2; o > 0; o >>= 1)
    amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!valid) return;
  const float scale = quantize_rows_scale(amax);
  if (c % kGroupVec == 0) p.scale[row * p.groups + c / kGroupVec] = scale;
  store_e4m3<kPer>(p.out + row * p.out_stride + int64_t(c) * kPer, y, scale);
}

}  // namespace layers
}  // namespace fusedist
