// fusedist/attention/rope_append.cuh -- RoPE on q and k plus the paged-cache append, one kernel
// (device tier: raw pointers, no torch).
//
// Protocol. One warp per (token, task); a token has q_heads + 2 * kv_heads tasks: rotate q head
// h in place; rotate k head h in place and write it to the cache; write v head h to the cache.
// Lane j owns 16-byte vector j of the head (head_dim / 8 <= 32 lanes hold a whole head):
//   neox (HF rotate_half): element i pairs with i + rot/2, i.e. vector j with vector
//        j +- rot/16 of another lane, fetched with four warp shuffles;
//   gptj: elements 2i and 2i+1 pair inside one vector.
// Both use frequency index f of cos_sin[pos, f] (cos) and cos_sin[pos, rot/2 + f] (sin), read as
// float4s; features at or past rot are left as they are. The rotation is fp32 and rounds once to
// the input dtype; the cache receives exactly the rounded k (and v) values. FP8 caches
// (e4m3): per (token, head) scale = amax / 448 of those values (a warp max), stored in the
// float32 scale array; element = satfinite_rn(x * (1 / scale)) (scale 0: zeros).
// Head norm (Qwen3's q_norm / k_norm; q_norm non-null): before the rotation each q and k head
// is RMS-normalized over head_dim, x * rsqrt(mean(x^2) + eps) * w (fp32, w of float32 or q's
// dtype), and rounded to the input dtype; the rotation reads the rounded values, and features
// past rot are written back normalized. The same math as a float32 F.rms_norm rounded to q's
// dtype before the rotation, up to the order of the sum of squares.
// Slots: slot_mapping[t] = page * page_size + offset; a negative slot writes nothing (q and k are
// still rotated: padding tokens of a CUDA-graph batch). Bad metadata (op_error.h): a slot >=
// num_slots or a position outside [0, max_position) is recorded in p.err, the token's q and k
// heads become NaN, a bad slot writes no cache row, and a bad position with a valid slot
// writes NaN rows; the RoPE table is read at a clamped position. No access leaves the tensors.
//
// Layouts: q [T, q_heads, D] with token stride q_stride elements (heads contiguous), likewise
// k, v; k_cache, v_cache [num_slots, kv_heads, D] (a [num_pages, page_size, kv_heads, D] cache
// flattened); k_scale, v_scale [num_slots, kv_heads] float32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

#include "fusedist/common/op_error.h"
#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger
#include "fusedist/common/vec.cuh"

namespace fusedist {
namespace attention {

constexpr int kRopeWarpsPerBlock = 4;
constexpr int kRopeMaxHeadDim = 256;   // 32 lanes x 8 halves

enum class RopeStyle : int { kNeox = 0, kGptj = 1 };

struct RopeAppendParams {
  void* q;
  void* k;
  const void* v;
  const void* positions;     // int32 or int64 [T]
  const float* cos_sin;      // [max_position, rot]
  void* k_cache;
  void* v_cache;
  float* k_scale;            // FP8 caches only
  float* v_scale;
  const int64_t* slot_mapping;
  int64_t tokens;
  int64_t num_slots;         // num_pages * page_size
  OpErrorRecord* err;        // bad slots / positions are recorded here (null: not recorded)
  const void* q_norm;        // [head_dim] head-norm weights, or null (no head norm)
  const void* k_norm;
  float norm_eps;
  bool norm_w_fp32;          // the weights are float32 (else q's dtype)
  int q_heads, kv_heads, head_dim, rot, max_position;
  int64_t q_stride, k_stride, v_stride;   // elements between tokens
  bool positions_int64;
};

template <typename T>
__device__ __forceinline__ void unpack8(const Vec16& v, float* f) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = ElemTraits<T>::to_float(e[i]);
}

__device__ __forceinline__ float4 ld_float4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}

