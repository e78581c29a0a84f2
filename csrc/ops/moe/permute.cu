// Launchers of the MoE permute / unpermute kernels (csrc/include/fusedist/moe/permute.cuh):
// validate, pick the dtype (and the FP8 form) and launch with programmatic dependent launch
// (launch.h).
#include <algorithm>
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/moe/api.h"
#include "fusedist/moe/permute.cuh"

namespace fusedist {
namespace {

static_assert(kMoeMaxTopK <= moe::kUnpermuteMaxTopK, "unpermute holds every slot's row");

constexpr int kFp8Group = 128;  // quant 2: one scale per 128 columns

// A warp per 32 vectors of the row, at most kPermuteMaxThreads (a multiple of 32).
int threads_for(int vectors) {
  return std::min<int>((vectors + 31) / 32 * 32, moe::kPermuteMaxThreads);
}

template <typename T>
void launch_permute(const moe::PermuteParams& p, int quant, cudaStream_t s) {
  const int threads = threads_for(p.vectors);
  const unsigned ysplit = unsigned((p.vectors + threads - 1) / threads);
  if (quant == 0) {
    launch_kernel("moe_permute_kernel", moe::moe_permute_kernel<T>,
                  dim3(unsigned(p.rows), ysplit), dim3(threads), s, p);
  } else if (quant == 1) {
    launch_kernel("moe_permute_rows_fp8_kernel", moe::moe_permute_rows_fp8_kernel<T>,
                  dim3(unsigned(p.rows)), dim3(threads), s, p);
  } else {
    constexpr int kGroupVec = kFp8Group / ElemTraits<T>::kPerVec;
    launch_kernel("moe_permute_groups_fp8_kernel", moe::moe_permute_groups_fp8_kernel<T, kGroupVec>,
                  dim3(unsigned(p.rows), ysplit), dim3(threads), s, p);
  }
}

template <typename T>
void launch_unpermute(const moe::UnpermuteParams& p, cudaStream_t s) {
  const int threads = threads_for(p.vectors);
  const dim3 grid(unsigned(p.tokens), unsigned((p.vectors + threads - 1) / threads));
  launch_kernel("moe_unpermute_kernel", moe::moe_unpermute_kernel<T>, grid, dim3(threads), s, p);
}

void check_dtype(DType t, const std::string& w) {
  FUSEDIST_CHECK_ARG(t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16,
                     w + "dtype must be float32, float16 or bfloat16, got " + dtype_name(t));
}

}  // namespace

void moe_permute(const MoePermuteArgs& a, uintptr_t stream) {
  const std::string w = "moe_permute: ";
  check_dtype(a.dtype, w);
  const int per = 16 / dtype_size(a.dtype);
  FUSEDIST_CHECK_ARG(a.hidden > 0 && a.hidden % per == 0,
                     w + "hidden must be a positive multiple of " + std::to_string(per) +
                         " (16-byte vectors), got " + std::to_string(a.hidden));
  FUSEDIST_CHECK_ARG(a.quant >= 0 && a.quant <= 2, w + "quant must be 0, 1 (a scale per row) or "
                                                       "2 (a scale per 128 columns)");
  FUSEDIST_CHECK_ARG(a.quant != 2 || a.hidden % kFp8Group == 0,
                     w + "quant 2 takes hidden a multiple of 128, got " +
                         std::to_string(a.hidden));
  FUSEDIST_CHECK_ARG(a.top_k >= 1 && a.tokens >= 0 && a.rows >= 0 && a.rows <= 0x7fffffff,
                     w + "need top_k >= 1, tokens >= 0 and rows in [0, 2^31)");
  FUSEDIST_CHECK_ARG(a.x_stride >= a.hidden && a.x_stride % per == 0,
                     w + "x_stride must be whole vectors of at least a row");
  FUSEDIST_CHECK_ARG(a.out_stride >= a.hidden && a.out_stride % per == 0,
                     w + "out_stride must be whole vectors of at least a row");
  if (a.rows == 0) return;
  FUSEDIST_CHECK_ARG(a.src_index && a.out && (a.tokens == 0 || a.x) && (a.quant == 0 || a.scale),
                     w + "x, src_index, out (and scale with quant) must be non-null");
  FUSEDIST_CHECK_ARG(a.x % 16 == 0 && a.out % 16 == 0 && a.src_index % 4 == 0 &&
                         a.scale % 4 == 0,
                     w + "x and out must be 16-byte aligned, src_index and scale 4-byte");
  moe::PermuteParams p{};
  p.x = reinterpret_cast<const Vec16*>(a.x);
  p.x_stride = a.x_stride / per;
  p.src_index = reinterpret_cast<const int32_t*>(a.src_index);
  p.rows = int(a.rows);
  p.top_k = a.top_k;
  p.pairs = a.tokens * a.top_k;
  p.vectors = a.hidden / per;
  if (a.quant == 0) {
    p.out = reinterpret_cast<Vec16*>(a.out);
    p.out_stride = a.out_stride / per;
  } else {
    p.q = reinterpret_cast<uint8_t*>(a.out);
    p.out_stride = a.out_stride;  // e4m3: elements are bytes
    p.scale = reinterpret_cast<float*>(a.scale);
    p.groups = a.quant == 2 ? a.hidden / kFp8Group : 1;
  }
  p.err = reinterpret_cast<OpErrorRecord*>(a.err);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::kFloat32: launch_permute<float>(p, a.quant, s); break;
    case DType::kFloat16: launch_permute<__half>(p, a.quant, s); break;
    default: launch_permute<__nv_bfloat16>(p, a.quant, s); break;
  }
}

