// Host launcher of the decode GEMV (csrc/include/fusedist/gemm/gemv.cuh): argument checks, the
// plan (one wave of resident CTAs over the stream-K units; the workspace the partial strips
// need, the ring's depth and shared memory), the instantiation (weight dtype x x rows padded to
// 8 or 16 x block scales x register pipeline or ring: twelve kernels; e4m3 x with e4m3 weights,
// rows padded to 32 or 64: two more) and the launch (programmatic dependent launch,
// launch.h).
#include <algorithm>
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/gemm/api.h"
#include "fusedist/gemm/gemv.cuh"

namespace fusedist {
namespace {

static_assert(kGemvMaxM == gemvk::kMaxM, "api.h and gemv.cuh agree on the largest M");
static_assert(kGemvScaleBlockSize == gemvk::kScaleBlock, "api.h and gemv.cuh agree on blocks");
static_assert(kGemvMaxStages == gemvk::kMaxStages, "api.h and gemv.cuh agree on ring stages");

using Kernel = void (*)(gemvk::Params);

// One instantiation: the kernel, its strip geometry and the bytes of one ring stage.
struct Variant {
  Kernel kernel;
  int strip_rows, kunit, stage_bytes;
};

template <bool kFp8, int kMp, bool kBlock>
Variant variant(bool ring) {
  using C = gemvk::Cfg<kFp8, kMp>;
  return {ring ? gemvk::gemv_kernel<kFp8, kMp, kBlock, true>
               : gemvk::gemv_kernel<kFp8, kMp, kBlock, false>,
          C::kBN, C::kKUnit, gemvk::Ring<kFp8, kMp>::kStageBytes};
}

// e4m3 x (W8A8): the register pipeline only, x rows padded to 32 or 64.
template <int kMp>
Variant variant_x8() {
  using C = gemvk::Cfg<true, kMp>;
  return {gemvk::gemv_kernel<true, kMp, false, false, true>, C::kBN, C::kKUnit, 0};
}

Variant pick(bool fp8, int m, int scale_mode, bool ring, bool x_fp8 = false) {
  if (x_fp8) return m > 32 ? variant_x8<64>() : variant_x8<32>();
  const bool wide = m > 8;
  if (!fp8) return wide ? variant<false, 16, false>(ring) : variant<false, 8, false>(ring);
  if (scale_mode == kGemvScaleBlock)
    return wide ? variant<true, 16, true>(ring) : variant<true, 8, true>(ring);
  return wide ? variant<true, 16, false>(ring) : variant<true, 8, false>(ring);
}

// Shared memory a gemv CTA declares statically (the flush buffer, barriers): kept free of the
// ring.
constexpr int kStaticSmemReserve = 10 * 1024;

// The largest dynamic shared memory one CTA may opt into on the current device.
int max_dynamic_smem() {
  int dev = 0, v = 0;
  FUSEDIST_CUDA_CHECK(cudaGetDevice(&dev));
  FUSEDIST_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return v;
}

// Ring stages of a call: args.stages, or the default for kGemvStagesAuto.
int stages_of(const GemvArgs& a) {
  if (a.x_dtype == DType::kFloat8E4M3) return 0;
  return a.stages == kGemvStagesAuto ? kGemvDefaultStages : a.stages;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Shape, dtype and mode checks: no CUDA call, so they raise the same on a machine without a
// driver.
void check_call(const GemvArgs& a) {
  const std::string w = "gemv: ";
  const bool x_fp8 = a.x_dtype == DType::kFloat8E4M3;
  FUSEDIST_CHECK_ARG(a.x_dtype == DType::kBFloat16 || x_fp8,
                     w + "x_dtype must be bfloat16 or float8_e4m3fn, got " + dtype_name(a.x_dtype));
  const int max_m = x_fp8 ? kGemvMaxMFp8X : kGemvMaxM;
  FUSEDIST_CHECK_ARG(a.m >= 1 && a.m <= max_m,
                     w + "m (rows of x) must be in [1, " + std::to_string(max_m) + "] for " +
                         dtype_name(a.x_dtype) + " x, got " + std::to_string(a.m));
  FUSEDIST_CHECK_ARG(a.n >= 1, w + "n (rows of w) must be >= 1, got " + std::to_string(a.n));
  FUSEDIST_CHECK_ARG(a.k >= 1, w + "k (columns of x and w) must be >= 1, got " +
                                   std::to_string(a.k));
  FUSEDIST_CHECK_ARG(a.dtype == DType::kBFloat16,
                     w + "dtype (x, bias, out) must be bfloat16, got " + dtype_name(a.dtype));
  FUSEDIST_CHECK_ARG(a.w_dtype == DType::kBFloat16 || a.w_dtype == DType::kFloat8E4M3,
                     w + "w_dtype must be bfloat16 or float8_e4m3fn, got " +
                         dtype_name(a.w_dtype));
  const bool fp8 = a.w_dtype == DType::kFloat8E4M3;
  const int per = 16 / dtype_size(a.w_dtype);
  FUSEDIST_CHECK_ARG(a.k % per == 0,
                     w + "k (columns of x and w) must be a multiple of " + std::to_string(per) +
                         " for " + dtype_name(a.w_dtype) + " weights (16-byte rows), got " +
                         std::to_string(a.k));
  FUSEDIST_CHECK_ARG(a.scale_mode >= kGemvScaleNone && a.scale_mode <= kGemvScaleBlock,
                     w + "scale_mode must be 0 (none), 1 (tensor), 2 (channel) or 3 (block), "
                         "got " + std::to_string(a.scale_mode));
  FUSEDIST_CHECK_ARG(fp8 || a.scale_mode == kGemvScaleNone,
                     w + "scale_mode: scales are for float8_e4m3fn weights only");
  FUSEDIST_CHECK_ARG(!x_fp8 || (fp8 && a.scale_mode != kGemvScaleBlock),
                     w + "an e4m3 x (x_dtype) takes e4m3 weights with tensor or channel scales "
                         "(or none), not bf16 weights or block scales");
  FUSEDIST_CHECK_ARG(!x_fp8 || a.stages == kGemvStagesAuto || a.stages == 0,
                     w + "an e4m3 x runs the register pipeline: stages must be -1 or 0, got " +
                         std::to_string(a.stages));
  FUSEDIST_CHECK_ARG(a.max_ctas >= 0, w + "max_ctas must be >= 0 (0: all resident CTAs)");
  FUSEDIST_CHECK_ARG(a.stages == kGemvStagesAuto || (a.stages >= 0 && a.stages <= kGemvMaxStages),
                     w + "stages must be -1 (auto), 0 (register pipeline) or 1.." +
                         std::to_string(kGemvMaxStages) + " (shared-memory ring), got " +
                         std::to_string(a.stages));
}

}  // namespace

GemvPlan gemv_plan(const GemvArgs& a) {
  check_call(a);
  int stages = stages_of(a);
  const bool x_fp8 = a.x_dtype == DType::kFloat8E4M3;
  const Variant v = pick(a.w_dtype == DType::kFloat8E4M3, a.m, a.scale_mode, stages > 0, x_fp8);
  if (stages > 0) {  // as deep as asked, as far as one CTA's shared memory allows
    const int most = std::max(1, (max_dynamic_smem() - kStaticSmemReserve) / v.stage_bytes);
    stages = std::min(stages, most);
  }
  GemvPlan plan;
  plan.strip_rows = v.strip_rows;
  plan.stages = stages;
  plan.smem_bytes = stages * v.stage_bytes;
  const int64_t strips = ceil_div(a.n, v.strip_rows);
  const int64_t kunits = ceil_div(a.k, v.kunit);
  FUSEDIST_CHECK_ARG(strips * kunits < (int64_t(1) << 30),
                     "gemv: n x k is too large (more than 2^30 units)");
  const int units = int(strips * kunits);
  plan.ctas_per_sm = blocks_per_sm(reinterpret_cast<const void*>(v.kernel), gemvk::kThreads,
                                   plan.smem_bytes);
  int64_t grid = int64_t(current_device_sm_count()) * plan.ctas_per_sm;
  if (a.max_ctas > 0) grid = std::min<int64_t>(grid, a.max_ctas);
  grid = std::min<int64_t>(grid, units);
  plan.grid = int(grid);
  plan.units = units;
  // A strip is split when a CTA's range starts inside it.
  bool split = false;
  const int64_t q = units / grid, r = units % grid;  // CTA c starts at c q + min(c, r)
  for (int64_t c = 1; c < grid && !split; ++c) split = (c * q + std::min(c, r)) % kunits != 0;
  if (split) {
    plan.workspace_floats = 2 * grid * a.m * v.strip_rows;
    plan.counters = strips;
  }
  return plan;
}

void gemv(const GemvArgs& a, uintptr_t stream) {
  check_call(a);
  const std::string w = "gemv: ";
  const bool fp8 = a.w_dtype == DType::kFloat8E4M3;
  const int wbytes = dtype_size(a.w_dtype);
  FUSEDIST_CHECK_ARG(a.x && a.w && a.out, w + "x, w and out must be non-null");
  FUSEDIST_CHECK_ARG(a.x % 16 == 0 && a.w % 16 == 0, w + "x and w must be 16-byte aligned");
  const bool x_fp8 = a.x_dtype == DType::kFloat8E4M3;
  const int x_per = x_fp8 ? 16 : 8;  // x elements per 16-byte vector
  FUSEDIST_CHECK_ARG(a.ldx >= a.k && a.ldx % x_per == 0,
                     w + "ldx (x's row stride) must be >= k and a multiple of " +
                         std::to_string(x_per) + " elements, got " + std::to_string(a.ldx));
  FUSEDIST_CHECK_ARG(!x_fp8 || (a.x_scale && a.x_scale % 4 == 0),
                     w + "an e4m3 x needs x_scale, a non-null aligned float32 [m] pointer");
  FUSEDIST_CHECK_ARG(a.ldw >= a.k && a.ldw * wbytes % 16 == 0,
                     w + "ldw (w's row stride) must be >= k and whole 16-byte vectors, got " +
                         std::to_string(a.ldw));
  FUSEDIST_CHECK_ARG(a.ldo >= a.n, w + "ldo (out's row stride) must be >= n, got " +
                                       std::to_string(a.ldo));
  FUSEDIST_CHECK_ARG(a.out % 2 == 0 && a.bias % 2 == 0,
                     w + "out and bias must be aligned to their bfloat16 elements");
  if (a.scale_mode != kGemvScaleNone)
    FUSEDIST_CHECK_ARG(a.scale && a.scale % 4 == 0,
                       w + "scale must be a non-null, aligned float32 pointer for scale_mode " +
                           std::to_string(a.scale_mode));
  if (a.scale_mode == kGemvScaleBlock)
    FUSEDIST_CHECK_ARG(a.scale_ld >= ceil_div(a.k, kGemvScaleBlockSize),
                       w + "scale_ld (floats between block-scale rows) must be >= ceil(k / 128) = " +
                           std::to_string(ceil_div(a.k, kGemvScaleBlockSize)) + ", got " +
                           std::to_string(a.scale_ld));
  const GemvPlan plan = gemv_plan(a);
  if (plan.workspace_floats > 0) {
    FUSEDIST_CHECK_ARG(a.workspace && a.workspace % 4 == 0 &&
                           a.workspace_floats >= plan.workspace_floats,
                       w + "workspace must hold >= " + std::to_string(plan.workspace_floats) +
                           " floats (gemv_plan), got " + std::to_string(a.workspace_floats));
    FUSEDIST_CHECK_ARG(a.counters && a.counters % 4 == 0 && a.counters_len >= plan.counters,
                       w + "counters must hold >= " + std::to_string(plan.counters) +
                           " zeroed int32 (gemv_plan), got " + std::to_string(a.counters_len));
  }
  gemvk::Params p{};
  p.x = reinterpret_cast<const __nv_bfloat16*>(a.x);  // e4m3 bytes for an e4m3 x
  p.x_scale = reinterpret_cast<const float*>(a.x_scale);
  p.w = reinterpret_cast<const uint8_t*>(a.w);
  p.scale = reinterpret_cast<const float*>(a.scale);
  p.bias = reinterpret_cast<const __nv_bfloat16*>(a.bias);
  p.out = reinterpret_cast<__nv_bfloat16*>(a.out);
  p.partial = reinterpret_cast<float*>(a.workspace);
  p.counters = reinterpret_cast<int*>(a.counters);
  p.ldx = a.ldx;
  p.ldw_bytes = a.ldw * wbytes;
  p.ldo = a.ldo;
  p.scale_ld = a.scale_mode == kGemvScaleChannel ? 1
               : a.scale_mode == kGemvScaleBlock ? a.scale_ld
                                                 : 0;
  p.m = a.m, p.n = a.n, p.k = a.k;
  const Variant v = pick(fp8, a.m, a.scale_mode, plan.stages > 0, x_fp8);
  p.stages = plan.stages;
  p.kunits = int(ceil_div(a.k, v.kunit));
  p.units = plan.units;
  p.epi_scale = a.scale_mode == kGemvScaleTensor || a.scale_mode == kGemvScaleChannel;
  launch_kernel_smem("gemv_kernel", v.kernel, dim3(unsigned(plan.grid)), dim3(gemvk::kThreads),
                     size_t(plan.smem_bytes), reinterpret_cast<cudaStream_t>(stream), p);
}

}  // namespace fusedist
