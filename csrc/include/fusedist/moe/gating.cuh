// fusedist/moe/gating.cuh -- MoE routing on the device (no torch): router logits -> each token's
// top-k experts and weights, and the (token, slot) pairs laid out by expert for the grouped GEMMs
// (fusedist/ops/moe/gating.py states the semantics; this file the protocol).
//
// Routing (route_token): one warp per token. Lane l holds experts l, l + 32, l + 64, ... (kIters
// registers, E <= 32 kIters); the scores are fp32 whatever the logits' dtype:
//   softmax   m = max x; e_i = expf(x_i - m); s = sum e_i (per lane in register order, then an
//             xor butterfly); p_i = e_i / s (IEEE division). The same operations and order as
//             torch's CUDA warp softmax for E <= 1024, so the probabilities usually match
//             torch's on the GPU bit for bit; the bound that holds regardless is in
//             docs/design/moe.md.
//   sigmoid   s_i = 1 / (1 + expf(-x_i)), the formula of torch's CUDA sigmoid.
// The choice value is the score (+ bias[i], fp32). Group-limited routing: lane g < num_groups
// ranks group g by the max (softmax) or the sum of the two largest (sigmoid) choice values of
// its E / num_groups experts (read back from a per-warp shared row), the warp keeps the
// topk_groups best groups and gives the others' experts the choice value -inf. Then k rounds
// of a warp arg-max pick the experts: each value is mapped to an order-preserving uint32 key
// (NaN above everything, -0 as +0, 0 = taken / past E), the largest key wins and, among equal
// keys, the lower expert index (two redux instructions), so ties go to the lower index as in
// a stable descending sort, and slot j holds the j-th pick. Lane j keeps slot j; the weights
// are the picks' unbiased scores, divided by their sum (added in slot order) when
// renormalizing, then multiplied by routed_scaling. Every id is in [0, E) whatever the logits
// hold (NaN included).
//
// Layout (sort_by_expert): pair i = t * k + j with expert e = ids[i]. counts[e] = pairs of e,
// offsets = exclusive scan of counts rounded up to `align`, offsets[E] = rows in use; inside
// expert e's segment the pairs are in ascending i (a stable counting sort: the same layout on
// every run). dest_index[i] = the pair's row, src_index[row] = i, -1 for the padding rows
// (offsets[e] + counts[e] .. offsets[e + 1]) and the unused rows past offsets[E].
// The stable rank of a pair comes from warp segments: warp w of a CTA owns pairs
// [begin_w, end_w) of the CTA's range and walks them 32 at a time; __match_any_sync groups the
// lanes holding one expert, so a pair's rank among its warp's earlier pairs of that expert is
// popc(peers & lanes below) plus a per-warp per-expert count kept in shared memory (table
// [kSortWarps][E]: written by its warp's leader lanes only, never raced). An exclusive scan of
// the table over warps (one thread per expert) turns the counts into each warp's first row.
//   * one CTA (moe_sort_small_kernel, pairs <= kSortSmallMaxPairs): the ids go to shared
//     memory, then histogram, scan, placement in one launch; moe_route_sort_kernel routes the
//     tokens first (its warps each route tokens w, w + 16, ...) and sorts in the same launch.
//   * chunks of chunk_pairs pairs (prefill): moe_sort_count_kernel writes each chunk's
//     per-expert counts (ws[c][e]); moe_sort_scan_kernel (one CTA) turns them into each chunk's
//     first rank per expert, counts and offsets; moe_sort_place_kernel places each chunk's
//     pairs from there and writes the padding rows (-1). Deterministic: integer sums only.
// An id outside [0, E) is recorded once (op_error.h: kOpErrMoeSort, kOpErrExpertId) and its pair
// is left out: dest_index -1, no row, not counted; unpermute poisons that token (NaN).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "fusedist/common/common.h"
#include "fusedist/common/op_error.h"
#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger

