// fusedist/layers/add_rmsnorm.cuh -- residual add + RMSNorm on one GPU, one block per row.
//
//   h      = round_T(x + residual)                            -> residual, in place
//   normed = round_T(h * rsqrt(mean(h^2) + eps) * weight)     fp32 math
//   (without a residual: h = x, nothing but normed is written)
//   kFp8Out: normed as e4m3 + one float32 scale per row (fp8_rows.cuh) of the fp32 values
//
// The row stays in registers from its loads to its stores: thread i holds the row's 16-byte
// vectors i, i + blockDim.x, ... (kVpt of them: coalesced accesses), so x, residual and
// weight are read once, h and normed written once. The sum of squares is a warp shuffle, one
// shared-memory word per warp and one barrier, after which every thread adds the warp sums
// in the same order (deterministic, bitwise reproducible). h is rounded to T before it is
// squared: the stored residual and the normalized value agree, as in the torch composite
// `h = x + residual; F.rms_norm(h)`. Rows are independent: no inter-block communication.
// Reads happen before the barrier and normed is stored after it, so normed may overwrite x.
// kFp8Out: after the sum, a second block reduction (the row's amax) and a second pass over
// the packed h and weight that recomputes the same fp32 values and stores e4m3 bytes.
#pragma once
#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger
#include "fusedist/common/vec.cuh"
#include "fusedist/layers/fp8_rows.cuh"

namespace fusedist {
namespace layers {

constexpr int kRmsNormMaxThreads = 512;
constexpr int kRmsNormMaxVpt = 8;
constexpr int kRmsNormMaxVectors = kRmsNormMaxThreads * kRmsNormMaxVpt;

struct AddRmsNormParams {
  const Vec16* x;
  Vec16* residual;  // nullptr: plain RMSNorm (the kernel's kResidual = false)
  const Vec16* weight;
  Vec16* out;          // T output (nullptr with kFp8Out)
  uint8_t* out_fp8;    // kFp8Out: e4m3 [tokens, fp8_stride] and float32 scale [tokens]
  float* scale;
  int64_t fp8_stride;  // bytes between rows of out_fp8
  int hidden;                                      // elements; a whole number of vectors
  int64_t x_stride, residual_stride, out_stride;  // 16-byte vectors between rows
  float eps;
};

// The sum of v over the block (blockDim.x a multiple of 32, <= kRmsNormMaxThreads), returned
// to every thread. One call per kernel: its shared words are never reused.
__device__ __forceinline__ float block_sum_once(float v) {
  __shared__ float warp_sums[kRmsNormMaxThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  const int warps = blockDim.x / 32;
  for (int w = 0; w < warps; ++w) total += warp_sums[w];  // shared-memory broadcasts
  return total;
}

template <typename T, int kVpt, bool kResidual, bool kFp8Out>
__global__ void __launch_bounds__(kRmsNormMaxThreads)
    add_rmsnorm_row_kernel(const __grid_constant__ AddRmsNormParams p) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int hv = p.hidden / kPer;
  const int64_t row = blockIdx.x;
  const Vec16* x = p.x + row * p.x_stride;
  Vec16* res = kResidual ? p.residual + row * p.residual_stride : nullptr;
  Vec16 xv[kVpt], rv[kVpt], wv[kVpt];
  pdl_wait();  // x and residual may be the previous kernel's output
  pdl_trigger();
  // Every load of the row is issued before the first is used: one memory latency per row.
  // Except at 8 vectors a thread with a residual (rows of 16K+ bf16): x, residual and weight
  // all in flight are 96 registers, which spilled at the 128 a 512-thread block has; the
  // weight is loaded after the add there, its latency under the reduction.
  constexpr bool kWeightFirst = !(kResidual && kVpt == 8);
#pragma unroll
  for (int u = 0; u < kVpt; ++u) {
    const int c = threadIdx.x + u * blockDim.x;
    if (c < hv) {
      xv[u] = x[c];
      if constexpr (kResidual) rv[u] = res[c];
      if constexpr (kWeightFirst) wv[u] = p.weight[c];
    }
  }
  float sumsq = 0.f;
#pragma unroll
  for (int u = 0; u < kVpt; ++u) {
    const int c = threadIdx.x + u * blockDim.x;
    if (c >= hv) continue;
    float h[kPer] = {};
    vec_accumulate<T>(h, xv[u]);
    if constexpr (kResidual) {
      vec_accumulate<T>(h, rv[u]);  // fp32 add, then one rounding: torch's x + residual
      xv[u] = vec_from_floats<T>(h);
      res[c] = xv[u];
#pragma unroll
      for (int e = 0; e < kPer; ++e) h[e] = 0.f;
      vec_accumulate<T>(h, xv[u]);
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) sumsq += h[e] * h[e];
  }
  if constexpr (!kWeightFirst) {
#pragma unroll
    for (int u = 0; u < kVpt; ++u) {
      const int c = threadIdx.x + u * blockDim.x;
      if (c < hv) wv[u] = p.weight[c];
    }
  }
  const float rstd = rsqrtf(block_sum_once(sumsq) / float(p.hidden) + p.eps);
  // Keep h packed across the reduction (4 registers a vector) rather than as the kPer floats
  // the first loop unpacked: the empty asm makes the packed words opaque, so the floats are
  // unpacked again below instead of staying live (kVpt = 8 spilled without it).
#pragma unroll
  for (int u = 0; u < kVpt; ++u)
#pragma unroll
    for (int k = 0; k < 4; ++k) asm volatile("" : "+r"(xv[u].w[k]));
  // The fp32 normed values of the thread's vector u, unpacked again from the packed h.
  auto normed = [&](int u, float* y) {
    float w[kPer] = {};
#pragma unroll
    for (int e = 0; e < kPer; ++e) y[e] = 0.f;
    vec_accumulate<T>(y, xv[u]);
    vec_accumulate<T>(w, wv[u]);
#pragma unroll
    for (int e = 0; e < kPer; ++e) y[e] = y[e] * rstd * w[e];
  };
  float scale = 0.f;
  if constexpr (kFp8Out) {
    float amax = 0.f;
#pragma unroll
    for (int u = 0; u < kVpt; ++u) {
      if (threadIdx.x + u * blockDim.x >= hv) continue;
      float y[kPer];
      normed(u, y);
#pragma unroll
      for (int e = 0; e < kPer; ++e) amax = nan_max(amax, fabsf(y[e]));
    }
    scale = fp8_row_scale(block_max_once(amax));
    if (threadIdx.x == 0) p.scale[row] = scale;
  }
#pragma unroll
  for (int u = 0; u < kVpt; ++u) {
    const int c = threadIdx.x + u * blockDim.x;
    if (c >= hv) continue;
    float y[kPer];
    normed(u, y);
    if constexpr (kFp8Out)
      store_e4m3<kPer>(p.out_fp8 + row * p.fp8_stride + int64_t(c) * kPer, y, scale);
    else
      p.out[row * p.out_stride + c] = vec_from_floats<T>(y);
  }
}

}  // namespace layers
}  // namespace fusedist
