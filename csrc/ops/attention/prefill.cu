// Launcher for the paged prefill kernel and its split merge: validates, picks the (head_dim,
// q dtype, KV dtype) instantiation and launches (csrc/include/fusedist/attention/prefill.cuh).
#include <climits>
#include <string>

#include "fusedist/attention/api.h"
#include "fusedist/attention/prefill.cuh"
#include "fusedist/common/launch.h"
#include "attention_dtypes.h"

namespace fusedist {
namespace {

using attention::PrefillParams;
using attention::PrefillTraits;

static_assert(attention::kPrefillMaxSplits == kAttentionPrefillMaxSplits, "keep in sync");

template <int D, typename QT, typename KVT, int W, int MT, bool WG = false>
void launch_tile(const PrefillParams& p, cudaStream_t stream) {
  using Tr = PrefillTraits<D, QT, KVT, W, MT, WG>;
  static const bool once = [] {
    FUSEDIST_CUDA_CHECK(
        cudaFuncSetAttribute(attention::paged_prefill_kernel<D, QT, KVT, W, MT, WG>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
    return true;
  }();
  (void)once;
  const dim3 grid(p.q_tiles * p.num_splits, p.kv_heads, p.batch);
  launch_kernel_smem("paged_prefill_kernel", attention::paged_prefill_kernel<D, QT, KVT, W, MT, WG>,
                     grid, dim3(Tr::kThreads), Tr::kSmemBytes, stream, p);
}

// 128-row tiles at head_dim 128 only (other head dims would spill or exceed the register file):
// 8 warps x 1 m-tile, or 4 warps x 2 (16-bit caches: with the FP8 conversion it spills).
template <int D, typename QT, typename KVT>
void launch_tiles(const PrefillParams& p, int rows, int warps, int mainloop, cudaStream_t stream) {
  constexpr bool kFp8 = std::is_same<KVT, __nv_fp8_e4m3>::value;
  if (mainloop == 1) {  // wgmma: head_dim 128, one warpgroup per 64 rows (checked by the caller)
    if constexpr (D == 128) {
      if (rows == 128) return launch_tile<D, QT, KVT, 8, 1, true>(p, stream);
      return launch_tile<D, QT, KVT, 4, 1, true>(p, stream);
    }
  }
  if constexpr (D == 128) {
    if (rows == 128 && warps == 8) return launch_tile<D, QT, KVT, 8, 1>(p, stream);
    if constexpr (!kFp8) {
      if (rows == 128) return launch_tile<D, QT, KVT, 4, 2>(p, stream);
    }
  }
  FUSEDIST_CHECK_ARG(rows == 64, "attention_prefill: 128-row tiles of 4 warps are built for "
                                 "16-bit caches only; pass tile_warps=8 for an FP8 cache");
  launch_tile<D, QT, KVT, 4, 1>(p, stream);
}

// The tile kernel, then (key splits) the merge of its partial rows, whatever the tile shape.
template <int D, typename QT, typename KVT>
void launch(const PrefillParams& p, int rows, int warps, int mainloop, cudaStream_t stream) {
  launch_tiles<D, QT, KVT>(p, rows, warps, mainloop, stream);
  if (p.num_splits > 1) {
    const int64_t merge_rows = int64_t(p.tokens) * p.q_heads;
    launch_kernel("prefill_merge_kernel", attention::prefill_merge_kernel<D, QT>,
                  dim3(unsigned((merge_rows + 3) / 4)), dim3(128), stream, p);
  }
}

#define FUSEDIST_PREFILL_DTYPES(D_, CALL)                                             \
  if (bf16_ && !fp8_) CALL(D_, __nv_bfloat16, __nv_bfloat16);                         \
  else if (bf16_) CALL(D_, __nv_bfloat16, __nv_fp8_e4m3);                             \
  else if (!fp8_) CALL(D_, __half, __half);                                           \
  else CALL(D_, __half, __nv_fp8_e4m3)

}  // namespace

int attention_prefill_tile_tokens(int group, int tile_rows) {
  FUSEDIST_CHECK_ARG(tile_rows == 64 || tile_rows == 128,
                     "attention_prefill: tile_rows must be 64 or 128, got " +
                         std::to_string(tile_rows));
  FUSEDIST_CHECK_ARG(group >= 1 && group <= 64,
                     "attention_prefill: q_heads / kv_heads must be in [1, 64], got " +
                         std::to_string(group));
  return tile_rows / group;
}

void attention_prefill(const PrefillArgs& a, uintptr_t stream) {
  const std::string w = "attention_prefill: ";
  check_attention_dtypes("attention_prefill", a.head_dim, a.q_dtype, a.kv_dtype);
  FUSEDIST_CHECK_ARG(a.batch >= 0 && a.batch <= 65535,
                     w + "batch must be in [0, 65535], got " + std::to_string(a.batch));
  FUSEDIST_CHECK_ARG(a.kv_heads > 0 && a.kv_heads <= 65535 && a.q_heads > 0 &&
                         a.q_heads % a.kv_heads == 0,
                     w + "q_heads (" + std::to_string(a.q_heads) +
                         ") must be a positive multiple of kv_heads (" +
                         std::to_string(a.kv_heads) + ")");
  const int group = a.q_heads / a.kv_heads;
  const int rows = a.tile_rows == 0 ? 64 : a.tile_rows;
  FUSEDIST_CHECK_ARG(rows == 64 || a.head_dim == 128,
                     w + "tile_rows 128 is built for head_dim 128 only, got head_dim " +
                         std::to_string(a.head_dim));
  const int warps = a.tile_warps == 0 ? 4 : a.tile_warps;
  FUSEDIST_CHECK_ARG((rows == 64 && warps == 4) || (rows == 128 && (warps == 4 || warps == 8)),
                     w + "tile_warps must be 4 (64 or 128 rows) or 8 (128 rows), got " +
                         std::to_string(warps) + " for " + std::to_string(rows) + " rows");
  FUSEDIST_CHECK_ARG(a.mainloop == 0 || a.mainloop == 1,
                     w + "mainloop must be 0 (mma.sync) or 1 (wgmma), got " +
                         std::to_string(a.mainloop));
  FUSEDIST_CHECK_ARG(a.mainloop == 0 || (a.head_dim == 128 && (rows == 64 || warps == 8)),
                     w + "the wgmma mainloop is built for head_dim 128 with 64-row tiles (4 "
                         "warps) or 128-row tiles of 8 warps");
  const int tt = attention_prefill_tile_tokens(group, rows);
  FUSEDIST_CHECK_ARG(a.page_size > 0, w + "page_size must be > 0");
  FUSEDIST_CHECK_ARG(a.tokens >= 0 && a.max_q_len >= 0 && a.max_q_len <= a.tokens,
                     w + "max_q_len (" + std::to_string(a.max_q_len) + ") must be in [0, tokens = " +
                         std::to_string(a.tokens) + "]");
  FUSEDIST_CHECK_ARG(a.num_splits >= 1 && a.num_splits <= attention::kPrefillMaxSplits,
                     w + "num_splits must be in [1, " +
                         std::to_string(attention::kPrefillMaxSplits) + "], got " +
                         std::to_string(a.num_splits));
  FUSEDIST_CHECK_ARG(a.q && a.k_cache && a.v_cache && a.block_table && a.seq_lens &&
                         a.cu_seqlens_q && a.out,
                     w + "q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q and out must "
                         "be non-null");
  FUSEDIST_CHECK_ARG(a.num_splits == 1 || (a.o_partial && a.lse_partial),
                     w + "num_splits > 1 needs the workspace (o_partial, lse_partial)");
  FUSEDIST_CHECK_ARG(a.kv_dtype != DType::kFloat8E4M3 || (a.k_scale && a.v_scale),
                     w + "an fp8 KV cache needs k_scale and v_scale");
  FUSEDIST_CHECK_ARG(a.bt_cols >= 0 && a.bt_cols <= a.bt_stride,
                     w + "bt_cols must be in [0, bt_stride]");
  FUSEDIST_CHECK_ARG(a.num_pages > 0, w + "num_pages must be > 0");
  FUSEDIST_CHECK_ARG(int64_t(a.bt_cols) * a.page_size <= INT32_MAX,
                     w + "bt_cols * page_size must fit in int32");
  FUSEDIST_CHECK_ARG(a.q_stride >= int64_t(a.q_heads) * a.head_dim && a.q_stride % 8 == 0,
                     w + "q's token stride must be >= q_heads * head_dim and a multiple of 8");
  FUSEDIST_CHECK_ARG((a.q | a.out | a.k_cache | a.v_cache) % 16 == 0,
                     w + "q, out, k_cache and v_cache must be 16-byte aligned");
  if (a.batch == 0 || a.tokens == 0 || a.max_q_len == 0) return;
  const int64_t q_tiles = (int64_t(a.max_q_len) + tt - 1) / tt;
  FUSEDIST_CHECK_ARG(q_tiles * a.num_splits <= INT32_MAX, w + "too many query tiles");
  PrefillParams p{};
  p.q = reinterpret_cast<const void*>(a.q);
  p.k_cache = reinterpret_cast<const void*>(a.k_cache);
  p.v_cache = reinterpret_cast<const void*>(a.v_cache);
  p.k_scale = reinterpret_cast<const float*>(a.k_scale);
  p.v_scale = reinterpret_cast<const float*>(a.v_scale);
  p.block_table = reinterpret_cast<const int*>(a.block_table);
  p.seq_lens = reinterpret_cast<const int*>(a.seq_lens);
  p.cu_seqlens_q = reinterpret_cast<const int*>(a.cu_seqlens_q);
  p.out = reinterpret_cast<void*>(a.out);
  p.o_partial = reinterpret_cast<float*>(a.o_partial);
  p.lse_partial = reinterpret_cast<float*>(a.lse_partial);
  p.q_stride = a.q_stride;
  p.tokens = a.tokens, p.batch = a.batch, p.q_heads = a.q_heads, p.kv_heads = a.kv_heads;
  p.group = group, p.tile_tokens = tt, p.q_tiles = int(q_tiles), p.num_splits = a.num_splits;
  p.page_size = a.page_size, p.bt_stride = a.bt_stride, p.bt_cols = a.bt_cols;
  p.num_pages = a.num_pages;
  p.page_shift = (a.page_size & (a.page_size - 1)) == 0 ? __builtin_ctz(unsigned(a.page_size)) : -1;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.err = reinterpret_cast<OpErrorRecord*>(a.err);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const bool fp8_ = a.kv_dtype == DType::kFloat8E4M3, bf16_ = a.q_dtype == DType::kBFloat16;
#define FUSEDIST_PREFILL_LAUNCH(D_, QT_, KVT_) launch<D_, QT_, KVT_>(p, rows, warps, a.mainloop, s)
  switch (a.head_dim) {
    case 64: FUSEDIST_PREFILL_DTYPES(64, FUSEDIST_PREFILL_LAUNCH); break;
    case 128: FUSEDIST_PREFILL_DTYPES(128, FUSEDIST_PREFILL_LAUNCH); break;
    default: FUSEDIST_PREFILL_DTYPES(256, FUSEDIST_PREFILL_LAUNCH); break;
  }
#undef FUSEDIST_PREFILL_LAUNCH
}

}  // namespace fusedist
