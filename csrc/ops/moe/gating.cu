// Launchers of the MoE routing and layout kernels (csrc/include/fusedist/moe/gating.cuh):
// validate, pick the instantiation (registers of experts per lane) and launch with programmatic
// dependent launch (launch.h).
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "fusedist/common/launch.h"
#include "fusedist/moe/api.h"
#include "fusedist/moe/gating.cuh"

namespace fusedist {
namespace {

static_assert(kMoeMaxExperts == moe::kMaxExperts && kMoeMaxTopK == moe::kMaxTopK &&
                  kMoeMaxGroups == moe::kMaxGroups &&
                  kMoeSortSmallMaxPairs == moe::kSortSmallMaxPairs,
              "api.h and gating.cuh limits");
static_assert(kMoeSortChunkQuantum == moe::kSortThreads, "a chunk is whole CTAs of pairs");

// Registers of experts per lane: the power of two >= ceil(experts / 32) (1 .. 32).
int iters_for(int experts) {
  int it = 1;
  while (it * 32 < experts) it *= 2;
  return it;
}

void check_gating(const MoeGatingArgs& a, const std::string& w) {
  const std::string why = moe_gating_why_not(a.experts, a.top_k, a.num_groups);
  FUSEDIST_CHECK_ARG(why.empty(), w + why);
  FUSEDIST_CHECK_ARG(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat16 ||
                         a.dtype == DType::kBFloat16,
                     w + "logits dtype must be float32, float16 or bfloat16, got " +
                         dtype_name(a.dtype));
  FUSEDIST_CHECK_ARG(a.tokens >= 0 && a.tokens <= 0x7fffffff / kMoeMaxTopK,
                     w + "tokens must be in [0, 2^31 / 32), got " + std::to_string(a.tokens));
  FUSEDIST_CHECK_ARG(a.logit_stride >= a.experts,
                     w + "logit_stride must be >= experts (" + std::to_string(a.experts) +
                         "), got " + std::to_string(a.logit_stride));
  FUSEDIST_CHECK_ARG(a.scoring == moe::kScoringSoftmax || a.scoring == moe::kScoringSigmoid,
                     w + "scoring must be 0 (softmax) or 1 (sigmoid), got " +
                         std::to_string(a.scoring));
  if (a.num_groups > 1) {
    const int group = a.experts / a.num_groups;
    FUSEDIST_CHECK_ARG(a.topk_groups >= 1 && a.topk_groups <= a.num_groups,
                       w + "topk_groups must be in [1, num_groups], got " +
                           std::to_string(a.topk_groups));
    FUSEDIST_CHECK_ARG(a.top_k <= a.topk_groups * group,
                       w + "top_k exceeds the experts of the topk_groups groups");
    FUSEDIST_CHECK_ARG(a.scoring != moe::kScoringSigmoid || group >= 2,
                       w + "group-limited sigmoid routing needs >= 2 experts a group");
  }
  FUSEDIST_CHECK_ARG(std::isfinite(a.routed_scaling) && a.routed_scaling > 0.f,
                     w + "routed_scaling must be positive and finite");
  if (a.tokens > 0) {
    FUSEDIST_CHECK_ARG(a.logits && a.ids && a.weights,
                       w + "logits, ids and weights must be non-null");
    FUSEDIST_CHECK_ARG(a.logits % dtype_size(a.dtype) == 0 && a.ids % 4 == 0 &&
                           a.weights % 4 == 0 && a.bias % 4 == 0,
                       w + "logits, ids, weights and bias must be aligned to their elements");
  }
}

moe::GatingParams gating_params(const MoeGatingArgs& a) {
  moe::GatingParams p{};
  p.logits = reinterpret_cast<const void*>(a.logits);
  p.logit_stride = a.logit_stride;
  p.dtype = int(a.dtype);
  p.bias = reinterpret_cast<const float*>(a.bias);
  p.ids = reinterpret_cast<int32_t*>(a.ids);
  p.weights = reinterpret_cast<float*>(a.weights);
  p.tokens = int(a.tokens);
  p.experts = a.experts;
  p.top_k = a.top_k;
  p.scoring = a.scoring;
  p.renormalize = a.renormalize ? 1 : 0;
  p.num_groups = a.num_groups;
  p.topk_groups = a.num_groups > 1 ? a.topk_groups : 1;
  p.routed_scaling = a.routed_scaling;
  return p;
}

void check_sort(const MoeSortArgs& a, const std::string& w, bool need_ids) {
  FUSEDIST_CHECK_ARG(a.experts >= 1 && a.experts <= kMoeMaxExperts,
                     w + "experts must be in [1, " + std::to_string(kMoeMaxExperts) + "], got " +
                         std::to_string(a.experts));
  FUSEDIST_CHECK_ARG(a.top_k >= 1, w + "top_k must be >= 1");
  FUSEDIST_CHECK_ARG(a.align >= 1, w + "align must be >= 1");
  FUSEDIST_CHECK_ARG(a.tokens >= 0 && a.tokens * a.top_k <= 0x7fffffff,
                     w + "tokens * top_k must be in [0, 2^31)");
  const int64_t pairs = a.tokens * a.top_k;
  const int64_t need = pairs + std::min<int64_t>(a.experts, pairs) * (a.align - 1);
  FUSEDIST_CHECK_ARG(a.rows >= need && a.rows <= 0x7fffffff,
                     w + "rows must be >= " + std::to_string(need) +
                         " (every routing's rows: tokens * top_k + min(experts, tokens * top_k) "
                         "* (align - 1)) and < 2^31, got " + std::to_string(a.rows));
  FUSEDIST_CHECK_ARG(a.counts && a.offsets && (a.rows == 0 || a.src_index) &&
                         (pairs == 0 || a.dest_index) && (!need_ids || pairs == 0 || a.ids),
                     w + "ids, counts, offsets, src_index and dest_index must be non-null");
  FUSEDIST_CHECK_ARG(a.counts % 4 == 0 && a.offsets % 4 == 0 && a.src_index % 4 == 0 &&
                         a.dest_index % 4 == 0 && a.ids % (a.ids_int64 ? 8 : 4) == 0,
                     w + "ids, counts, offsets, src_index and dest_index must be aligned to "
                         "their elements");
}

moe::SortParams sort_params(const MoeSortArgs& a) {
  moe::SortParams p{};
  p.ids = reinterpret_cast<const void*>(a.ids);
  p.ids_int64 = a.ids_int64 ? 1 : 0;
  p.pairs = int(a.tokens * a.top_k);
  p.top_k = a.top_k;
  p.experts = a.experts;
  p.align = a.align;
  p.rows = int(a.rows);
  p.counts = reinterpret_cast<int32_t*>(a.counts);
  p.offsets = reinterpret_cast<int32_t*>(a.offsets);
  p.src_index = reinterpret_cast<int32_t*>(a.src_index);
  p.dest_index = reinterpret_cast<int32_t*>(a.dest_index);
  p.ws = reinterpret_cast<int32_t*>(a.workspace);
  p.chunk_pairs = a.chunk_pairs;
  p.chunks = a.chunk_pairs > 0 ? int((p.pairs + a.chunk_pairs - 1) / a.chunk_pairs) : 0;
  p.err = reinterpret_cast<OpErrorRecord*>(a.err);
  return p;
}

// Launch a kernel of dynamic shared memory `smem` bytes, raising its limit first when above the
// default 48 KB (launch.h blocks_per_sm raises it once per kernel, size and device).
template <typename... KArgs, typename... Args>
void launch_smem(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                 cudaStream_t s, Args&&... args) {
  if (smem > 48 * 1024)
    blocks_per_sm(reinterpret_cast<const void*>(kernel), int(block.x), int(smem));
  launch_kernel_smem(name, kernel, grid, block, smem, s, std::forward<Args>(args)...);
}

template <int kIters>
void launch_gating(const moe::GatingParams& p, cudaStream_t s) {
  const size_t smem = p.num_groups > 1 ? size_t(moe::kGatingWarps) * p.experts * sizeof(float) : 0;
  const dim3 grid(unsigned((p.tokens + moe::kGatingWarps - 1) / moe::kGatingWarps));
  launch_smem("moe_gating_kernel", moe::moe_gating_kernel<kIters>, grid,
              dim3(moe::kGatingWarps * 32), smem, s, p);
}

template <int kIters>
void launch_route_sort(const moe::GatingParams& g, const moe::SortParams& p, cudaStream_t s) {
  const size_t smem = size_t(moe::sort_small_smem_ints(p.experts, p.pairs)) * sizeof(int);
  launch_smem("moe_route_sort_kernel", moe::moe_route_sort_kernel<kIters>, dim3(1),
              dim3(moe::kSortThreads), smem, s, g, p);
}

}  // namespace

std::string moe_gating_why_not(int experts, int top_k, int num_groups) {
  if (experts < 1 || experts > kMoeMaxExperts)
    return "the routing kernel takes 1 to " + std::to_string(kMoeMaxExperts) + " experts, got " +
           std::to_string(experts);
  if (top_k < 1 || top_k > kMoeMaxTopK || top_k > experts)
    return "the routing kernel takes top_k in [1, min(experts, " + std::to_string(kMoeMaxTopK) +
           ")], got " + std::to_string(top_k);
  if (num_groups < 1 || num_groups > kMoeMaxGroups || experts % num_groups != 0)
    return "the routing kernel takes num_groups in [1, " + std::to_string(kMoeMaxGroups) +
           "] dividing the experts, got " + std::to_string(num_groups);
  return "";
}

void moe_gating(const MoeGatingArgs& a, uintptr_t stream) {
  check_gating(a, "moe_gating: ");
  if (a.tokens == 0) return;
  const moe::GatingParams p = gating_params(a);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (iters_for(a.experts)) {
    case 1: launch_gating<1>(p, s); break;
    case 2: launch_gating<2>(p, s); break;
    case 4: launch_gating<4>(p, s); break;
    case 8: launch_gating<8>(p, s); break;
    case 16: launch_gating<16>(p, s); break;
    default: launch_gating<32>(p, s); break;
  }
}

void moe_route_sort(const MoeGatingArgs& g, const MoeSortArgs& a, uintptr_t stream) {
  const std::string w = "moe_route_sort: ";
  check_gating(g, w);
  check_sort(a, w, false);
  FUSEDIST_CHECK_ARG(a.tokens == g.tokens && a.top_k == g.top_k && a.experts == g.experts,
                     w + "the sort's tokens, top_k and experts must be the routing's");
  FUSEDIST_CHECK_ARG(a.tokens * a.top_k <= kMoeSortSmallMaxPairs,
                     w + "tokens * top_k must be <= " + std::to_string(kMoeSortSmallMaxPairs) +
                         " (one CTA); route, then sort with chunks");
  const moe::GatingParams gp = gating_params(g);
  moe::SortParams p = sort_params(a);
  p.ids = nullptr;
  p.chunk_pairs = p.chunks = 0;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (iters_for(g.experts)) {
    case 1: launch_route_sort<1>(gp, p, s); break;
    case 2: launch_route_sort<2>(gp, p, s); break;
    case 4: launch_route_sort<4>(gp, p, s); break;
    case 8: launch_route_sort<8>(gp, p, s); break;
    case 16: launch_route_sort<16>(gp, p, s); break;
    default: launch_route_sort<32>(gp, p, s); break;
  }
}

int64_t moe_sort_workspace_ints(int64_t pairs, int experts, int chunk_pairs) {
  if (chunk_pairs <= 0) return 0;
  return (pairs + chunk_pairs - 1) / chunk_pairs * int64_t(experts);
}

void moe_sort(const MoeSortArgs& a, uintptr_t stream) {
  const std::string w = "moe_sort: ";
  check_sort(a, w, true);
  const int64_t pairs = a.tokens * a.top_k;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  moe::SortParams p = sort_params(a);
  if (a.chunk_pairs == 0 || pairs == 0) {
    FUSEDIST_CHECK_ARG(pairs <= kMoeSortSmallMaxPairs,
                       w + "chunk_pairs 0 (one CTA) takes tokens * top_k <= " +
                           std::to_string(kMoeSortSmallMaxPairs) + ", got " +
                           std::to_string(pairs));
    p.chunk_pairs = p.chunks = 0;
    const size_t smem = size_t(moe::sort_small_smem_ints(p.experts, p.pairs)) * sizeof(int);
    launch_smem("moe_sort_small_kernel", moe::moe_sort_small_kernel, dim3(1),
                dim3(moe::kSortThreads), smem, s, p);
    return;
  }
  FUSEDIST_CHECK_ARG(a.chunk_pairs % kMoeSortChunkQuantum == 0 &&
                         a.chunk_pairs <= kMoeSortMaxChunkPairs,
                     w + "chunk_pairs must be a multiple of " +
                         std::to_string(kMoeSortChunkQuantum) + " up to " +
                         std::to_string(kMoeSortMaxChunkPairs) + ", got " +
                         std::to_string(a.chunk_pairs));
  FUSEDIST_CHECK_ARG(a.workspace && a.workspace % 4 == 0,
                     w + "the chunked sort needs an int32 workspace of " +
                         std::to_string(moe_sort_workspace_ints(pairs, a.experts, a.chunk_pairs)) +
                         " words");
  const dim3 grid(unsigned(p.chunks)), block(moe::kSortThreads);
  const int E = p.experts;
  launch_smem("moe_sort_count_kernel", moe::moe_sort_count_kernel, grid, block,
              size_t(E) * sizeof(int), s, p);
  launch_smem("moe_sort_scan_kernel", moe::moe_sort_scan_kernel, dim3(1), block,
              size_t(2 * E + 1 + 32) * sizeof(int), s, p);
  launch_smem("moe_sort_place_kernel", moe::moe_sort_place_kernel, grid, block,
              size_t(moe::kSortWarps * E + 2 * E + 1) * sizeof(int), s, p);
}

}  // namespace fusedist