// Rotate this lane's 8 values x (vector j) in place. partner: the 8 values of vector j + rot/16
// (first half) or j - rot/16 (second half) for neox; unused for gptj.
template <RopeStyle S>
__device__ __forceinline__ void rotate8(float* x, const float* partner, const float* cs_row,
                                        int j, int rot) {
  if constexpr (S == RopeStyle::kNeox) {
    const int half_vecs = rot / 16;
    const bool first = j < half_vecs;
    const int f0 = 8 * (first ? j : j - half_vecs);
    float c[8], s[8];
    *reinterpret_cast<float4*>(c) = ld_float4(cs_row + f0);
    *reinterpret_cast<float4*>(c + 4) = ld_float4(cs_row + f0 + 4);
    *reinterpret_cast<float4*>(s) = ld_float4(cs_row + rot / 2 + f0);
    *reinterpret_cast<float4*>(s + 4) = ld_float4(cs_row + rot / 2 + f0 + 4);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      // first half: x1 c - x2 s; second half: x2 c + x1 s (x2 own, x1 the partner's)
      x[i] = first ? __fsub_rn(__fmul_rn(x[i], c[i]), __fmul_rn(partner[i], s[i]))
                   : __fadd_rn(__fmul_rn(x[i], c[i]), __fmul_rn(partner[i], s[i]));
    }
  } else {
    const int f0 = 4 * j;
    float c[4], s[4];
    *reinterpret_cast<float4*>(c) = ld_float4(cs_row + f0);
    *reinterpret_cast<float4*>(s) = ld_float4(cs_row + rot / 2 + f0);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
      x[2 * i + 1] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
    }
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The head norm of this lane's 8 values x (vector j of the head; lanes past the head hold
// zeros), in place: x * rsqrt(sum(x^2) / head_dim + eps) * w[8 j .. 8 j + 8), then rounded to T
// (raw receives the rounded vector). Every lane of the warp takes part (the sum).
template <typename T>
__device__ __forceinline__ void head_norm(float* x, Vec16& raw, bool live, int j,
                                          const void* w, bool w_fp32, int head_dim,
                                          float eps) {
  float ss = 0.f;
  if (live) {
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(x[i], x[i], ss);
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, float(head_dim)), eps));
  if (!live) return;
  float wf[8];
  if (w_fp32) {
    *reinterpret_cast<float4*>(wf) = ld_float4(reinterpret_cast<const float*>(w) + 8 * j);
    *reinterpret_cast<float4*>(wf + 4) = ld_float4(reinterpret_cast<const float*>(w) + 8 * j + 4);
  } else {
    unpack8<T>(*reinterpret_cast<const Vec16*>(reinterpret_cast<const T*>(w) + 8 * j), wf);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], r), wf[i]);
  raw = vec_from_floats<T>(x);
  unpack8<T>(raw, x);
}

// Store 8 values (already representable in T) to the cache: T as one 16-byte vector, e4m3 as
// 8 bytes with the head's scale (lane 0 writes the scale).
template <typename T, typename CT>
__device__ __forceinline__ void store_cache(const float* x, bool lane_live, CT* cache_row,
                                            float* scale_slot, int j) {
  if constexpr (sizeof(CT) == 1) {
    float amax = 0.f;
    if (lane_live) {
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(x[i]));
    }
    amax = warp_max(amax);
    const float scale = __fdiv_rn(amax, 448.f);
    const float inv = scale > 0.f ? __fdiv_rn(1.f, scale) : 0.f;
    if (lane_live) {
      uint32_t w[2];
      __nv_fp8_e4m3* e = reinterpret_cast<__nv_fp8_e4m3*>(w);
#pragma unroll
      for (int i = 0; i < 8; ++i) e[i] = __nv_fp8_e4m3(__fmul_rn(x[i], inv));
      *reinterpret_cast<uint2*>(cache_row + 8 * j) = make_uint2(w[0], w[1]);
    }
    if ((threadIdx.x & 31) == 0) *scale_slot = scale;
  } else {
    if (lane_live)
      *reinterpret_cast<Vec16*>(cache_row + 8 * j) = vec_from_floats<T>(x);
  }
}

