// fusedist/comm/allreduce_rmsnorm.cuh -- one-shot all-reduce fused with residual add and RMSNorm.
//
//   h        = round_T(round_T(sum_r x_r) + residual)   -> residual_out
//   normed   = round_T(h * rsqrt(mean(h^2) + eps) * weight)   (or e4m3 + per-token scale)
//
// Communication is the one-shot protocol of allreduce_oneshot.cuh (same slots, same
// sentinel, same epoch rotation, same call descriptors), laid out row by row: row t's vector
// c is vector t * (hidden / kPer) + c of the slot. One block owns whole rows, so the row's sum
// of squares is a block reduction and h never leaves registers. Rows are pushed for all of
// the block's rows first, then reduced, so the NVLink transfers of later rows overlap the
// epilogue of earlier ones.
#pragma once
#include <cuda_fp8.h>

#include "fusedist/comm/symmetric.cuh"

namespace fusedist {

constexpr float kFp8E4M3Max = 448.f;

template <int kThreads>
__device__ __forceinline__ float block_reduce(float x, bool is_max) {
  __shared__ float s_part[kThreads / 32];
  __shared__ float s_total;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // s_part may still be read by a previous call
  if (lane == 0) s_part[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < int(blockDim.x / 32) ? s_part[lane] : (is_max ? 0.f : 0.f);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float y = __shfl_xor_sync(0xffffffffu, x, o);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    if (lane == 0) s_total = x;
  }
  __syncthreads();
  return s_total;
}

// kVpt: vectors per thread per row (hidden / kPer <= kVpt * blockDim.x).
template <typename T, int kVpt, bool kFp8Out>
__global__ void __launch_bounds__(1024)
    allreduce_rmsnorm_kernel(const __grid_constant__ SymmView v, const T* __restrict__ x, const T* residual,
                             const T* __restrict__ weight, T* normed, T* residual_out,
                             __nv_fp8_e4m3* normed_fp8, float* scales, int tokens, int hidden,
                             float eps) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int hv = hidden / kPer;
  const Vec16* xv = reinterpret_cast<const Vec16*>(x);
  pdl_wait();
  pdl_trigger();
  // The block's first row stays in registers (xr) for the reduction; its loads are in flight
  // together with the epoch load.
  Vec16 xr[kVpt];
#pragma unroll
  for (int u = 0; u < kVpt; ++u) {
    const int c = threadIdx.x + u * blockDim.x;
    if (c < hv) xr[u] = sanitize(xv[int64_t(blockIdx.x) * hv + c]);
  }
  const uint32_t epoch = begin_epoch(v.ctl, load_epoch(v.ctl));
  // The call descriptor (symmetric.cuh): op, dtype, FP8 output, tokens x hidden, hidden.
#define FUSEDIST_RMSNORM_DESC                                                          \
  collective_desc(kOpOneShotRmsNorm, ElemTraits<T>::kDType, kFp8Out ? kDescFp8Out : 0u,  \
                  uint64_t(tokens) * uint64_t(hidden), uint32_t(hidden))
  send_desc(v, epoch, FUSEDIST_RMSNORM_DESC);

  for (int t = blockIdx.x; t < tokens; t += gridDim.x)
#pragma unroll
    for (int u = 0; u < kVpt; ++u) {
      const int c = threadIdx.x + u * blockDim.x;
      if (c >= hv) continue;
      const int64_t i = int64_t(t) * hv + c;
      const Vec16 xi = t == int(blockIdx.x) ? xr[u] : sanitize(xv[i]);
#pragma unroll 1
      for (int p = 0; p < v.world; ++p)
        if (p != v.rank) st_volatile(slot_ptr(v, p, epoch, v.rank) + i, xi);
    }


  // Block 0 checks the peers' call descriptors (symmetric.cuh) before it waits for data, so
  // that a thread waiting for data a differently called peer never sends is released by the
  // recorded mismatch. Rows of two vectors per thread run at the 64-register limit of
  // 1024-thread blocks: they make the check a call (inlined, its wait made ptxas spill), and
  // the FP8 variant, which spilled even so, checks after its rows instead (a peer called with
  // other rows can then leave one of this rank's rows waiting out the timeout, reported as a
  // timeout, while the peer reports the mismatch).
  constexpr bool kCheckFirst = kVpt == 1 || !kFp8Out;
  if constexpr (kCheckFirst)
    check_desc<kVpt == 1>(v, epoch, FUSEDIST_RMSNORM_DESC, kOpOneShotRmsNorm);