namespace fusedist {
namespace moe {

constexpr int kMaxExperts = 1024;          // 32 registers of experts per lane
constexpr int kMaxTopK = 32;               // a slot per lane
constexpr int kMaxGroups = 32;             // a group per lane
constexpr int kGatingWarps = 4;            // tokens per CTA of moe_gating_kernel
constexpr int kSortWarps = 16;             // warps of the sort kernels
constexpr int kSortThreads = kSortWarps * 32;
constexpr int kSortSmallMaxPairs = 8192;   // pairs one CTA sorts (their ids in shared memory)

enum Scoring : int { kScoringSoftmax = 0, kScoringSigmoid = 1 };

struct GatingParams {
  const void* logits;       // [tokens, logit_stride] of dtype, unit column stride
  int64_t logit_stride;     // elements between rows
  int dtype;                // DType of the logits
  const float* bias;        // [experts] or null (a selection bias, sigmoid scoring)
  int32_t* ids;             // [tokens, top_k]
  float* weights;           // [tokens, top_k]
  int tokens, experts, top_k;
  int scoring;              // Scoring
  int renormalize;
  int num_groups, topk_groups;
  float routed_scaling;
};

struct SortParams {
  const void* ids;          // [pairs] int32 (or int64: ids_int64), or null (the routing's)
  int ids_int64;
  int pairs, top_k, experts, align, rows;
  int32_t* counts;          // [experts]
  int32_t* offsets;         // [experts + 1]
  int32_t* src_index;       // [rows]
  int32_t* dest_index;      // [pairs]
  int32_t* ws;              // chunked path: [chunks][experts]
  int chunk_pairs, chunks;
  OpErrorRecord* err;
};

// ---- warp helpers ----------------------------------------------------------------------------

__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

__device__ __forceinline__ uint32_t warp_min_u32(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_min_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

// An order-preserving key of a float: larger float, larger key; every NaN above +inf (as
// torch.sort places NaN first in a descending sort); -0 equal to +0. Never 0 (0 marks an
// expert already taken, or a register past E).
__device__ __forceinline__ uint32_t order_key(float v) {
  if (v != v) return 0xffffffffu;
  if (v == 0.f) v = 0.f;
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The index of the warp's largest key, the lowest index among equal keys. Each lane passes its
// own best (key, index) (key 0: none).
__device__ __forceinline__ int warp_argmax(uint32_t key, int idx) {
  const uint32_t best = warp_max_u32(key);
  return int(warp_min_u32(key == best ? uint32_t(idx) : 0xffffffffu));
}

__device__ __forceinline__ float load_logit(const void* row, int i, int dtype) {
  if (dtype == int(DType::kFloat32)) return static_cast<const float*>(row)[i];
  if (dtype == int(DType::kFloat16)) return __half2float(static_cast<const __half*>(row)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(row)[i]);
}

// ---- routing ---------------------------------------------------------------------------------

// Route token t with the calling warp (header comment). scratch: E floats of shared memory of
// this warp (group-limited routing only). ids_smem: where the ids also go (the fused sort's
// shared copy), or null.
template <int kIters>
__device__ __forceinline__ void route_token(const GatingParams& p, int t, float* scratch,
                                            int32_t* ids_smem) {
  const int lane = threadIdx.x & 31;
  const int E = p.experts;
  const int esize = p.dtype == int(DType::kFloat32) ? 4 : 2;
  const void* row = static_cast<const char*>(p.logits) + int64_t(t) * p.logit_stride * esize;
  float score[kIters];
  uint32_t key[kIters];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = lane + 32 * it;
    score[it] = i < E ? load_logit(row, i, p.dtype) : -INFINITY;
  }
  if (p.scoring == kScoringSoftmax) {
    float m = score[0];
#pragma unroll
    for (int it = 1; it < kIters; ++it) m = m > score[it] ? m : score[it];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, m, o);
      m = m > v ? m : v;
    }
    float s = 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      score[it] = expf(score[it] - m);
      s += score[it];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
#pragma unroll
    for (int it = 0; it < kIters; ++it) score[it] = __fdiv_rn(score[it], s);
  } else {
#pragma unroll
    for (int it = 0; it < kIters; ++it)
      score[it] = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-score[it])));
  }
  const bool grouped = p.num_groups > 1;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {  // the choice values: keys (and the group row)
    const int i = lane + 32 * it;
    float choice = score[it];
    if (p.bias != nullptr && i < E) choice = __fadd_rn(choice, p.bias[i]);
    key[it] = i < E ? order_key(choice) : 0u;
    if (grouped && i < E) scratch[i] = choice;
  }
  if (grouped) {
    const int G = E / p.num_groups;
    __syncwarp();
    uint32_t gkey = 0u;
    if (lane < p.num_groups) {
      const float* g = scratch + lane * G;
      float a = g[0];
      float gs;
      if (p.scoring == kScoringSigmoid) {  // the two largest: a >= b
        float b = -INFINITY;
        for (int i = 1; i < G; ++i) {
          const float v = g[i];
          if (v > a) {
            b = a;
            a = v;
          } else if (v > b) {
            b = v;
          }
        }
        gs = __fadd_rn(a, b);
      } else {  // the max, NaN-propagating as torch's amax
        for (int i = 1; i < G; ++i) {
          const float v = g[i];
          a = (v > a || v != v) ? v : a;
        }
        gs = a;
      }
      gkey = order_key(gs);
    }
    uint32_t allowed = 0u;
    for (int r = 0; r < p.topk_groups; ++r) {
      const int gi = warp_argmax(gkey, lane);
      allowed |= 1u << gi;
      if (lane == gi) gkey = 0u;
    }
    const uint32_t masked = order_key(-INFINITY);
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = lane + 32 * it;
      if (i < E && !((allowed >> (i / G)) & 1u)) key[it] = masked;
    }
    __syncwarp();  // the row is read; the next token of this warp may write it
  }
  int my_id = 0;
  float my_w = 0.f, wsum = 0.f;
  for (int j = 0; j < p.top_k; ++j) {
    uint32_t best = 0u;
    int bidx = 0x7fffffff;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      if (key[it] > best) {
        best = key[it];
        bidx = lane + 32 * it;
      }
    }
    const int pick = warp_argmax(best, bidx);
    float w = 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      if (lane + 32 * it == pick) {
        key[it] = 0u;
        w = score[it];
      }
    }
    w = __shfl_sync(0xffffffffu, w, pick & 31);
    if (lane == j) {
      my_id = pick;
      my_w = w;
    }
    wsum = __fadd_rn(wsum, w);
  }
  if (lane < p.top_k) {
    float w = my_w;
    if (p.renormalize) w = __fdiv_rn(w, wsum);
    if (p.routed_scaling != 1.f) w = __fmul_rn(w, p.routed_scaling);
    const int64_t o = int64_t(t) * p.top_k + lane;
    p.ids[o] = my_id;
    p.weights[o] = w;
    if (ids_smem != nullptr) ids_smem[o] = my_id;
  }
}

