// fusedist/common/vec.cuh -- 16-byte vectors, element conversion to fp32 and back, and the
// volatile (relaxed, system-scope) accesses used on memory that another GPU writes.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include "fusedist/common/common.h"

namespace fusedist {

// One 16-byte vector: the unit every kernel moves. sm_90: LDG.E.128 / STG.E.128.
struct alignas(16) Vec16 {
  uint32_t w[4];
};

template <typename T>
struct ElemTraits;
template <>
struct ElemTraits<float> {
  static constexpr DType kDType = DType::kFloat32;
  static constexpr int kPerVec = 4;
  __device__ static float to_float(float v) { return v; }
  __device__ static float from_float(float v) { return v; }
};
template <>
struct ElemTraits<__half> {
  static constexpr DType kDType = DType::kFloat16;
  static constexpr int kPerVec = 8;
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
};
template <>
struct ElemTraits<__nv_bfloat16> {
  static constexpr DType kDType = DType::kBFloat16;
  static constexpr int kPerVec = 8;
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// Unpack a vector of T into kPerVec floats (accumulate = add into acc).
template <typename T>
__device__ __forceinline__ void vec_accumulate(float* acc, const Vec16& v) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < ElemTraits<T>::kPerVec; ++i) acc[i] += ElemTraits<T>::to_float(e[i]);
}

template <typename T>
__device__ __forceinline__ Vec16 vec_from_floats(const float* f) {
  Vec16 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < ElemTraits<T>::kPerVec; ++i) e[i] = ElemTraits<T>::from_float(f[i]);
  return v;
}

// Relaxed system-scope 16-byte load/store (ld.volatile is relaxed.sys in the PTX memory
// model): bypasses L1 so a poll sees a peer's NVLink store as soon as it lands in L2.
__device__ __forceinline__ Vec16 ld_volatile(const Vec16* p) {
  Vec16 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile(Vec16* p, const Vec16& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.w[0]),
               "r"(v.w[1]), "r"(v.w[2]), "r"(v.w[3])
               : "memory");
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Load vector `i` of a tensor with `n` elements of T, zero-filling past the end. `aligned`
// tensors take one 16-byte load; the tail vector is read element by element.
template <typename T>
__device__ __forceinline__ Vec16 load_vec_tail(const T* base, int64_t i, int64_t n) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int64_t first = i * kPer;
  if (first + kPer <= n) return reinterpret_cast<const Vec16*>(base)[i];
  Vec16 v = {{0u, 0u, 0u, 0u}};
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int k = 0; k < kPer; ++k)  // constant indices keep v in registers
    if (first + k < n) e[k] = base[first + k];
  return v;
}

template <typename T>
__device__ __forceinline__ void store_vec_tail(T* base, int64_t i, int64_t n, const Vec16& v) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int64_t first = i * kPer;
  if (first + kPer <= n) {
    reinterpret_cast<Vec16*>(base)[i] = v;
    return;
  }
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    if (first + k < n) base[first + k] = e[k];
}

}  // namespace fusedist
