// Launcher of the per-token FP8 quantization kernel (csrc/include/fusedist/layers/
// quantize_rows.cuh): validates, picks the dtype and launches one block a row (programmatic
// dependent launch, launch.h).
#include <algorithm>
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/layers/api.h"
#include "fusedist/layers/quantize_rows.cuh"

namespace fusedist {
namespace {

template <typename T>
void launch(const layers::QuantizeRowsParams& p, int64_t tokens, cudaStream_t s) {
  // A warp per 32 vectors of the row, at most kQuantizeRowsMaxThreads (wider rows loop).
  const int threads = std::min<int>((p.vectors + 31) / 32 * 32, layers::kQuantizeRowsMaxThreads);
  launch_kernel("quantize_rows_kernel", layers::quantize_rows_kernel<T>, dim3(unsigned(tokens)),
                dim3(threads), s, p);
}

template <typename T, int kGroupVec>
void launch_groups(const layers::QuantizeRowsParams& p, int64_t tokens, cudaStream_t s) {
  const int threads = std::min<int>((p.vectors + 31) / 32 * 32, layers::kQuantizeRowsMaxThreads);
  const dim3 grid(unsigned(tokens), unsigned((p.vectors + threads - 1) / threads));
  launch_kernel("quantize_groups_kernel", layers::quantize_groups_kernel<T, kGroupVec>, grid,
                dim3(threads), s, p);
}

template <typename T>
void launch_groups(const layers::QuantizeRowsParams& p, int64_t tokens, int group_vec,
                   cudaStream_t s) {
  switch (group_vec) {
    case 8: launch_groups<T, 8>(p, tokens, s); break;
    case 16: launch_groups<T, 16>(p, tokens, s); break;
    default: launch_groups<T, 32>(p, tokens, s); break;
  }
}

}  // namespace

void quantize_rows(const QuantizeRowsArgs& a, uintptr_t stream) {
  const std::string w = "quantize_rows: ";
  FUSEDIST_CHECK_ARG(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat16 ||
                         a.dtype == DType::kBFloat16,
                     w + "dtype must be float32, float16 or bfloat16, got " + dtype_name(a.dtype));
  const int per = 16 / dtype_size(a.dtype);
  FUSEDIST_CHECK_ARG(a.k > 0 && a.k % per == 0,
                     w + "k must be a positive multiple of " + std::to_string(per) +
                         " (16-byte vectors), got " + std::to_string(a.k));
  FUSEDIST_CHECK_ARG(a.tokens >= 0 && a.tokens <= 0x7fffffff,
                     w + "tokens must be in [0, 2^31) (one block a row), got " +
                         std::to_string(a.tokens));
  FUSEDIST_CHECK_ARG(a.x && a.out && a.scale, w + "x, out and scale must be non-null");
  FUSEDIST_CHECK_ARG(a.x % 16 == 0 && a.out % 16 == 0,
                     w + "x and out must be 16-byte aligned");
  FUSEDIST_CHECK_ARG(a.scale % 4 == 0, w + "scale must be 4-byte aligned (float32)");
  // Each thread stores its vector's `per` e4m3 bytes at once: out's row stride (bytes) is a
  // whole number of those.
  FUSEDIST_CHECK_ARG(a.in_stride % per == 0 && a.out_stride % per == 0 &&
                         a.in_stride >= a.k && a.out_stride >= a.k,
                     w + "row strides must be whole " + std::to_string(per) +
                         "-element vectors of at least a row");
  const int group_vec = a.group / per;
  FUSEDIST_CHECK_ARG(a.group == 0 || (a.group % per == 0 && a.k % a.group == 0 &&
                                      (group_vec == 8 || group_vec == 16 || group_vec == 32)),
                     w + "group must be 0 (a scale per row) or divide k into groups of 8, 16 "
                         "or 32 16-byte vectors, got group=" + std::to_string(a.group) +
                         " for k=" + std::to_string(a.k));
  if (a.tokens == 0) return;
  layers::QuantizeRowsParams p{};
  p.x = reinterpret_cast<const Vec16*>(a.x);
  p.out = reinterpret_cast<uint8_t*>(a.out);
  p.scale = reinterpret_cast<float*>(a.scale);
  p.vectors = a.k / per;
  p.in_stride = a.in_stride / per;
  p.out_stride = a.out_stride;
  p.groups = a.group ? a.k / a.group : 1;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (a.group) {
    switch (a.dtype) {
      case DType::kFloat32: launch_groups<float>(p, a.tokens, group_vec, s); break;
      case DType::kFloat16: launch_groups<__half>(p, a.tokens, group_vec, s); break;
      default: launch_groups<__nv_bfloat16>(p, a.tokens, group_vec, s); break;
    }
    return;
  }
  switch (a.dtype) {
    case DType::kFloat32: launch<float>(p, a.tokens, s); break;
    case DType::kFloat16: launch<__half>(p, a.tokens, s); break;
    default: launch<__nv_bfloat16>(p, a.tokens, s); break;
  }
}

}  // namespace fusedist
