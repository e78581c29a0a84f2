// Host launcher of the grouped decode GEMV (csrc/include/fusedist/gemm/grouped_gemv.cuh):
// argument checks, the plan (the worst case of `pairs` pairs: tasks, one wave of resident CTAs,
// the workspace), the instantiation (bf16 w; e4m3 w with a per-expert or per-channel scale in
// the epilogue; e4m3 w with 128 x 128 block scales: three kernels) and the launch
// (programmatic dependent launch, launch.h).
#include <algorithm>
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/gemm/grouped_gemv.cuh"
#include "fusedist/moe/grouped_gemm_api.h"

namespace fusedist {
namespace {

static_assert(kMoeGemvTaskRows == gemvk::kTaskRows, "api.h and grouped_gemv.cuh agree on rows");
static_assert(kMoeGemvMaxExperts == gemvk::kMaxExperts, "... and on the most experts");

using Kernel = void (*)(gemvk::GroupedParams);

struct Variant {
  Kernel kernel;
  int strip_rows, kunit;
};

template <bool kFp8, bool kBlock>
Variant variant() {
  using C = gemvk::Cfg<kFp8, gemvk::kTaskRows>;
  return {gemvk::grouped_gemv_kernel<kFp8, kBlock>, C::kBN, C::kKUnit};
}

Variant pick(const MoeGroupedGemmArgs& a) {
  if (a.w_dtype != DType::kFloat8E4M3) return variant<false, false>();
  return a.w_scale_mode == kMoeWScaleBlock ? variant<true, true>() : variant<true, false>();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The most tasks' chunks any routing of `pairs` pairs over `experts` experts has: the sum of
// ceil(c_e / 8) over the non-empty experts (at most min(experts, pairs) of them) is at most
// (pairs + 7 min(experts, pairs)) / 8.
int64_t max_chunks(int64_t pairs, int64_t experts) {
  return (pairs + (gemvk::kTaskRows - 1) * std::min(experts, pairs)) / gemvk::kTaskRows;
}

}  // namespace

std::string moe_grouped_gemv_why_not(const MoeGroupedGemmArgs& a) {
  const std::string w = "moe_grouped_gemv: ";
  if (a.x_dtype != DType::kBFloat16 || a.x_scale_mode != kMoeXScaleNone)
    return w + "x must be bfloat16 (an e4m3 x goes to the grouped GEMM), got " +
           dtype_name(a.x_dtype);
  const bool fp8 = a.w_dtype == DType::kFloat8E4M3;
  if (!fp8 && a.w_dtype != DType::kBFloat16)
    return w + "w must be bfloat16 or float8_e4m3fn, got " + dtype_name(a.w_dtype);
  if (a.w_scale_mode < kMoeWScaleNone || a.w_scale_mode > kMoeWScaleBlock ||
      (!fp8 && a.w_scale_mode != kMoeWScaleNone))
    return w + "w_scale_mode must be 0 (bf16 w) or 1 / 2 / 3 (e4m3 w: per expert, per channel, "
               "128 x 128 blocks), got " + std::to_string(a.w_scale_mode);
  if (a.experts < 1 || a.experts > kMoeGemvMaxExperts)
    return w + "experts must be in [1, " + std::to_string(kMoeGemvMaxExperts) + "], got " +
           std::to_string(a.experts);
  if (a.n < 1 || a.k < 1)
    return w + "n and k must be >= 1, got n=" + std::to_string(a.n) + ", k=" +
           std::to_string(a.k);
  const int per = 16 / dtype_size(a.w_dtype);
  if (a.k % per)
    return w + "k must be a multiple of " + std::to_string(per) + " for " +
           dtype_name(a.w_dtype) + " weights (16-byte rows), got " + std::to_string(a.k);
  if (a.ldx < a.k || a.ldx % 8)
    return w + "ldx (x's row stride) must be >= k and a multiple of 8 elements, got " +
           std::to_string(a.ldx);
  if (a.x % 16 || a.w % 16 || a.out % 2)
    return w + "x and w must be 16-byte aligned, out 2-byte aligned";
  if (a.w_scale_mode != kMoeWScaleNone && a.w_scale % 4)
    return w + "w_scale must be an aligned float32 pointer";
  if (a.rows < 0 || a.x_rows < 0 || a.pairs < 0 || a.rows >= (int64_t(1) << 31))
    return w + "rows, x_rows and pairs must be >= 0 (rows < 2^31)";
  if (a.gather && a.top_k < 1)
    return w + "gather needs top_k >= 1, got " + std::to_string(a.top_k);
  if (a.max_ctas < 0) return w + "max_ctas must be >= 0 (0: every resident CTA)";
  const Variant v = pick(a);
  const int64_t tasks = max_chunks(a.pairs, a.experts) * ceil_div(a.n, v.strip_rows);
  if (tasks * ceil_div(a.k, v.kunit) >= (int64_t(1) << 30))
    return w + "pairs x n x k is too large (more than 2^30 units of work)";
  return "";
}

MoeGroupedGemvPlan moe_grouped_gemv_plan(const MoeGroupedGemmArgs& a) {
  const std::string why = moe_grouped_gemv_why_not(a);
  FUSEDIST_CHECK_ARG(why.empty(), why);
  const Variant v = pick(a);
  MoeGroupedGemvPlan plan;
  plan.strip_rows = v.strip_rows;
  plan.max_tasks = max_chunks(a.pairs, a.experts) * ceil_div(a.n, v.strip_rows);
  const int64_t units = plan.max_tasks * ceil_div(a.k, v.kunit);
  plan.ctas_per_sm = blocks_per_sm(reinterpret_cast<const void*>(v.kernel), gemvk::kThreads, 0);
  int64_t grid = int64_t(current_device_sm_count()) * plan.ctas_per_sm;
  if (a.max_ctas > 0) grid = std::min<int64_t>(grid, a.max_ctas);
  plan.grid = int(std::max<int64_t>(1, std::min(grid, units)));
  plan.partial_floats = 2 * int64_t(plan.grid) * gemvk::kTaskRows * v.strip_rows;
  plan.counters = std::max<int64_t>(1, plan.max_tasks);
  return plan;
}

void moe_grouped_gemv(const MoeGroupedGemmArgs& a, uintptr_t stream) {
  const std::string w = "moe_grouped_gemv: ";
  const MoeGroupedGemvPlan plan = moe_grouped_gemv_plan(a);  // checks the call
  FUSEDIST_CHECK_ARG(a.x && a.w && a.out && a.counts && a.offsets,
                     w + "x, w, out, counts and offsets must be non-null");
  FUSEDIST_CHECK_ARG(!a.gather || a.src_index, w + "gather needs src_index");
  FUSEDIST_CHECK_ARG(a.w_scale_mode == kMoeWScaleNone || a.w_scale,
                     w + "w_scale must be non-null for an e4m3 w with scales");
  FUSEDIST_CHECK_ARG(a.partial && a.partial % 16 == 0 && a.partial_floats >= plan.partial_floats,
                     w + "partial must hold >= " + std::to_string(plan.partial_floats) +
                         " floats (moe_grouped_gemv_plan), got " +
                         std::to_string(a.partial_floats));
  FUSEDIST_CHECK_ARG(a.counters && a.counters % 4 == 0 && a.counters_len >= plan.counters,
                     w + "counters must hold >= " + std::to_string(plan.counters) +
                         " zeroed int32 (moe_grouped_gemv_plan), got " +
                         std::to_string(a.counters_len));
  if (a.pairs == 0 || a.rows == 0) return;
  const Variant v = pick(a);
  const int wbytes = dtype_size(a.w_dtype);
  gemvk::GroupedParams p{};
  p.x = reinterpret_cast<const __nv_bfloat16*>(a.x);
  p.w = reinterpret_cast<const uint8_t*>(a.w);
  p.scale = a.w_scale_mode == kMoeWScaleNone ? nullptr : reinterpret_cast<const float*>(a.w_scale);
  p.out = reinterpret_cast<__nv_bfloat16*>(a.out);
  p.counts = reinterpret_cast<const int*>(a.counts);
  p.offsets = reinterpret_cast<const int*>(a.offsets);
  p.src_index = reinterpret_cast<const int*>(a.src_index);
  p.partial = reinterpret_cast<float*>(a.partial);
  p.counters = reinterpret_cast<int*>(a.counters);
  p.ldx = a.ldx;
  p.ldw_bytes = int64_t(a.k) * wbytes;
  p.ldo = a.n;
  p.w_expert_bytes = int64_t(a.n) * a.k * wbytes;
  const int64_t kb = ceil_div(a.k, gemvk::kScaleBlock), nb = ceil_div(a.n, gemvk::kScaleBlock);
  switch (a.w_scale_mode) {
    case kMoeWScaleExpert: p.scale_expert_stride = 1, p.scale_ld = 0, p.epi_scale = 1; break;
    case kMoeWScaleChannel: p.scale_expert_stride = a.n, p.scale_ld = 1, p.epi_scale = 1; break;
    case kMoeWScaleBlock: p.scale_expert_stride = nb * kb, p.scale_ld = kb, p.epi_scale = 0; break;
    default: p.scale_expert_stride = 0, p.scale_ld = 0, p.epi_scale = 0;
  }
  p.rows = a.rows;
  p.x_rows = a.x_rows;
  p.n = a.n, p.k = a.k, p.experts = a.experts, p.top_k = a.top_k, p.gather = a.gather;
  p.kunits = int(ceil_div(a.k, v.kunit));
  p.strips = int(ceil_div(a.n, v.strip_rows));
  p.max_tasks = plan.max_tasks;
  launch_kernel("grouped_gemv_kernel", v.kernel, dim3(unsigned(plan.grid)),
                dim3(gemvk::kThreads), reinterpret_cast<cudaStream_t>(stream), p);
}

}  // namespace fusedist
