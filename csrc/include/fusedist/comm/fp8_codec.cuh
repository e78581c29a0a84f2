// fusedist/comm/fp8_codec.cuh -- the FP8 payload codec of fusedist.comm.fp8: one byte per element
// (e3m4 or e4m3) with one fp32 scale per block of `block` elements.
//
//   encode:      amax_b = max |x[i]| over block b (elements at or past numel count as 0; a NaN
//                makes it NaN), scale[b] = amax_b > 0 ? amax_b * fp32(1 / MAX) : 1,
//                q[i] = FMT(x[i] / scale[b]), saturated at +-MAX, round to nearest even
//   decode_sum:  out[i] = ((v_0 + v_1) + v_2) + ...,  v_r = float(q_r[i]) * scale_r[i / block]
//                (the payloads in order; one payload: out[i] = v_0)
//
// Formats (MAX): e4m3 (448; __nv_fp8_e4m3, the hardware conversion) and e3m4 (31; sign, 3
// exponent bits of bias 3, 4 mantissa bits, subnormals, no infinities, 0x80 = NaN): encoded
// by arithmetic on the fp32 bits. Every quotient, product and sum is rounded on its own
// (__fdiv_rn / __fmul_rn / __fadd_rn, no FMA contraction), so results are bitwise the
// plain-torch reference's (fusedist/comm/fp8.py quantize / decode_sum), and identical on every
// rank given the same payload bytes.
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

#include "fusedist/common/common.h"   // Fp8Format
#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger

namespace fusedist {
namespace comm {

constexpr int kFp8CodecThreads = 256;
constexpr float kE4M3Max = 448.f;
constexpr float kE3M4Max = 31.f;
constexpr unsigned kE3M4Nan = 0x80;  // the negative zero's code: zeros encode as 0x00

template <int kFmt>
struct Fp8FormatMax;
template <>
struct Fp8FormatMax<kFp8E4M3> {
  static constexpr float value = kE4M3Max;
};
template <>
struct Fp8FormatMax<kFp8E3M4> {
  static constexpr float value = kE3M4Max;
};

// 2^e for e in fp32's normal exponent range, from its bits (exact).
__device__ __forceinline__ float fp8_pow2(int e) { return __uint_as_float(unsigned(e + 127) << 23); }

// e3m4 code of v (fp32, already divided by the scale): |v| saturated at 31, its exponent
// floor(log2 |v|) taken from the fp32 bits and held at least -2 (the smallest normal; below
// it the subnormal step 2^-6), the mantissa rounded to 4 bits, half to even (rintf of an exact
// power-of-two scaling). code = k + 16 (e + 2) is monotone in |v| and carries into the next
// binade when k rounds up to 32.
__device__ __forceinline__ uint8_t e3m4_encode(float v) {
  if (v != v) return uint8_t(kE3M4Nan);
  const float a = fminf(fabsf(v), kE3M4Max);
  const int e = max(int(__float_as_uint(a) >> 23) - 127, -2);
  const int code = int(rintf(__fmul_rn(a, fp8_pow2(4 - e)))) + 16 * (e + 2);
  return uint8_t(v < 0.f && code != 0 ? code | 0x80 : code);
}

// The value of an e3m4 code: (16 + m) 2^(e - 7) for exponent field e >= 1, m 2^-6 for e = 0.
__device__ __forceinline__ float e3m4_decode(unsigned c) {
  if (c == kE3M4Nan) return __int_as_float(0x7fffffff);
  const int e = (c >> 4) & 7, m = c & 15;
  const float mag = __fmul_rn(float(e ? m + 16 : m), fp8_pow2(max(e, 1) - 7));
  return c & 0x80 ? -mag : mag;
}

template <int kFmt>
__device__ __forceinline__ uint8_t fp8_encode_value(float v) {
  if constexpr (kFmt == kFp8E3M4) {
    return e3m4_encode(v);
  } else {
    if (v == v) v = fminf(fmaxf(v, -kE4M3Max), kE4M3Max);  // torch's clamp keeps NaN
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
}

template <int kFmt>
__device__ __forceinline__ float fp8_decode_value(uint8_t c) {
  if constexpr (kFmt == kFp8E3M4) {
    return e3m4_decode(c);
  } else {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
    return __half2float(__half(h));
  }
}

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

template <typename T, int kFmt>
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
        // amax x fp32(1 / MAX), one rounding, as the torch path multiplies.
        const float s = v > 0.f ? __fmul_rn(v, 1.f / Fp8FormatMax<kFmt>::value) : 1.f;  // NaN: 1
        block_scale = s;
        p.scales[b] = s;
      }
    }
    __syncthreads();
    const float s = block_scale;
    for (int j = threadIdx.x; j < p.block; j += blockDim.x) {
      const int64_t i = base + j;
      const float v = i < p.numel ? __fdiv_rn(fp8_codec_load(x, i), s) : 0.f;
      p.q[i] = fp8_encode_value<kFmt>(v);
    }
    __syncthreads();  // warp_max and block_scale are rewritten for the next block
  }
}

template <int kFmt>
__global__ void __launch_bounds__(kFp8CodecThreads)
    fp8_decode_sum_kernel(const __grid_constant__ Fp8DecodeSumParams p) {
  pdl_wait();  // the payloads come from the previous kernel / collective
  pdl_trigger();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.numel; i += stride) {
    const int64_t b = i / p.block;
    float acc = 0.f;
    for (int r = 0; r < p.payloads; ++r) {
      const float v = __fmul_rn(fp8_decode_value<kFmt>(p.q[r * p.q_stride + i]),
                                p.scales[r * p.scale_stride + b]);
      acc = r == 0 ? v : __fadd_rn(acc, v);
    }
    p.out[i] = acc;
  }
}

}  // namespace comm
}  // namespace fusedist
