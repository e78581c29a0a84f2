// fusedist/moe/api.h -- host entry points of the mixture-of-experts kernels: routing and the
// layout by expert (gating.cu over moe/gating.cuh), permute / unpermute (permute.cu over
// moe/permute.cuh). No torch: pointers are device addresses as integers, strides are in
// elements; the launchers validate and throw std::invalid_argument naming the argument.
#pragma once
#include <cstdint>
#include <string>

#include "fusedist/common/common.h"
#include "fusedist/common/op_error.h"

namespace fusedist {

// Limits of the routing kernels (moe/gating.cuh): experts per token row, top-k, groups.
constexpr int kMoeMaxExperts = 1024;
constexpr int kMoeMaxTopK = 32;
constexpr int kMoeMaxGroups = 32;
// Pairs (tokens x top_k) the one-CTA sort and route + sort take; chunk sizes of the chunked sort.
constexpr int kMoeSortSmallMaxPairs = 8192;
constexpr int kMoeSortChunkQuantum = 512;
constexpr int kMoeSortMaxChunkPairs = 16384;

// ---- gating.cu ----------------------------------------------------------------------------
// logits [tokens, logit_stride] (float32 / float16 / bfloat16, unit column stride) -> ids int32
// [tokens, top_k] and weights float32 [tokens, top_k] (fusedist/ops/moe/gating.py). scoring 0:
// softmax, 1: sigmoid; bias float32 [experts] or 0 (sigmoid only).
struct MoeGatingArgs {
  uintptr_t logits = 0, bias = 0, ids = 0, weights = 0;
  int64_t logit_stride = 0;
  DType dtype = DType::kFloat32;
  int64_t tokens = 0;
  int experts = 0, top_k = 0;
  int scoring = 0;
  bool renormalize = false;
  int num_groups = 1, topk_groups = 1;
  float routed_scaling = 1.f;
};

// The pairs (t, j) of ids [tokens, top_k] laid out by expert (gating.cuh): counts int32
// [experts], offsets int32 [experts + 1], src_index int32 [rows], dest_index int32
// [tokens * top_k]. chunk_pairs 0: one CTA (tokens * top_k <= kMoeSortSmallMaxPairs); else the
// chunked sort over ceil(pairs / chunk_pairs) chunks (a multiple of kMoeSortChunkQuantum, at
// most kMoeSortMaxChunkPairs), with workspace int32 [chunks, experts]
// (moe_sort_workspace_ints). err: OpErrorRecord* or 0 (ids out of range are recorded there).
struct MoeSortArgs {
  uintptr_t ids = 0;             // int32, or int64 with ids_int64 (moe_sort only)
  bool ids_int64 = false;
  uintptr_t counts = 0, offsets = 0, src_index = 0, dest_index = 0;
  uintptr_t workspace = 0;
  int64_t tokens = 0, rows = 0;
  int top_k = 0, experts = 0, align = 1;
  int chunk_pairs = 0;
  uintptr_t err = 0;
};

// Why the routing kernels do not take (experts, top_k, num_groups); "" when they do.
std::string moe_gating_why_not(int experts, int top_k, int num_groups);

void moe_gating(const MoeGatingArgs& args, uintptr_t stream);

// Route and lay out in one launch of one CTA (decode sizes): gating's args, and sort's
// outputs (its ids, workspace and chunk_pairs unused). tokens * top_k <= kMoeSortSmallMaxPairs.
void moe_route_sort(const MoeGatingArgs& gating, const MoeSortArgs& sort, uintptr_t stream);

void moe_sort(const MoeSortArgs& args, uintptr_t stream);

// int32 words of the chunked sort's workspace for these sizes (0 for chunk_pairs 0).
int64_t moe_sort_workspace_ints(int64_t pairs, int experts, int chunk_pairs);

// ---- permute.cu ---------------------------------------------------------------------------
// out row r = x[src_index[r] / top_k] (zeros for -1), rows = src_index's length. quant 0: out
// has x's dtype ([rows, out_stride] elements); 1: e4m3 out + scale float32 [rows]; 2: e4m3 out +
// scale float32 [rows, hidden / 128] (fusedist.ops.quantize_rows' convention). hidden a multiple
// of the 16-byte vector's elements; x, out 16-byte aligned, strides whole vectors.
struct MoePermuteArgs {
  uintptr_t x = 0, src_index = 0, out = 0, scale = 0;
  int64_t x_stride = 0, out_stride = 0;
  int64_t tokens = 0, rows = 0;
  int top_k = 0, hidden = 0;
  int quant = 0;
  DType dtype = DType::kBFloat16;
  uintptr_t err = 0;
};

void moe_permute(const MoePermuteArgs& args, uintptr_t stream);

// out[t] = sum_j weights[t, j] * y[dest_index[t * top_k + j]] (+ residual[t]), fp32 in slot
// order, one rounding to dtype (permute.cuh). y [rows, y_stride], out / residual [tokens,
// stride] of dtype; weights float32 [tokens, top_k] contiguous.
struct MoeUnpermuteArgs {
  uintptr_t y = 0, dest_index = 0, weights = 0, residual = 0, out = 0;
  int64_t y_stride = 0, res_stride = 0, out_stride = 0;
  int64_t tokens = 0, rows = 0;
  int top_k = 0, hidden = 0;
  DType dtype = DType::kBFloat16;
  uintptr_t err = 0;
};

void moe_unpermute(const MoeUnpermuteArgs& args, uintptr_t stream);

}  // namespace fusedist