// One warp per token, kGatingWarps tokens per CTA. Dynamic shared memory: kGatingWarps x E
// floats when num_groups > 1, else none.
template <int kIters>
__global__ void __launch_bounds__(kGatingWarps * 32)
    moe_gating_kernel(const __grid_constant__ GatingParams p) {
  extern __shared__ float gating_scratch[];
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * kGatingWarps + warp;
  pdl_wait();  // the logits are the previous kernel's output
  pdl_trigger();
  if (t >= p.tokens) return;  // whole warps leave
  route_token<kIters>(p, t, p.num_groups > 1 ? gating_scratch + warp * p.experts : nullptr,
                      nullptr);
}

// ---- sort: pieces --------------------------------------------------------------------------

// ids[i] as an int in [0, E), or -1 (recorded when `record`) for one outside.
__device__ __forceinline__ int load_expert(const SortParams& p, int i, bool record) {
  const int64_t v = p.ids_int64 ? static_cast<const int64_t*>(p.ids)[i]
                                : int64_t(static_cast<const int32_t*>(p.ids)[i]);
  if (v >= 0 && v < p.experts) return int(v);
  if (record)
    record_op_error(p.err, kOpErrMoeSort, kOpErrExpertId, i / p.top_k, i % p.top_k, v,
                    p.experts);
  return -1;
}

