// Launcher of the SiLU-and-multiply kernel (csrc/include/fusedist/layers/silu_mul.cuh):
// validates, picks the dtype and the output (T, or e4m3 + per-row scales: one block a row)
// and launches (programmatic dependent launch, launch.h).
#include <algorithm>
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/layers/api.h"
#include "fusedist/layers/silu_mul.cuh"

namespace fusedist {
namespace {

template <typename T>
void launch(const layers::SiluMulParams& p, cudaStream_t s) {
  const int col_blocks = (p.inter_vectors + layers::kSiluMulThreads - 1) / layers::kSiluMulThreads;
  const dim3 grid(unsigned(col_blocks),
                  unsigned(std::min<int64_t>(p.tokens, layers::kSiluMulMaxRowBlocks)));
  launch_kernel("silu_mul_kernel", layers::silu_mul_kernel<T>, grid,
                dim3(layers::kSiluMulThreads), s, p);
}

template <typename T>
void launch_fp8(const layers::SiluMulFp8Params& p, int64_t tokens, cudaStream_t s) {
  // A warp per 32 vectors of the row, at most kSiluMulFp8MaxThreads (wider rows loop).
  const int threads = std::min<int>((p.inter_vectors + 31) / 32 * 32,
                                    layers::kSiluMulFp8MaxThreads);
  launch_kernel("silu_mul_fp8_kernel", layers::silu_mul_fp8_kernel<T>, dim3(unsigned(tokens)),
                dim3(threads), s, p);
}

}  // namespace

void silu_mul(const SiluMulArgs& a, uintptr_t stream) {
  const std::string w = "silu_mul: ";
  FUSEDIST_CHECK_ARG(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat16 ||
                         a.dtype == DType::kBFloat16,
                     w + "dtype must be float32, float16 or bfloat16, got " + dtype_name(a.dtype));
  const int per = 16 / dtype_size(a.dtype);
  FUSEDIST_CHECK_ARG(a.inter > 0 && a.inter % 8 == 0,
                     w + "the intermediate size (half of gate_up's last dimension) must be a "
                         "positive multiple of 8, got " + std::to_string(a.inter));
  FUSEDIST_CHECK_ARG(a.tokens >= 0, w + "tokens must be >= 0");
  FUSEDIST_CHECK_ARG(a.gate_up && a.out, w + "gate_up and out must be non-null");
  FUSEDIST_CHECK_ARG(a.gate_up % 16 == 0 && a.out % 16 == 0,
                     w + "gate_up and out must be 16-byte aligned");
  const bool fp8 = a.fp8_out;
  FUSEDIST_CHECK_ARG(!fp8 || a.scale, w + "an FP8 output needs scale (float32 [tokens])");
  FUSEDIST_CHECK_ARG(fp8 || !a.scale,
                     w + "scale is only written with an FP8 output (fp8_out); pass scale = 0");
  FUSEDIST_CHECK_ARG(a.scale % 4 == 0, w + "scale must be 4-byte aligned (float32)");
  FUSEDIST_CHECK_ARG(!fp8 || a.tokens <= 0x7fffffff,
                     w + "an FP8 output takes tokens < 2^31 (one block a row), got " +
                         std::to_string(a.tokens));
  // FP8 out: each thread stores its vector's `per` e4m3 bytes at once, so out's row stride
  // (in e4m3 elements, bytes) is a whole number of those.
  FUSEDIST_CHECK_ARG(a.in_stride % per == 0 && a.out_stride % per == 0 &&
                         a.in_stride >= 2 * int64_t(a.inter) && a.out_stride >= a.inter,
                     w + "row strides must be whole " + std::to_string(per) +
                         "-element vectors of at least a row");
  if (a.tokens == 0) return;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (fp8) {
    layers::SiluMulFp8Params p{};
    p.gate_up = reinterpret_cast<const Vec16*>(a.gate_up);
    p.out = reinterpret_cast<uint8_t*>(a.out);
    p.scale = reinterpret_cast<float*>(a.scale);
    p.inter_vectors = a.inter / per;
    p.in_stride = a.in_stride / per;
    p.out_stride = a.out_stride;
    switch (a.dtype) {
      case DType::kFloat32: launch_fp8<float>(p, a.tokens, s); break;
      case DType::kFloat16: launch_fp8<__half>(p, a.tokens, s); break;
      default: launch_fp8<__nv_bfloat16>(p, a.tokens, s); break;
    }
    return;
  }
  layers::SiluMulParams p{};
  p.gate_up = reinterpret_cast<const Vec16*>(a.gate_up);
  p.out = reinterpret_cast<Vec16*>(a.out);
  p.tokens = a.tokens;
  p.inter_vectors = a.inter / per;
  p.in_stride = a.in_stride / per;
  p.out_stride = a.out_stride / per;
  switch (a.dtype) {
    case DType::kFloat32: launch<float>(p, s); break;
    case DType::kFloat16: launch<__half>(p, s); break;
    default: launch<__nv_bfloat16>(p, s); break;
  }
}

}  // namespace fusedist
