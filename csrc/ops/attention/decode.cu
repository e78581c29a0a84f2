// Launcher for the paged decode kernel: validates, picks the (head_dim, q dtype, KV dtype)
// instantiation and launches it (csrc/include/fusedist/attention/decode.cuh).
#include <climits>
#include <string>

#include "fusedist/attention/api.h"
#include "fusedist/attention/decode.cuh"
#include "fusedist/common/launch.h"
#include "attention_dtypes.h"

namespace fusedist {
namespace {

using attention::DecodeParams;
using attention::DecodeTraits;
using attention::paged_decode_kernel;

static_assert(attention::kDecodeMaxSplits == kAttentionDecodeMaxSplits, "keep in sync");
static_assert(attention::kDecodeTileHeads == kAttentionDecodeTileHeads, "keep in sync");
static_assert(attention::kDecodeSlab == kAttentionDecodeSlab, "keep in sync");
static_assert(attention::kDecodeMaxClusterSplits == kAttentionDecodeMaxClusterSplits,
              "keep in sync");

template <int D, typename QT, typename KVT, int S, bool DIR>
const void* prepared_kernel() {
  static const bool once = [] {
    FUSEDIST_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_kernel<D, QT, KVT, S, DIR>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             DecodeTraits<D, QT, KVT, S, DIR>::kSmemBytes));
    return true;
  }();
  (void)once;
  return reinterpret_cast<const void*>(paged_decode_kernel<D, QT, KVT, S, DIR>);
}

template <int D, typename QT, typename KVT, int S, bool DIR>
void launch(const DecodeParams& p, cudaStream_t stream) {
  prepared_kernel<D, QT, KVT, S, DIR>();
  const dim3 grid(p.num_splits, p.kv_heads * p.q_tiles, p.batch);
  if (p.cluster)  // the splits of a (sequence, head tile) as one cluster: the cluster merge
    launch_kernel_cluster("paged_decode_kernel", paged_decode_kernel<D, QT, KVT, S, DIR>, grid,
                          dim3(attention::kDecodeThreads),
                          DecodeTraits<D, QT, KVT, S, DIR>::kSmemBytes, p.num_splits, stream, p);
  else
    launch_kernel_smem("paged_decode_kernel", paged_decode_kernel<D, QT, KVT, S, DIR>, grid,
                       dim3(attention::kDecodeThreads),
                       DecodeTraits<D, QT, KVT, S, DIR>::kSmemBytes, stream, p);
}

template <int D, typename QT, typename KVT, int S, bool DIR>
int occupancy() {
  const void* k = prepared_kernel<D, QT, KVT, S, DIR>();
  int n = 0;
  FUSEDIST_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n, k, attention::kDecodeThreads, DecodeTraits<D, QT, KVT, S, DIR>::kSmemBytes));
  return n;
}

void check_variant(DType kv, int stages, int direct) {
  FUSEDIST_CHECK_ARG(stages == 0 || (stages == 2 && kv == DType::kFloat8E4M3),
                     "attention_decode: stages must be 0 (the default ring) or 2 (FP8 caches "
                     "only), got " + std::to_string(stages));
  FUSEDIST_CHECK_ARG(!direct || (kv == DType::kFloat8E4M3 && stages == 0),
                     "attention_decode: fp8_direct is an FP8-cache variant of the default ring "
                     "(stages 0)");
}

// Runs CALL(D, QT, KVT, S, DIR) for the instantiation of (head_dim, q, kv, stages, direct):
// the table of instances (every (head_dim, q, kv) at the default ring; FP8 caches also at 2
// stages, and with the direct fragment path).
#define FUSEDIST_DECODE_DISPATCH(head_dim, q, kv, stages, direct, CALL)               \
  do {                                                                                \
    check_attention_dtypes("attention_decode", head_dim, q, kv);                      \
    check_variant(kv, stages, direct);                                                \
    const bool fp8_ = (kv) == DType::kFloat8E4M3, bf16_ = (q) == DType::kBFloat16;    \
    const bool two_ = (stages) == 2, dir_ = (direct) != 0;                            \
    switch (head_dim) {                                                               \
      case 64: FUSEDIST_DECODE_DTYPES(64, CALL); break;                               \
      case 128: FUSEDIST_DECODE_DTYPES(128, CALL); break;                             \
      default: FUSEDIST_DECODE_DTYPES(256, CALL); break;                              \
    }                                                                                 \
  } while (0)
#define FUSEDIST_DECODE_DTYPES(D_, CALL)                                              \
  if (bf16_ && !fp8_) CALL(D_, __nv_bfloat16, __nv_bfloat16, 0, false);               \
  else if (bf16_ && two_) CALL(D_, __nv_bfloat16, __nv_fp8_e4m3, 2, false);           \
  else if (bf16_ && dir_) CALL(D_, __nv_bfloat16, __nv_fp8_e4m3, 0, true);            \
  else if (bf16_) CALL(D_, __nv_bfloat16, __nv_fp8_e4m3, 0, false);                   \
  else if (!fp8_) CALL(D_, __half, __half, 0, false);                                 \
  else if (two_) CALL(D_, __half, __nv_fp8_e4m3, 2, false);                           \
  else if (dir_) CALL(D_, __half, __nv_fp8_e4m3, 0, true);                            \
  else CALL(D_, __half, __nv_fp8_e4m3, 0, false)

}  // namespace