void moe_unpermute(const MoeUnpermuteArgs& a, uintptr_t stream) {
  const std::string w = "moe_unpermute: ";
  check_dtype(a.dtype, w);
  const int per = 16 / dtype_size(a.dtype);
  FUSEDIST_CHECK_ARG(a.hidden > 0 && a.hidden % per == 0,
                     w + "hidden must be a positive multiple of " + std::to_string(per) +
                         " (16-byte vectors), got " + std::to_string(a.hidden));
  FUSEDIST_CHECK_ARG(a.top_k >= 1 && a.top_k <= kMoeMaxTopK,
                     w + "top_k must be in [1, " + std::to_string(kMoeMaxTopK) + "], got " +
                         std::to_string(a.top_k));
  FUSEDIST_CHECK_ARG(a.tokens >= 0 && a.tokens <= 0x7fffffff && a.rows >= 0 &&
                         a.rows <= 0x7fffffff,
                     w + "tokens and rows must be in [0, 2^31)");
  FUSEDIST_CHECK_ARG(a.y_stride >= a.hidden && a.y_stride % per == 0 &&
                         a.out_stride >= a.hidden && a.out_stride % per == 0 &&
                         (!a.residual || (a.res_stride >= a.hidden && a.res_stride % per == 0)),
                     w + "row strides must be whole vectors of at least a row");
  if (a.tokens == 0) return;
  FUSEDIST_CHECK_ARG(a.dest_index && a.weights && a.out && (a.rows == 0 || a.y),
                     w + "y, dest_index, weights and out must be non-null");
  FUSEDIST_CHECK_ARG(a.y % 16 == 0 && a.out % 16 == 0 && a.residual % 16 == 0 &&
                         a.dest_index % 4 == 0 && a.weights % 4 == 0,
                     w + "y, out and residual must be 16-byte aligned, dest_index and weights "
                         "4-byte");
  moe::UnpermuteParams p{};
  p.y = reinterpret_cast<const Vec16*>(a.y);
  p.y_stride = a.y_stride / per;
  p.rows = int(a.rows);
  p.dest_index = reinterpret_cast<const int32_t*>(a.dest_index);
  p.weights = reinterpret_cast<const float*>(a.weights);
  p.top_k = a.top_k;
  p.tokens = int(a.tokens);
  p.vectors = a.hidden / per;
  p.residual = reinterpret_cast<const Vec16*>(a.residual);
  p.res_stride = a.res_stride / per;
  p.out = reinterpret_cast<Vec16*>(a.out);
  p.out_stride = a.out_stride / per;
  p.err = reinterpret_cast<OpErrorRecord*>(a.err);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::kFloat32: launch_unpermute<float>(p, s); break;
    case DType::kFloat16: launch_unpermute<__half>(p, s); break;
    default: launch_unpermute<__nv_bfloat16>(p, s); break;
  }
}

}  // namespace fusedist
