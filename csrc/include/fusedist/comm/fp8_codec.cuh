// fusedist/comm/fp8_codec.cuh -- the FP8 payload codec of fusedist.comm.fp8: e4m3 bytes with one
// fp32 scale per block of `block` elements.
//
//   encode:      amax_b = max |x[i]| over block b (elements at or past numel count as 0; a NaN
//                makes it NaN), scale[b] = amax_b > 0 ? amax_b * fp32(1 / 448) : 1,
//                q[i] = e4m3(clamp(x[i] / scale[b], -448, 448)), round to nearest even
//   decode_sum:  out[i] = ((v_0 + v_1) + v_2) + ...,  v_r = float(q_r[i]) * scale_r[i / block]
//                (the payloads in order; one payload: out[i] = v_0)
//
// Every quotient, product and sum is rounded on its own (__fdiv_rn / __fmul_rn / __fadd_rn, no
// FMA contraction), so results are bitwise the plain-torch reference's (fusedist/comm/fp8.py
// quantize / decode_sum), and identical on every rank given the same payload bytes.
//
// encode: one CTA per block, grid-strided over blocks: the CTA's amax through warp shuffles
// and one warp over the warp maxima (shared memory, rewritten per block after a barrier),
// then each thread writes the bytes of its elements. decode_sum: one thread per element,
// grid-strided. No inter-block communication; the grid depends only on the sizes.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger

namespace fusedist {
namespace comm {

constexpr int kFp8CodecThreads = 256;
constexpr float kE4M3Max = 448.f;

struct Fp8EncodeParams {
  const void* x;     // numel elements of T
  uint8_t* q;        // nblocks * block bytes (the padding encoded as zeros)
  float* scales;     // nblocks
  int64_t numel;
  int64_t nblocks;   // ceil(numel / block)
  int block;
};

struct Fp8DecodeSumParams {
  const uint8_t* q;       // payload r at q + r * q_stride
  const float* scales;    // payload r's scales at scales + r * scale_stride
  float* out;             // numel
  int64_t numel;          // elements written (<= the payloads' padded length)
  int64_t q_stride, scale_stride;
  int block;
  int payloads;
};

__device__ __forceinline__ float fp8_codec_load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float fp8_codec_load(const __half* p, int64_t i) {
  return __half2float(p[i]);
}
__device__ __forceinline__ float fp8_codec_load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}

// torch's amax: a NaN anywhere makes the maximum NaN.
__device__ __forceinline__ float nan_max(float a, float b) {
  return (a != a || b != b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
}

template <typename T>
__global__ void __launch_bounds__(kFp8CodecThreads)
    fp8_encode_kernel(const __grid_constant__ Fp8EncodeParams p) {
  __shared__ float warp_max[kFp8CodecThreads / 32];
  __shared__ float block_scale;
  const T* x = static_cast<const T*>(p.x);
  pdl_wait();  // x is the previous kernel's output
  pdl_trigger();
  for (int64_t b = blockIdx.x; b < p.nblocks; b += gridDim.x) {
    const int64_t base = b * p.block;
    float m = 0.f;
    for (int j = threadIdx.x; j < p.block; j += blockDim.x) {
      if (base + j < p.numel) m = nan_max(m, fabsf(fp8_codec_load(x, base + j)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
      float v = threadIdx.x < kFp8CodecThreads / 32 ? warp_max[threadIdx.x] : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
      if (threadIdx.x == 0) {
        // amax x (1 / 448) in fp32: torch divides a CUDA tensor by a scalar that way (a
        // multiply by the scalar's fp32 reciprocal), and the torch path is the reference.
        const float s = v > 0.f ? __fmul_rn(v, 1.f / kE4M3Max) : 1.f;  // NaN > 0 is false: 1
        block_scale = s;
        p.scales[b] = s;
      }
    }
    __syncthreads();
    const float s = block_scale;
    for (int j = threadIdx.x; j < p.block; j += blockDim.x) {
      const int64_t i = base + j;
      float v = i < p.numel ? __fdiv_rn(fp8_codec_load(x, i), s) : 0.f;
      if (v == v) v = fminf(fmaxf(v, -kE4M3Max), kE4M3Max);  // torch's clamp keeps NaN
      p.q[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    }
    __syncthreads();  // warp_max and block_scale are rewritten for the next block
  }
}

__global__ void __launch_bounds__(kFp8CodecThreads)
    fp8_decode_sum_kernel(const __grid_constant__ Fp8DecodeSumParams p) {
  pdl_wait();  // the payloads come from the previous kernel / collective
  pdl_trigger();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.numel; i += stride) {
    const int64_t b = i / p.block;
    float acc = 0.f;
    for (int r = 0; r < p.payloads; ++r) {
      const __half_raw h = __nv_cvt_fp8_to_halfraw(
          static_cast<__nv_fp8_storage_t>(p.q[r * p.q_stride + i]), __NV_E4M3);
      const float v = __fmul_rn(__half2float(__half(h)), p.scales[r * p.scale_stride + b]);
      acc = r == 0 ? v : __fadd_rn(acc, v);
    }
    p.out[i] = acc;
  }
}

}  // namespace comm
}  // namespace fusedist
