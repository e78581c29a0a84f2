// fusedist/layers/silu_mul.cuh -- the SwiGLU activation on the fused gate|up GEMM output:
//
//   out[t, j] = round_T(silu(g) * u),  g = gate_up[t, j], u = gate_up[t, inter + j],
//   silu(g) = g / (1 + exp(-g)),       fp32 math, one rounding
//
// (the torch composite F.silu(g) * u rounds silu(g) to T first: the two differ by at most
// about one ulp of T). Thread (blockIdx.x, threadIdx.x) owns 16-byte vector column c of the
// row and walks rows blockIdx.y, blockIdx.y + gridDim.y, ...: two coalesced loads and one
// store per vector, no shared memory, no inter-block communication.
//
// silu_mul_fp8_kernel: the same values as e4m3 + one float32 scale per row (fp8_rows.cuh).
// The scale needs the row's amax first, so one block owns a row: thread i takes vectors
// i, i + blockDim.x, ... of it, computes the fp32 values for the amax (a block reduction),
// then loads its vectors again (from L1 / L2: the row was read moments before) and stores
// the same values, divided by the scale, as e4m3. No register limit on the row's width.
#pragma once
#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger
#include "fusedist/common/vec.cuh"
#include "fusedist/layers/fp8_rows.cuh"

namespace fusedist {
namespace layers {

constexpr int kSiluMulThreads = 128;
constexpr int kSiluMulMaxRowBlocks = 65535;  // gridDim.y limit

struct SiluMulParams {
  const Vec16* gate_up;
  Vec16* out;
  int64_t tokens;
  int inter_vectors;                // inter / elements per vector
  int64_t in_stride, out_stride;    // 16-byte vectors between rows
};

template <typename T>
__global__ void __launch_bounds__(kSiluMulThreads)
    silu_mul_kernel(const __grid_constant__ SiluMulParams p) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  pdl_wait();  // gate_up is the previous kernel's output
  pdl_trigger();
  if (c >= p.inter_vectors) return;
  for (int64_t t = blockIdx.y; t < p.tokens; t += gridDim.y) {
    const Vec16* in = p.gate_up + t * p.in_stride;
    float g[kPer] = {}, u[kPer] = {};
    vec_accumulate<T>(g, in[c]);
    vec_accumulate<T>(u, in[p.inter_vectors + c]);
#pragma unroll
    for (int e = 0; e < kPer; ++e) g[e] = g[e] / (1.f + expf(-g[e])) * u[e];
    p.out[t * p.out_stride + c] = vec_from_floats<T>(g);
  }
}

constexpr int kSiluMulFp8MaxThreads = 256;

struct SiluMulFp8Params {
  const Vec16* gate_up;
  uint8_t* out;        // e4m3 [tokens, out_stride]
  float* scale;        // [tokens]
  int inter_vectors;   // inter / elements per vector
  int64_t in_stride;   // 16-byte vectors between rows of gate_up
  int64_t out_stride;  // bytes between rows of out
};

// silu(g) * u of vector c of the row, fp32 (the bf16 / fp16 / fp32 kernel's values).
template <typename T>
__device__ __forceinline__ void silu_mul_vec(const Vec16* in, int c, int inter_vectors,
                                             float* y) {
  float u[ElemTraits<T>::kPerVec] = {};
#pragma unroll
  for (int e = 0; e < ElemTraits<T>::kPerVec; ++e) y[e] = 0.f;
  vec_accumulate<T>(y, in[c]);
  vec_accumulate<T>(u, in[inter_vectors + c]);
#pragma unroll
  for (int e = 0; e < ElemTraits<T>::kPerVec; ++e) y[e] = y[e] / (1.f + expf(-y[e])) * u[e];
}

template <typename T>
__global__ void __launch_bounds__(kSiluMulFp8MaxThreads)
    silu_mul_fp8_kernel(const __grid_constant__ SiluMulFp8Params p) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int64_t row = blockIdx.x;
  const Vec16* in = p.gate_up + row * p.in_stride;
  pdl_wait();  // gate_up is the previous kernel's output
  pdl_trigger();
  float amax = 0.f;
  for (int c = threadIdx.x; c < p.inter_vectors; c += blockDim.x) {
    float y[kPer];
    silu_mul_vec<T>(in, c, p.inter_vectors, y);
#pragma unroll
    for (int e = 0; e < kPer; ++e) amax = nan_max(amax, fabsf(y[e]));
  }
  const float scale = fp8_row_scale(block_max_once(amax));
  if (threadIdx.x == 0) p.scale[row] = scale;
  uint8_t* q = p.out + row * p.out_stride;
  for (int c = threadIdx.x; c < p.inter_vectors; c += blockDim.x) {
    float y[kPer];
    silu_mul_vec<T>(in, c, p.inter_vectors, y);
    store_e4m3<kPer>(q + int64_t(c) * kPer, y, scale);
  }
}

}  // namespace layers
}  // namespace fusedist