void attention_decode(const DecodeArgs& a, uintptr_t stream) {
  const std::string w = "attention_decode: ";
  FUSEDIST_CHECK_ARG(a.batch >= 0 && a.batch <= 65535, w + "batch must be in [0, 65535], got " +
                                                           std::to_string(a.batch));
  FUSEDIST_CHECK_ARG(a.kv_heads > 0 && a.q_heads > 0 && a.q_heads % a.kv_heads == 0,
                     w + "q_heads (" + std::to_string(a.q_heads) +
                         ") must be a positive multiple of kv_heads (" +
                         std::to_string(a.kv_heads) + ")");
  FUSEDIST_CHECK_ARG(a.page_size > 0 && a.page_size % attention::kDecodeSlab == 0,
                     w + "page_size must be a positive multiple of 16, got " +
                         std::to_string(a.page_size));
  FUSEDIST_CHECK_ARG(a.num_splits >= 1 && a.num_splits <= attention::kDecodeMaxSplits,
                     w + "num_splits must be in [1, " +
                         std::to_string(attention::kDecodeMaxSplits) + "], got " +
                         std::to_string(a.num_splits));
  FUSEDIST_CHECK_ARG(a.q && a.k_cache && a.v_cache && a.block_table && a.seq_lens && a.out,
                     w + "q, k_cache, v_cache, block_table, seq_lens and out must be non-null");
  FUSEDIST_CHECK_ARG(a.cluster == 0 || a.cluster == 1,
                     w + "cluster must be 0 or 1, got " + std::to_string(a.cluster));
  FUSEDIST_CHECK_ARG(!a.cluster || (a.num_splits >= 2 &&
                                    a.num_splits <= attention::kDecodeMaxClusterSplits),
                     w + "the cluster merge takes 2 to " +
                         std::to_string(attention::kDecodeMaxClusterSplits) +
                         " splits, got " + std::to_string(a.num_splits));
  FUSEDIST_CHECK_ARG(a.num_splits == 1 || a.cluster || (a.o_partial && a.lse_partial && a.counters),
                     w + "num_splits > 1 needs the workspace (o_partial, lse_partial, counters) "
                         "or the cluster merge");
  FUSEDIST_CHECK_ARG(a.kv_dtype != DType::kFloat8E4M3 || (a.k_scale && a.v_scale),
                     w + "an fp8 KV cache needs k_scale and v_scale");
  FUSEDIST_CHECK_ARG(a.bt_stride >= 0, w + "bt_stride must be >= 0");
  FUSEDIST_CHECK_ARG(a.bt_cols >= 0 && a.bt_cols <= a.bt_stride,
                     w + "bt_cols must be in [0, bt_stride = " + std::to_string(a.bt_stride) +
                         "], got " + std::to_string(a.bt_cols));
  FUSEDIST_CHECK_ARG(a.num_pages > 0, w + "num_pages must be > 0, got " +
                                          std::to_string(a.num_pages));
  FUSEDIST_CHECK_ARG(int64_t(a.bt_cols) * a.page_size <= INT32_MAX,
                     w + "bt_cols * page_size must fit in int32");
  FUSEDIST_CHECK_ARG((a.q | a.out | a.k_cache | a.v_cache | a.o_partial) % 16 == 0,
                     w + "q, out, k_cache, v_cache and o_partial must be 16-byte aligned");
  if (a.batch == 0) return;
  DecodeParams p{};
  p.q = reinterpret_cast<const void*>(a.q);
  p.k_cache = reinterpret_cast<const void*>(a.k_cache);
  p.v_cache = reinterpret_cast<const void*>(a.v_cache);
  p.k_scale = reinterpret_cast<const float*>(a.k_scale);
  p.v_scale = reinterpret_cast<const float*>(a.v_scale);
  p.block_table = reinterpret_cast<const int*>(a.block_table);
  p.seq_lens = reinterpret_cast<const int*>(a.seq_lens);
  p.out = reinterpret_cast<void*>(a.out);
  p.o_partial = reinterpret_cast<float*>(a.o_partial);
  p.lse_partial = reinterpret_cast<float*>(a.lse_partial);
  p.counters = reinterpret_cast<int*>(a.counters);
  p.batch = a.batch, p.q_heads = a.q_heads, p.kv_heads = a.kv_heads;
  p.group = a.q_heads / a.kv_heads;
  p.q_tiles = (p.group + attention::kDecodeTileHeads - 1) / attention::kDecodeTileHeads;
  p.page_size = a.page_size, p.bt_stride = a.bt_stride, p.num_splits = a.num_splits;
  p.bt_cols = a.bt_cols, p.num_pages = a.num_pages;
  p.err = reinterpret_cast<OpErrorRecord*>(a.err);
  p.cluster = a.cluster;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  FUSEDIST_CHECK_ARG(int64_t(a.kv_heads) * p.q_tiles <= 65535, w + "too many head tiles");
  auto s = reinterpret_cast<cudaStream_t>(stream);
#define FUSEDIST_DECODE_LAUNCH(D_, QT_, KVT_, S_, DIR_) launch<D_, QT_, KVT_, S_, DIR_>(p, s)
  FUSEDIST_DECODE_DISPATCH(a.head_dim, a.q_dtype, a.kv_dtype, a.stages, a.fp8_direct,
                           FUSEDIST_DECODE_LAUNCH);
#undef FUSEDIST_DECODE_LAUNCH
}

int attention_decode_ctas_per_sm(int head_dim, DType q_dtype, DType kv_dtype, int stages,
                                 int fp8_direct) {
  int n = 0;
#define FUSEDIST_DECODE_OCC(D_, QT_, KVT_, S_, DIR_) n = occupancy<D_, QT_, KVT_, S_, DIR_>()
  FUSEDIST_DECODE_DISPATCH(head_dim, q_dtype, kv_dtype, stages, fp8_direct, FUSEDIST_DECODE_OCC);
#undef FUSEDIST_DECODE_OCC
  return n;
}

}  // namespace fusedist
