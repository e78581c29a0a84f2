// Host launcher of the MoE grouped GEMM (csrc/include/fusedist/gemm/grouped_gemm_sm90.cuh):
// the checks of a call, its form (bf16; e4m3 with per-row x per-expert / per-channel scales;
// e4m3 with 1 x 128 / 128 x 128 block scales) and the dispatch to that form's translation unit
// (grouped_gemm_{bf16,fp8,fp8_block}.cu: one CUTLASS instantiation each).
#include <string>

#include "fusedist/moe/grouped_gemm_api.h"

namespace fusedist {

int64_t moe_grouped_gemm_bf16_workspace(const MoeGroupedGemmArgs& a);
void moe_grouped_gemm_bf16_run(const MoeGroupedGemmArgs& a, cudaStream_t stream);
int64_t moe_grouped_gemm_fp8_workspace(const MoeGroupedGemmArgs& a);
void moe_grouped_gemm_fp8_run(const MoeGroupedGemmArgs& a, cudaStream_t stream);
int64_t moe_grouped_gemm_fp8_block_workspace(const MoeGroupedGemmArgs& a);
void moe_grouped_gemm_fp8_block_run(const MoeGroupedGemmArgs& a, cudaStream_t stream);

namespace {

enum class Form { kNone, kBf16, kFp8, kFp8Block };

Form form_of(const MoeGroupedGemmArgs& a) {
  const bool x8 = a.x_dtype == DType::kFloat8E4M3, w8 = a.w_dtype == DType::kFloat8E4M3;
  if (a.x_dtype == DType::kBFloat16 && a.w_dtype == DType::kBFloat16 &&
      a.x_scale_mode == kMoeXScaleNone && a.w_scale_mode == kMoeWScaleNone)
    return Form::kBf16;
  if (x8 && w8 && a.x_scale_mode == kMoeXScaleRow &&
      (a.w_scale_mode == kMoeWScaleExpert || a.w_scale_mode == kMoeWScaleChannel))
    return Form::kFp8;
  if (x8 && w8 && a.x_scale_mode == kMoeXScaleGroup && a.w_scale_mode == kMoeWScaleBlock)
    return Form::kFp8Block;
  return Form::kNone;
}

}  // namespace

std::string moe_grouped_gemm_why_not(const MoeGroupedGemmArgs& a) {
  const std::string w = "moe_grouped_gemm: ";
  const Form f = form_of(a);
  if (f == Form::kNone)
    return w + "takes bf16 x with bf16 w, an e4m3 x with per-row scales and e4m3 w with "
               "per-expert or per-channel scales, or an e4m3 x with per-128-k scales and "
               "128 x 128 block-scaled w; got x " + dtype_name(a.x_dtype) + " (x_scale_mode " +
           std::to_string(a.x_scale_mode) + "), w " + dtype_name(a.w_dtype) +
           " (w_scale_mode " + std::to_string(a.w_scale_mode) + ")";
  if (a.gather)
    return w + "x must be the permuted rows (gather x first; the grouped GEMV reads a "
               "token-order x)";
  if (a.experts < 1 || a.n < 1 || a.k < 1)
    return w + "experts, n and k must be >= 1, got experts=" + std::to_string(a.experts) +
           ", n=" + std::to_string(a.n) + ", k=" + std::to_string(a.k);
  if (a.rows < 0 || a.rows >= (int64_t(1) << 31) || a.x_rows != a.rows)
    return w + "x must have the layout's rows (0 <= rows < 2^31), got x_rows=" +
           std::to_string(a.x_rows) + ", rows=" + std::to_string(a.rows);
  const int xb = dtype_size(a.x_dtype);
  if (a.k % (16 / xb) || a.n % 8)
    return w + "k must be a multiple of " + std::to_string(16 / xb) + " and n of 8 (16-byte " +
           "TMA rows of " + dtype_name(a.x_dtype) + " operands and of the bf16 out), got n=" +
           std::to_string(a.n) + ", k=" + std::to_string(a.k);
  if (f == Form::kFp8Block && a.k % 128)
    return w + "block scales need k % 128 == 0 (x's scales cover 128 k each), got k=" +
           std::to_string(a.k);
  if (a.ldx < a.k || (a.ldx * xb) % 16)
    return w + "ldx (x's row stride) must be >= k and a multiple of 16 bytes, got " +
           std::to_string(a.ldx);
  if (a.x % 16 || a.w % 16 || a.out % 16)
    return w + "x, w and out must be 16-byte aligned";
  if (f != Form::kBf16 && (a.x_scale % 4 || a.w_scale % 4))
    return w + "x_scale and w_scale must be aligned float32 pointers";
  if (a.counts % 4 || a.offsets % 4) return w + "counts and offsets must be aligned int32";
  return "";
}

int64_t moe_grouped_gemm_workspace_size(const MoeGroupedGemmArgs& a) {
  const std::string why = moe_grouped_gemm_why_not(a);
  FUSEDIST_CHECK_ARG(why.empty(), why);
  switch (form_of(a)) {
    case Form::kBf16: return moe_grouped_gemm_bf16_workspace(a);
    case Form::kFp8: return moe_grouped_gemm_fp8_workspace(a);
    case Form::kFp8Block: return moe_grouped_gemm_fp8_block_workspace(a);
    default: return 0;
  }
}

void moe_grouped_gemm(const MoeGroupedGemmArgs& a, uintptr_t stream) {
  const std::string why = moe_grouped_gemm_why_not(a);
  FUSEDIST_CHECK_ARG(why.empty(), why);
  const Form f = form_of(a);
  FUSEDIST_CHECK_ARG(a.x && a.w && a.out && a.counts && a.offsets,
                     "moe_grouped_gemm: x, w, out, counts and offsets must be non-null");
  FUSEDIST_CHECK_ARG(f == Form::kBf16 || (a.x_scale && a.w_scale),
                     "moe_grouped_gemm: the e4m3 forms need x_scale and w_scale");
  if (a.rows == 0) return;
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  switch (f) {
    case Form::kBf16: moe_grouped_gemm_bf16_run(a, st); break;
    case Form::kFp8: moe_grouped_gemm_fp8_run(a, st); break;
    case Form::kFp8Block: moe_grouped_gemm_fp8_block_run(a, st); break;
    default: break;
  }
}

}  // namespace fusedist
