// fusedist/moe/permute.cuh -- MoE token permutation on the device (no torch): the tokens'
// rows gathered into per-expert segments (permute), optionally as e4m3 with their scales, and
// the experts' output rows summed back to token order (unpermute). fusedist/ops/moe/permute.py
// states the semantics; the layout is sort_by_expert's (moe/gating.cuh).
//
// permute: row r of the buffer is x[src_index[r] / k], or zeros where src_index[r] = -1
// (padding), so every row is written. 16-byte vectors; one CTA per row (x grid) or per
// blockDim vectors of a row (y grid). The FP8 outputs follow fusedist.ops.quantize_rows'
// convention with its device helpers (layers/quantize_rows.cuh): per row
// (moe_permute_rows_fp8_kernel: the row's amax by a block reduction, then the row loaded again
// from L1 / L2 and stored as e4m3) or per 128 columns (moe_permute_groups_fp8_kernel: one
// vector a thread, the group's amax by xor shuffles within its kGroupVec lanes); a padding row
// is quantized as a row of zeros (scale 1, q 0), as the reference does.
//
// unpermute: out[t] = sum_j w[t, j] * y[dest_index[t * k + j]] over j = 0 .. k-1 in that
// order, each product and each sum rounded to fp32 (__fmul_rn / __fadd_rn: no FMA
// contraction), + residual[t] (fp32), rounded once to the dtype: the reference's operations in
// its order, so the same bits. One CTA per (token, blockDim vectors); the k row indices and
// weights go through shared memory; the k loads of a vector are issued eight at a time.
//
// Bad layout entries never address outside the tensors: a src_index outside [-1, tokens * k)
// makes its row NaN (and its scale NaN), a dest_index outside [0, rows) its token's output NaN;
// the first is recorded (op_error.h: kOpErrMoePermute / kOpErrMoeUnpermute, kOpErrRowIndex).
// A pair that sort_by_expert left out (an id out of range: dest_index -1) poisons its token
// the same way (the sort recorded the id).
#pragma once
#include <cstdint>

#include "fusedist/common/op_error.h"
#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger
#include "fusedist/common/vec.cuh"
#include "fusedist/layers/fp8_rows.cuh"
#include "fusedist/layers/quantize_rows.cuh"

namespace fusedist {
namespace moe {

constexpr int kPermuteMaxThreads = 256;
constexpr int kUnpermuteMaxTopK = 32;

struct PermuteParams {
  const Vec16* x;       // [tokens, x_stride vectors]
  int64_t x_stride;     // vectors between rows of x
  const int32_t* src_index;  // [rows]
  int rows, top_k;
  int64_t pairs;        // tokens * top_k: src_index values in [0, pairs)
  int vectors;          // hidden / elements per vector
  Vec16* out;           // plain: [rows, out_stride vectors]
  int64_t out_stride;   // plain: vectors; FP8: bytes between rows of q
  uint8_t* q;           // FP8: e4m3 [rows, out_stride]
  float* scale;         // FP8: [rows] or [rows, groups]
  int groups;           // FP8 per 128 columns: scales per row
  OpErrorRecord* err;
};

struct UnpermuteParams {
  const Vec16* y;       // [rows, y_stride vectors]
  int64_t y_stride;
  int rows;
  const int32_t* dest_index;  // [tokens * top_k]
  const float* weights;       // [tokens, top_k]
  int top_k, tokens, vectors;
  const Vec16* residual;      // [tokens, res_stride] or null
  int64_t res_stride;
  Vec16* out;                 // [tokens, out_stride]
  int64_t out_stride;
  OpErrorRecord* err;
};

// A vector of the dtype's quiet NaN.
template <typename T>
__device__ __forceinline__ Vec16 nan_vec() {
  const uint32_t w = sizeof(T) == 4 ? 0x7fc00000u
                     : ElemTraits<T>::kDType == DType::kFloat16 ? 0x7e007e00u : 0x7fc07fc0u;
  return Vec16{{w, w, w, w}};
}

// The token whose row goes to permuted row r: >= 0, -1 (padding: zeros) or -2 (a bad
// src_index: NaN; recorded by the caller's thread 0 of the row).
__device__ __forceinline__ int64_t permute_source(const PermuteParams& p, int r, bool record) {
  const int64_t s = p.src_index[r];
  if (s == -1) return -1;
  if (s < -1 || s >= p.pairs) {
    if (record) record_op_error(p.err, kOpErrMoePermute, kOpErrRowIndex, r, -1, s, p.pairs);
    return -2;
  }
  return s / p.top_k;
}

// Plain rows. Grid (rows, ceil(vectors / blockDim.x)): one vector a thread.
template <typename T>
__global__ void __launch_bounds__(kPermuteMaxThreads)
    moe_permute_kernel(const __grid_constant__ PermuteParams p) {
  const int r = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  pdl_wait();  // x and the layout are earlier kernels' outputs
  pdl_trigger();
  const int64_t t = permute_source(p, r, blockIdx.y == 0 && threadIdx.x == 0);
  if (c >= p.vectors) return;
  Vec16 v = {{0u, 0u, 0u, 0u}};
  if (t >= 0) v = p.x[t * p.x_stride + c];
  else if (t == -2) v = nan_vec<T>();
  p.out[int64_t(r) * p.out_stride + c] = v;
}

// Vector c of the row as floats: x's, zeros (padding) or NaN (bad index).
template <typename T>
__device__ __forceinline__ void permute_row_vec(const PermuteParams& p, int64_t t, int c,
                                                float* y) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  if (t >= 0) {
    layers::load_row_vec<T>(p.x + t * p.x_stride, c, y);
  } else {
#pragma unroll
    for (int e = 0; e < kPer; ++e) y[e] = t == -1 ? 0.f : __int_as_float(0x7fc00000);
  }
}

// e4m3 rows with one scale a row (quantize_rows_kernel's scheme). Grid (rows).
template <typename T>
__global__ void __launch_bounds__(kPermuteMaxThreads)
    moe_permute_rows_fp8_kernel(const __grid_constant__ PermuteParams p) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int r = blockIdx.x;
  pdl_wait();
  pdl_trigger();
  const int64_t t = permute_source(p, r, threadIdx.x == 0);
  float amax = 0.f;
  for (int c = threadIdx.x; c < p.vectors; c += blockDim.x) {
    float y[kPer];
    permute_row_vec<T>(p, t, c, y);
#pragma unroll
    for (int e = 0; e < kPer; ++e) amax = layers::nan_max(amax, fabsf(y[e]));
  }
  const float scale = layers::quantize_rows_scale(layers::block_max_once(amax));
  if (threadIdx.x == 0) p.scale[r] = scale;
  uint8_t* q = p.q + int64_t(r) * p.out_stride;
  for (int c = threadIdx.x; c < p.vectors; c += blockDim.x) {
    float y[kPer];
    permute_row_vec<T>(p, t, c, y);
    layers::store_e4m3<kPer>(q + int64_t(c) * kPer, y, scale);
  }
}