__device__ __forceinline__ uint32_t lanes_below() {
  return (1u << (threadIdx.x & 31)) - 1u;
}

// Warp-segment counts: row[e] += the pairs of [begin, end) with expert e (row: this warp's
// table row; the warp's own, so plain adds by one leader lane per expert and step).
template <typename ExpertAt>
__device__ __forceinline__ void warp_count(int* row, int begin, int end, ExpertAt expert_at) {
  const int lane = threadIdx.x & 31;
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    const int e = i < end ? expert_at(i) : -1;
    const uint32_t peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == __ffs(peers) - 1) row[e] += __popc(peers);
    __syncwarp();
  }
}

// Warp-segment placement: row[e] holds the row of this warp's next pair of expert e.
template <typename ExpertAt>
__device__ __forceinline__ void warp_place(const SortParams& p, int* row, int begin, int end,
                                           ExpertAt expert_at) {
  const int lane = threadIdx.x & 31;
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    const int e = i < end ? expert_at(i) : -1;
    const uint32_t peers = __match_any_sync(0xffffffffu, e);
    if (i < end) {
      if (e >= 0) {
        const int r = row[e] + __popc(peers & lanes_below());
        p.dest_index[i] = r;
        if (r < p.rows) p.src_index[r] = i;
      } else {
        p.dest_index[i] = -1;
      }
    }
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) row[e] += __popc(peers);
    __syncwarp();
  }
}

// Exclusive scan in place of data[0, n) (n <= 2 * blockDim.x, shared memory) by the whole
// block; returns the total. tmp: 32 ints of shared memory. Begins and ends with a barrier's
// worth of ordering: callers __syncthreads() before (data written) and may read data after.
__device__ __forceinline__ int block_exclusive_scan(int* data, int n, int* tmp) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int i0 = 2 * tid;
  const int a = i0 < n ? data[i0] : 0;
  const int b = i0 + 1 < n ? data[i0 + 1] : 0;
  int s = a + b;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, s, o);
    if (lane >= o) s += y;
  }
  if (lane == 31) tmp[warp] = s;
  __syncthreads();
  if (warp == 0) {
    int v = lane < warps ? tmp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += y;
    }
    tmp[lane] = v;
  }
  __syncthreads();
  const int before = (warp > 0 ? tmp[warp - 1] : 0) + s - (a + b);
  if (i0 < n) data[i0] = before;
  if (i0 + 1 < n) data[i0 + 1] = before + a;
  const int total = tmp[warps - 1];
  __syncthreads();
  return total;
}

__device__ __forceinline__ int round_up(int v, int align) {
  return (v + align - 1) / align * align;
}

// src_index = -1 on expert e's padding rows, for experts first, first + step, ..., and on the
// unused rows past used = offsets[E]: those rows r = used + tail_first, + tail_step, ...
__device__ __forceinline__ void fill_padding(const SortParams& p, const int* off, const int* cnt,
                                             int first, int step, int tail_first,
                                             int tail_step) {
  for (int e = first; e < p.experts; e += step)
    for (int r = off[e] + cnt[e]; r < off[e + 1]; ++r) p.src_index[r] = -1;
  for (int r = off[p.experts] + tail_first; r < p.rows; r += tail_step) p.src_index[r] = -1;
}