// T: q/k/v element type (bf16 / fp16); CT: cache element type (T or __nv_fp8_e4m3).
template <typename T, typename CT, RopeStyle S>
__global__ void __launch_bounds__(kRopeWarpsPerBlock * 32)
    rope_append_kernel(const RopeAppendParams p) {
  pdl_wait();   // q, k, v, the positions and the slots may be the previous kernel's output
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int tasks = p.q_heads + 2 * p.kv_heads;
  const int64_t id = int64_t(blockIdx.x) * kRopeWarpsPerBlock + (threadIdx.x >> 5);
  if (id >= p.tokens * tasks) return;   // whole warps leave together
  const int64_t t = id / tasks;
  const int task = int(id - t * tasks);
  const int vecs = p.head_dim / 8;
  const bool live = lane < vecs;
  const int j = live ? lane : 0;

  int64_t pos = p.positions_int64 ? reinterpret_cast<const int64_t*>(p.positions)[t]
                                  : int64_t(reinterpret_cast<const int*>(p.positions)[t]);
  const int64_t slot = p.slot_mapping[t];
  const bool bad_pos = pos < 0 || pos >= p.max_position;
  const bool bad_slot = slot >= p.num_slots;
  if (task == 0 && lane == 0) {
    if (bad_pos) record_op_error(p.err, kOpErrRopeAppend, kOpErrPosition, int(t), -1, pos,
                                 p.max_position);
    else if (bad_slot) record_op_error(p.err, kOpErrRopeAppend, kOpErrSlot, int(t), -1, slot,
                                       p.num_slots);
  }
  pos = pos < 0 ? 0 : (pos >= p.max_position ? p.max_position - 1 : pos);
  const float* cs_row = p.cos_sin + pos * p.rot;

  const bool is_q = task < p.q_heads;
  const bool is_v = task >= p.q_heads + p.kv_heads;
  const int head = is_q ? task : (is_v ? task - p.q_heads - p.kv_heads : task - p.q_heads);
  T* src = is_q ? reinterpret_cast<T*>(p.q) + t * p.q_stride
                : (is_v ? const_cast<T*>(reinterpret_cast<const T*>(p.v)) + t * p.v_stride
                        : reinterpret_cast<T*>(p.k) + t * p.k_stride);
  src += int64_t(head) * p.head_dim;

  Vec16 raw{};
  if (live) raw = *reinterpret_cast<const Vec16*>(src + 8 * j);
  float x[8];
  unpack8<T>(raw, x);
  const bool rotated = live && !is_v && 8 * lane < p.rot;
  const bool normed = !is_v && p.q_norm != nullptr;   // warp-uniform
  if (!is_v) {   // warp-uniform branch: every lane takes part in the shuffles
    if (normed)
      head_norm<T>(x, raw, live, j, is_q ? p.q_norm : p.k_norm, p.norm_w_fp32, p.head_dim,
                   p.norm_eps);
    float partner[8] = {};
    if constexpr (S == RopeStyle::kNeox) {
      const int half_vecs = p.rot / 16;
      int src_lane = lane < half_vecs ? lane + half_vecs : lane - half_vecs;
      if (lane >= 2 * half_vecs) src_lane = lane;
      Vec16 pv;
#pragma unroll
      for (int w = 0; w < 4; ++w) pv.w[w] = __shfl_sync(0xffffffffu, raw.w[w], src_lane);
      unpack8<T>(pv, partner);
    }
    if (bad_pos || bad_slot) {   // poison the token's q / k head (warp-uniform)
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = __int_as_float(0x7fffffff);
      if (live) *reinterpret_cast<Vec16*>(src + 8 * j) = vec_from_floats<T>(x);
    } else if (rotated) {
      rotate8<S>(x, partner, cs_row, j, p.rot);
      const Vec16 out = vec_from_floats<T>(x);
      *reinterpret_cast<Vec16*>(src + 8 * j) = out;
      unpack8<T>(out, x);   // the cache gets the rounded values
    } else if (normed && live) {   // past rot: normalized, not rotated
      *reinterpret_cast<Vec16*>(src + 8 * j) = raw;
    }
  }
  if (is_q) return;
  if (slot < 0 || bad_slot) return;   // warp-uniform: the whole warp shares the token
  if (bad_pos) {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __int_as_float(0x7fffffff);
  }
  const int64_t row = (slot * p.kv_heads + head) * p.head_dim;
  CT* cache = reinterpret_cast<CT*>(is_v ? p.v_cache : p.k_cache) + row;
  float* scale_slot = nullptr;
  if constexpr (sizeof(CT) == 1)
    scale_slot = (is_v ? p.v_scale : p.k_scale) + slot * p.kv_heads + head;
  store_cache<T, CT>(x, live, cache, scale_slot, j);
}

}  // namespace attention
}  // namespace fusedist