// e4m3 rows with one scale per kGroupVec vectors (quantize_groups_kernel's scheme). Grid
// (rows, ceil(vectors / blockDim.x)), blockDim.x a multiple of 32.
template <typename T, int kGroupVec>
__global__ void __launch_bounds__(kPermuteMaxThreads)
    moe_permute_groups_fp8_kernel(const __grid_constant__ PermuteParams p) {
  static_assert(kGroupVec >= 1 && kGroupVec <= 32 && (kGroupVec & (kGroupVec - 1)) == 0,
                "a group is a power-of-two number of lanes of one warp");
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int r = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const bool valid = c < p.vectors;
  pdl_wait();
  pdl_trigger();
  const int64_t t = permute_source(p, r, blockIdx.y == 0 && threadIdx.x == 0);
  float y[kPer];
  if (valid) {
    permute_row_vec<T>(p, t, c, y);
  } else {
#pragma unroll
    for (int e = 0; e < kPer; ++e) y[e] = 0.f;
  }
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) amax = layers::nan_max(amax, fabsf(y[e]));
#pragma unroll
  for (int o = kGroupVec / 2; o > 0; o >>= 1)
    amax = layers::nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!valid) return;
  const float scale = layers::quantize_rows_scale(amax);
  if (c % kGroupVec == 0) p.scale[int64_t(r) * p.groups + c / kGroupVec] = scale;
  layers::store_e4m3<kPer>(p.q + int64_t(r) * p.out_stride + int64_t(c) * kPer, y, scale);
}

// Grid (tokens, ceil(vectors / blockDim.x)): one vector a thread.
template <typename T>
__global__ void __launch_bounds__(kPermuteMaxThreads)
    moe_unpermute_kernel(const __grid_constant__ UnpermuteParams p) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  constexpr int kBatch = 8;
  __shared__ int64_t rows_s[kUnpermuteMaxTopK];
  __shared__ float w_s[kUnpermuteMaxTopK];
  const int t = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const int k = p.top_k;
  pdl_wait();  // y, the layout and the weights are earlier kernels' outputs
  pdl_trigger();
  bool bad = false;
  if (threadIdx.x < k) {
    const int64_t i = int64_t(t) * k + threadIdx.x;
    const int d = p.dest_index[i];
    bad = d < 0 || d >= p.rows;
    // -1 is also a pair the sort left out: the sort recorded its id first (first error wins).
    if (bad && blockIdx.y == 0)
      record_op_error(p.err, kOpErrMoeUnpermute, kOpErrRowIndex, t, threadIdx.x, d, p.rows);
    rows_s[threadIdx.x] = bad ? 0 : int64_t(d) * p.y_stride;
    w_s[threadIdx.x] = p.weights[i];
  }
  const bool any_bad = __syncthreads_or(bad);
  if (c >= p.vectors) return;
  Vec16* dst = p.out + int64_t(t) * p.out_stride + c;
  if (any_bad) {
    *dst = nan_vec<T>();
    return;
  }
  float acc[kPer] = {};  // slot 0 assigns (a -0 product stays -0), later slots add
  for (int j0 = 0; j0 < k; j0 += kBatch) {
    Vec16 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (j0 + b < k) v[b] = p.y[rows_s[j0 + b] + c];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (j0 + b >= k) break;
      const float w = w_s[j0 + b];
      const T* e = reinterpret_cast<const T*>(&v[b]);
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const float prod = __fmul_rn(w, ElemTraits<T>::to_float(e[i]));
        acc[i] = j0 + b == 0 ? prod : __fadd_rn(acc[i], prod);
      }
    }
  }
  if (p.residual != nullptr) {
    const Vec16 rv = p.residual[int64_t(t) * p.res_stride + c];
    const T* e = reinterpret_cast<const T*>(&rv);
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[i] = __fadd_rn(acc[i], ElemTraits<T>::to_float(e[i]));
  }
  *dst = vec_from_floats<T>(acc);
}

}  // namespace moe
}  // namespace fusedist