// The one-CTA sort of pairs whose experts are in ids_s (shared, -1 = left out): every thread of
// the block calls it. table: kSortWarps x E ints, cnt: E, off: E + 1, tmp: 32 (shared).
__device__ __forceinline__ void sort_in_cta(const SortParams& p, const int32_t* ids_s, int* table,
                                            int* cnt, int* off, int* tmp) {
  const int tid = threadIdx.x, warp = tid >> 5, E = p.experts;
  for (int i = tid; i < kSortWarps * E; i += blockDim.x) table[i] = 0;
  __syncthreads();
  const int seg = (p.pairs + kSortWarps - 1) / kSortWarps;
  const int begin = warp < kSortWarps ? min(p.pairs, warp * seg) : p.pairs;
  const int end = min(p.pairs, begin + seg);
  const auto from_smem = [&](int i) { return int(ids_s[i]); };
  if (warp < kSortWarps) warp_count(table + warp * E, begin, end, from_smem);
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < kSortWarps; ++w) {
      const int v = table[w * E + e];
      table[w * E + e] = run;
      run += v;
    }
    cnt[e] = run;
    off[e] = round_up(run, p.align);
  }
  __syncthreads();
  const int used = block_exclusive_scan(off, E, tmp);
  if (tid == 0) off[E] = used;
  for (int e = tid; e < E; e += blockDim.x) {
    p.counts[e] = cnt[e];
    p.offsets[e] = off[e];
    for (int w = 0; w < kSortWarps; ++w) table[w * E + e] += off[e];
  }
  if (tid == 0) p.offsets[E] = used;
  __syncthreads();
  if (warp < kSortWarps) warp_place(p, table + warp * E, begin, end, from_smem);
  fill_padding(p, off, cnt, tid, blockDim.x, tid, blockDim.x);
}

// Dynamic shared memory of the one-CTA kernels: table, cnt, off, tmp, ids (ints).
__host__ __device__ inline int sort_small_smem_ints(int experts, int pairs) {
  return kSortWarps * experts + experts + (experts + 1) + 32 + pairs;
}

// ---- sort: kernels ---------------------------------------------------------------------------

// One CTA of kSortThreads: ids from global memory (checked), then sort_in_cta.
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_small_kernel(const __grid_constant__ SortParams p) {
  extern __shared__ int sort_smem[];
  int* table = sort_smem;
  int* cnt = table + kSortWarps * p.experts;
  int* off = cnt + p.experts;
  int* tmp = off + p.experts + 1;
  int32_t* ids_s = tmp + 32;
  pdl_wait();  // the ids are the previous kernel's output
  pdl_trigger();
  for (int i = threadIdx.x; i < p.pairs; i += blockDim.x) ids_s[i] = load_expert(p, i, true);
  __syncthreads();
  sort_in_cta(p, ids_s, table, cnt, off, tmp);
}

// One CTA of kSortThreads routes every token (warp w: tokens w, w + 16, ...) and sorts the
// pairs in the same launch (decode). The routing's group rows alias the sort's table (both
// kSortWarps x E words, used one after the other).
template <int kIters>
__global__ void __launch_bounds__(kSortThreads)
    moe_route_sort_kernel(const __grid_constant__ GatingParams g,
                          const __grid_constant__ SortParams p) {
  extern __shared__ int sort_smem[];
  int* table = sort_smem;
  int* cnt = table + kSortWarps * p.experts;
  int* off = cnt + p.experts;
  int* tmp = off + p.experts + 1;
  int32_t* ids_s = tmp + 32;
  const int warp = threadIdx.x >> 5;
  pdl_wait();
  pdl_trigger();
  float* scratch = g.num_groups > 1 ? reinterpret_cast<float*>(table) + warp * g.experts : nullptr;
  for (int t = warp; t < g.tokens; t += kSortWarps) route_token<kIters>(g, t, scratch, ids_s);
  __syncthreads();
  sort_in_cta(p, ids_s, table, cnt, off, tmp);
}

