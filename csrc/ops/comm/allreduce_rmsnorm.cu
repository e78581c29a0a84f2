// Host launcher for the fused one-shot all-reduce + residual add + RMSNorm kernel.
#include "fusedist/comm/allreduce_rmsnorm.cuh"
#include "fusedist/comm/api.h"
#include "fusedist/common/launch.h"

namespace fusedist {

namespace {
constexpr int kMaxRmsNormVectors = 2 * 1024;  // 16-byte vectors per row: 2 per thread x 1024

template <typename T, int kVpt>
void launch_vpt(const SymmComm& c, uintptr_t x, uintptr_t residual, uintptr_t weight,
                uintptr_t normed, uintptr_t residual_out, uintptr_t scales, int tokens,
                int hidden, float eps, bool fp8, int threads, cudaStream_t s) {
  const int grid = std::max(1, std::min(tokens, c.max_blocks));
  auto go = [&](auto kernel) {
    launch_kernel("allreduce_rmsnorm_kernel", kernel, grid, threads, s, c.view,
                  reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(residual),
                  reinterpret_cast<const T*>(weight), reinterpret_cast<T*>(normed),
                  reinterpret_cast<T*>(residual_out), reinterpret_cast<__nv_fp8_e4m3*>(normed),
                  reinterpret_cast<float*>(scales), tokens, hidden, eps);
  };
  if (fp8)
    go(allreduce_rmsnorm_kernel<T, kVpt, true>);
  else
    go(allreduce_rmsnorm_kernel<T, kVpt, false>);
}

template <typename T>
void launch(const SymmComm& c, uintptr_t x, uintptr_t residual, uintptr_t weight,
            uintptr_t normed, uintptr_t residual_out, uintptr_t scales, int tokens, int hidden,
            float eps, bool fp8, cudaStream_t s) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int hv = hidden / kPer;
  // Fewest vectors per thread that fit the row in one block of <= 1024 threads. Two is the
  // most: at four the row no longer fits the 64 registers a 1024-thread block allows
  // (ptxas spilled ~600 bytes), so wider rows take the unfused path in Python.
  const int vpt = hv <= 1024 ? 1 : 2;
  const int threads = std::max(32, ((hv + vpt - 1) / vpt + 31) / 32 * 32);
  if (vpt == 1)
    launch_vpt<T, 1>(c, x, residual, weight, normed, residual_out, scales, tokens, hidden, eps, fp8, threads, s);
  else
    launch_vpt<T, 2>(c, x, residual, weight, normed, residual_out, scales, tokens, hidden, eps, fp8, threads, s);
}
}  // namespace

void allreduce_rmsnorm(const SymmComm& c, uintptr_t x, uintptr_t residual, uintptr_t weight,
                       uintptr_t normed, uintptr_t residual_out, uintptr_t scales, int tokens,
                       int hidden, float eps, DType dtype, DType out_dtype, uintptr_t stream) {
  FUSEDIST_CHECK_ARG(tokens >= 0 && hidden > 0, "all_reduce_add_rmsnorm: bad shape");
  if (tokens == 0) return;
  const int per = 16 / dtype_size(dtype);
  FUSEDIST_CHECK_ARG(hidden % per == 0,
                     "all_reduce_add_rmsnorm: hidden (" + std::to_string(hidden) +
                         ") must be a multiple of " + std::to_string(per) + " for " +
                         dtype_name(dtype));
  FUSEDIST_CHECK_ARG(hidden / per <= kMaxRmsNormVectors,
                     "all_reduce_add_rmsnorm: hidden " + std::to_string(hidden) +
                         " too large for the fused kernel (at most " +
                         std::to_string(kMaxRmsNormVectors * per) + ")");
  FUSEDIST_CHECK_ARG(int64_t(tokens) * hidden <= allreduce_max_numel(c, dtype, AllReduceAlgo::kOneShot),
                     "all_reduce_add_rmsnorm: tokens x hidden exceeds the one-shot capacity");
  for (uintptr_t p : {x, residual, weight, normed, residual_out})
    FUSEDIST_CHECK_ARG(p % 16 == 0, "all_reduce_add_rmsnorm: tensors must be 16-byte aligned");
  const bool fp8 = out_dtype == DType::kFloat8E4M3;
  FUSEDIST_CHECK_ARG(fp8 || out_dtype == dtype,
                     "all_reduce_add_rmsnorm: out_dtype must be the input dtype or float8_e4m3fn");
  FUSEDIST_CHECK_ARG(!fp8 || scales != 0, "all_reduce_add_rmsnorm: fp8 output needs scales");
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: launch<float>(c, x, residual, weight, normed, residual_out, scales, tokens, hidden, eps, fp8, s); break;
    case DType::kFloat16: launch<__half>(c, x, residual, weight, normed, residual_out, scales, tokens, hidden, eps, fp8, s); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(c, x, residual, weight, normed, residual_out, scales, tokens, hidden, eps, fp8, s); break;
    default: throw std::invalid_argument("all_reduce_add_rmsnorm: unsupported dtype");
  }
}

}  // namespace fusedist