  for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
    float h[kVpt][kPer];
    float sumsq = 0.f;
    // Residual and weight do not depend on the peers: load them before waiting on the peers'
    // data so their latency hides behind the NVLink transfer.
    Vec16 res_v[kVpt], w_v[kVpt];
#pragma unroll
    for (int u = 0; u < kVpt; ++u) {
      const int c = threadIdx.x + u * blockDim.x;
      if (c >= hv) continue;
      res_v[u] = reinterpret_cast<const Vec16*>(residual)[int64_t(t) * hv + c];
      w_v[u] = reinterpret_cast<const Vec16*>(weight)[c];
    }
#pragma unroll
    for (int u = 0; u < kVpt; ++u) {
      const int c = threadIdx.x + u * blockDim.x;
#pragma unroll
      for (int e = 0; e < kPer; ++e) h[u][e] = 0.f;
      if (c >= hv) continue;
      const int64_t i = int64_t(t) * hv + c;
#pragma unroll 1
      for (int s = 0; s < v.world; ++s) {
        const Vec16 y = (s == v.rank) ? (t == int(blockIdx.x) ? xr[u] : sanitize(xv[i]))
                                      : receive(v, slot_ptr(v, v.rank, epoch, s), i, s, epoch,
                                                kOpOneShotRmsNorm);
        vec_accumulate<T>(h[u], y);
      }
      // Round the all-reduce result to T first: same semantics as all_reduce, then add.
      const Vec16 ar = vec_from_floats<T>(h[u]);
#pragma unroll
      for (int e = 0; e < kPer; ++e) h[u][e] = 0.f;
      vec_accumulate<T>(h[u], ar);
      vec_accumulate<T>(h[u], res_v[u]);
      // Round h to T once: the stored residual and the normalized value agree.
      const Vec16 hr = vec_from_floats<T>(h[u]);
      reinterpret_cast<Vec16*>(residual_out)[i] = hr;
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        h[u][e] = 0.f;
      }
      vec_accumulate<T>(h[u], hr);
#pragma unroll
      for (int e = 0; e < kPer; ++e) sumsq += h[u][e] * h[u][e];
    }
    const float rstd = rsqrtf(block_reduce<1024>(sumsq, false) / float(hidden) + eps);

    float amax = 0.f;
#pragma unroll
    for (int u = 0; u < kVpt; ++u) {
      const int c = threadIdx.x + u * blockDim.x;
      if (c >= hv) continue;
      float w[kPer];
#pragma unroll
      for (int e = 0; e < kPer; ++e) w[e] = 0.f;
      vec_accumulate<T>(w, w_v[u]);
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        h[u][e] = h[u][e] * rstd * w[e];
        amax = fmaxf(amax, fabsf(h[u][e]));
      }
      if (!kFp8Out)
        reinterpret_cast<Vec16*>(normed)[int64_t(t) * hv + c] = vec_from_floats<T>(h[u]);
    }
    if (kFp8Out) {
      const float scale = fmaxf(block_reduce<1024>(amax, true), 1e-12f) / kFp8E4M3Max;
      const float inv = 1.f / scale;
      if (threadIdx.x == 0) scales[t] = scale;
#pragma unroll
      for (int u = 0; u < kVpt; ++u) {
        const int c = threadIdx.x + u * blockDim.x;
        if (c >= hv) continue;
        __nv_fp8_e4m3* dst = normed_fp8 + (int64_t(t) * hv + c) * kPer;
#pragma unroll
        for (int e = 0; e < kPer; ++e) dst[e] = __nv_fp8_e4m3(h[u][e] * inv);
      }
    }
  }
  if constexpr (!kCheckFirst)
    check_desc<false>(v, epoch, FUSEDIST_RMSNORM_DESC, kOpOneShotRmsNorm);
#undef FUSEDIST_RMSNORM_DESC
  finish_epoch(v.ctl, v.err, v.timeout_ns, v.rank, epoch, kOpOneShotRmsNorm);
}

}  // namespace fusedist