// Chunked sort, step 1: ws[c][e] = pairs of chunk c with expert e. Grid: chunks CTAs of
// kSortThreads; shared: E ints.
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_count_kernel(const __grid_constant__ SortParams p) {
  extern __shared__ int sort_smem[];
  const int c = blockIdx.x;
  const int begin = c * p.chunk_pairs, end = min(p.pairs, begin + p.chunk_pairs);
  for (int e = threadIdx.x; e < p.experts; e += blockDim.x) sort_smem[e] = 0;
  pdl_wait();
  pdl_trigger();
  __syncthreads();
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int e = load_expert(p, i, true);
    if (e >= 0) atomicAdd(&sort_smem[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.experts; e += blockDim.x)
    p.ws[int64_t(c) * p.experts + e] = sort_smem[e];
}

// Chunked sort, step 2 (one CTA of kSortThreads): ws[c][e] becomes the rank within expert e of
// chunk c's first pair of e; counts and offsets. Shared: cnt E, off E + 1, tmp 32 ints.
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_scan_kernel(const __grid_constant__ SortParams p) {
  extern __shared__ int sort_smem[];
  int* cnt = sort_smem;
  int* off = cnt + p.experts;
  int* tmp = off + p.experts + 1;
  const int E = p.experts;
  pdl_wait();
  pdl_trigger();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
    int c = 0;
    for (; c + 4 <= p.chunks; c += 4) {  // four independent loads in flight
      int v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = p.ws[int64_t(c + u) * E + e];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        p.ws[int64_t(c + u) * E + e] = run;
        run += v[u];
      }
    }
    for (; c < p.chunks; ++c) {
      const int v = p.ws[int64_t(c) * E + e];
      p.ws[int64_t(c) * E + e] = run;
      run += v;
    }
    cnt[e] = run;
    off[e] = round_up(run, p.align);
  }
  __syncthreads();
  const int used = block_exclusive_scan(off, E, tmp);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    p.counts[e] = cnt[e];
    p.offsets[e] = off[e];
  }
  if (threadIdx.x == 0) p.offsets[E] = used;
}

// Chunked sort, step 3: chunk c's pairs placed (warp segments of the chunk), and a share of
// the padding rows. Shared: table kSortWarps x E, cnt E, off E + 1 ints.
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_place_kernel(const __grid_constant__ SortParams p) {
  extern __shared__ int sort_smem[];
  const int E = p.experts, tid = threadIdx.x, warp = tid >> 5, c = blockIdx.x;
  int* table = sort_smem;
  int* cnt = table + kSortWarps * E;
  int* off = cnt + E;
  for (int i = tid; i < kSortWarps * E; i += blockDim.x) table[i] = 0;
  const int c0 = c * p.chunk_pairs, c1 = min(p.pairs, c0 + p.chunk_pairs);
  const int seg = (p.chunk_pairs + kSortWarps - 1) / kSortWarps;
  const int begin = min(c1, c0 + warp * seg), end = min(c1, begin + seg);
  const auto from_global = [&](int i) { return load_expert(p, i, false); };
  pdl_wait();
  pdl_trigger();
  __syncthreads();
  warp_count(table + warp * E, begin, end, from_global);
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    cnt[e] = p.counts[e];
    off[e] = p.offsets[e];
    int run = off[e] + p.ws[int64_t(c) * E + e];
    for (int w = 0; w < kSortWarps; ++w) {
      const int v = table[w * E + e];
      table[w * E + e] = run;
      run += v;
    }
  }
  if (tid == 0) off[E] = p.offsets[E];
  __syncthreads();
  warp_place(p, table + warp * E, begin, end, from_global);
  fill_padding(p, off, cnt, c, p.chunks, c * blockDim.x + tid, p.chunks * blockDim.x);
}

}  // namespace moe
}  // namespace fusedist
