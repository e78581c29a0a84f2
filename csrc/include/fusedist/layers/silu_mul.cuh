// fusedist/layers/silu_mul.cuh -- the SwiGLU activation on the fused gate|up GEMM output:
//
//   out[t, j] = round_T(silu(g) * u),  g = gate_up[t, j], u = gate_up[t, inter + j],
//   silu(g) = g / (1 + exp(-g)),       fp32 math, one rounding
//
// (the torch composite F.silu(g) * u rounds silu(g) to T first: the two differ by at most
// about one ulp of T). Thread (blockIdx.x, threadIdx.x) owns 16-byte vector column c of the
// row and walks rows blockIdx.y, blockIdx.y + gridDim.y, ...: two coalesced loads and one
// store per vector, no shared memory, no inter-block communication.
#pragma once
#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger
#include "fusedist/common/vec.cuh"

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

}  // namespace layers
}  // namespace fusedist
