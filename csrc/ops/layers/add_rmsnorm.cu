// Launcher of the single-GPU residual add + RMSNorm (csrc/include/fusedist/layers/
// add_rmsnorm.cuh): validates, picks the (dtype, vectors per thread, residual, FP8 output)
// instantiation and launches one block per row with programmatic dependent launch (launch.h).
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/layers/add_rmsnorm.cuh"
#include "fusedist/layers/api.h"

namespace fusedist {
namespace {

using layers::AddRmsNormParams;
static_assert(layers::kRmsNormMaxVectors == kAddRmsNormMaxVectors, "keep in sync");

// Vectors per thread: the fewest that keep a block at <= 256 threads (8 warps: the reduction's
// one barrier stays cheap, and a T = 1 row still spreads its loads over 8 warps), at most 4
// (x, residual and weight of 4 vectors all in flight fit the registers); rows of 1K-2K
// vectors take up to 512 threads, and only wider ones 8 vectors a thread.
int auto_vpt(int hv) {
  int vpt = 1;
  while (vpt < 4 && (hv + vpt - 1) / vpt > 256) vpt *= 2;
  return (hv + vpt - 1) / vpt > layers::kRmsNormMaxThreads ? 8 : vpt;
}

template <typename T, int kVpt, bool kResidual>
void launch_out(const AddRmsNormParams& p, const dim3& grid, int threads, bool fp8,
                cudaStream_t s) {
  if (fp8)
    launch_kernel("add_rmsnorm_row_kernel",
                  layers::add_rmsnorm_row_kernel<T, kVpt, kResidual, true>, grid, dim3(threads),
                  s, p);
  else
    launch_kernel("add_rmsnorm_row_kernel",
                  layers::add_rmsnorm_row_kernel<T, kVpt, kResidual, false>, grid, dim3(threads),
                  s, p);
}

template <typename T, int kVpt>
void launch_vpt(const AddRmsNormParams& p, int64_t tokens, bool residual, bool fp8,
                cudaStream_t s) {
  const int hv = p.hidden / ElemTraits<T>::kPerVec;
  const int threads = ((hv + kVpt - 1) / kVpt + 31) / 32 * 32;
  FUSEDIST_CHECK_ARG(threads <= layers::kRmsNormMaxThreads,
                     "add_rmsnorm: vectors_per_thread " + std::to_string(kVpt) +
                         " is too few for hidden " + std::to_string(p.hidden));
  const dim3 grid{unsigned(tokens)};
  if (residual)
    launch_out<T, kVpt, true>(p, grid, threads, fp8, s);
  else
    launch_out<T, kVpt, false>(p, grid, threads, fp8, s);
}

template <typename T>
void launch(const AddRmsNormParams& p, int64_t tokens, bool residual, bool fp8, int vpt,
            cudaStream_t s) {
  switch (vpt) {
    case 1: launch_vpt<T, 1>(p, tokens, residual, fp8, s); break;
    case 2: launch_vpt<T, 2>(p, tokens, residual, fp8, s); break;
    case 4: launch_vpt<T, 4>(p, tokens, residual, fp8, s); break;
    default: launch_vpt<T, 8>(p, tokens, residual, fp8, s); break;
  }
}

bool aligned16(uintptr_t a) { return a % 16 == 0; }

}  // namespace

void add_rmsnorm(const AddRmsNormArgs& a, uintptr_t stream) {
  const std::string w = "add_rmsnorm: ";
  FUSEDIST_CHECK_ARG(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat16 ||
                         a.dtype == DType::kBFloat16,
                     w + "dtype must be float32, float16 or bfloat16, got " + dtype_name(a.dtype));
  const int per = 16 / dtype_size(a.dtype);
  FUSEDIST_CHECK_ARG(a.hidden > 0 && a.hidden % 8 == 0,
                     w + "hidden must be a positive multiple of 8, got " + std::to_string(a.hidden));
  FUSEDIST_CHECK_ARG(a.hidden / per <= kAddRmsNormMaxVectors,
                     w + "hidden " + std::to_string(a.hidden) + " exceeds the " +
                         std::to_string(kAddRmsNormMaxVectors * per) + " a " +
                         dtype_name(a.dtype) + " row can hold");
  FUSEDIST_CHECK_ARG(a.tokens >= 0 && a.tokens <= 0x7fffffff,
                     w + "tokens must be in [0, 2^31), got " + std::to_string(a.tokens));
  FUSEDIST_CHECK_ARG(a.vectors_per_thread == 0 || a.vectors_per_thread == 1 ||
                         a.vectors_per_thread == 2 || a.vectors_per_thread == 4 ||
                         a.vectors_per_thread == 8,
                     w + "vectors_per_thread must be 0 (auto), 1, 2, 4 or 8");
  FUSEDIST_CHECK_ARG(a.x && a.weight && a.out, w + "x, weight and out must be non-null");
  const bool residual = a.residual != 0;
  const bool fp8 = a.fp8_out;
  FUSEDIST_CHECK_ARG(!fp8 || a.scale, w + "an FP8 output needs scale (float32 [tokens])");
  FUSEDIST_CHECK_ARG(fp8 || !a.scale,
                     w + "scale is only written with an FP8 output (fp8_out); pass scale = 0");
  FUSEDIST_CHECK_ARG(aligned16(a.x) && aligned16(a.weight) && aligned16(a.out) &&
                         aligned16(a.residual),
                     w + "x, residual, weight and out must be 16-byte aligned");
  FUSEDIST_CHECK_ARG(a.scale % 4 == 0, w + "scale must be 4-byte aligned (float32)");
  // An FP8 row is hidden bytes: each thread stores its vector's `per` e4m3 bytes at once, so
  // its row stride is a whole number of those (hidden % 8 == 0 makes a packed row one).
  FUSEDIST_CHECK_ARG(a.x_stride % per == 0 && a.out_stride % per == 0 &&
                         a.residual_stride % per == 0 && a.x_stride >= a.hidden &&
                         a.out_stride >= a.hidden && (!residual || a.residual_stride >= a.hidden),
                     w + std::string(fp8 ? "row strides (out's in e4m3 bytes)" : "row strides") +
                         " must be whole " + std::to_string(per) + "-element vectors of at " +
                         "least hidden elements");
  if (a.tokens == 0) return;
  AddRmsNormParams p{};
  p.x = reinterpret_cast<const Vec16*>(a.x);
  p.residual = reinterpret_cast<Vec16*>(a.residual);
  p.weight = reinterpret_cast<const Vec16*>(a.weight);
  p.out = fp8 ? nullptr : reinterpret_cast<Vec16*>(a.out);
  p.out_fp8 = fp8 ? reinterpret_cast<uint8_t*>(a.out) : nullptr;
  p.scale = reinterpret_cast<float*>(a.scale);
  p.fp8_stride = fp8 ? a.out_stride : 0;
  p.hidden = a.hidden;
  p.x_stride = a.x_stride / per;
  p.residual_stride = a.residual_stride / per;
  p.out_stride = fp8 ? 0 : a.out_stride / per;
  p.eps = a.eps;
  const int vpt = a.vectors_per_thread ? a.vectors_per_thread : auto_vpt(a.hidden / per);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::kFloat32: launch<float>(p, a.tokens, residual, fp8, vpt, s); break;
    case DType::kFloat16: launch<__half>(p, a.tokens, residual, fp8, vpt, s); break;
    default: launch<__nv_bfloat16>(p, a.tokens, residual, fp8, vpt, s); break;
  }
}

}  // namespace fusedist
