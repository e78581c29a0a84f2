// fusedist/attention/api.h -- host entry points of the attention kernels: paged decode
// (decode.cu) and the fused RoPE + cache append (rope_append.cu). No torch: pointers are device
// addresses as integers; the launchers validate and throw std::invalid_argument /
// std::runtime_error naming the argument.
#pragma once
#include <cstdint>

#include "fusedist/common/common.h"
#include "fusedist/common/op_error.h"

namespace fusedist {

// ---- decode.cu ---------------------------------------------------------------------------
// One paged decode call (csrc/include/fusedist/attention/decode.cuh has the layouts).
struct DecodeArgs {
  uintptr_t q = 0, k_cache = 0, v_cache = 0, k_scale = 0, v_scale = 0;
  uintptr_t block_table = 0, seq_lens = 0, out = 0;
  uintptr_t o_partial = 0, lse_partial = 0, counters = 0;  // workspace (num_splits > 1)
  int batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0, page_size = 0, bt_stride = 0;
  int num_splits = 1;
  int stages = 0;                  // cp.async ring per warp: 0 the default, 2 (FP8 caches)
  int fp8_direct = 0;              // FP8 caches: fragments converted in registers (decode.cuh)
  int cluster = 0;                 // 1: merge the splits in a thread-block cluster (2..16 splits;
                                   // no workspace needed)
  int bt_cols = 0, num_pages = 0;  // block-table columns in use; pages in the cache
  uintptr_t err = 0;               // OpErrorRecord* (fusedist/common/op_error.h), or 0
  float scale = 0.f;
  DType q_dtype = DType::kBFloat16, kv_dtype = DType::kBFloat16;
};

// Launch on `stream` (a cudaStream_t as an integer). The grid is (num_splits,
// kv_heads * ceil(group / 16), batch): fixed by the arguments, never by the lengths.
void attention_decode(const DecodeArgs& args, uintptr_t stream);

// Resident CTAs per SM of the instantiation (the planner sizes its grid with it).
int attention_decode_ctas_per_sm(int head_dim, DType q_dtype, DType kv_dtype, int stages = 0,
                                 int fp8_direct = 0);

// The paged-metadata check of the torch attention paths (paged_check.cuh): rows x cols
// block-table entries with their seq_lens; writes bad_rows (uint8 [rows]) and records into err.
struct PagedCheckArgs {
  uintptr_t block_table = 0, seq_lens = 0, bad_rows = 0, err = 0;
  int rows = 0, cols = 0, bt_stride = 0, page_size = 0, num_pages = 0;
  uint32_t op = 0;   // OpErrorOp (fusedist/common/op_error.h)
};
void paged_check(const PagedCheckArgs& args, uintptr_t stream);

// The torch paths' NaN for the rows paged_check marked bad (paged_check.cuh): seqs sequences of
// `tokens` rows each, row t of sequence s at out + (s * tokens + t) * token_stride bytes,
// row_bytes each (a multiple of 4, 4-byte aligned), filled with NaN of elem_bytes (2 or 4)
// where bad_rows[s] (uint8) is set.
struct PoisonRowsArgs {
  uintptr_t bad_rows = 0, out = 0;
  int64_t token_stride = 0, row_bytes = 0;
  int seqs = 0, tokens = 0, elem_bytes = 2;
  uint32_t nan_bits = 0;   // the dtype's NaN bit pattern (16 or 32 bits)
};
void poison_rows(const PoisonRowsArgs& args, uintptr_t stream);

constexpr int kAttentionDecodeMaxSplits = 128;
constexpr int kAttentionDecodeTileHeads = 8;
constexpr int kAttentionDecodeSlab = 16;
constexpr int kAttentionDecodeMaxClusterSplits = 16;

// ---- prefill.cu --------------------------------------------------------------------------
// One paged chunked-prefill call (csrc/include/fusedist/attention/prefill.cuh has the layouts).
struct PrefillArgs {
  uintptr_t q = 0, k_cache = 0, v_cache = 0, k_scale = 0, v_scale = 0;
  uintptr_t block_table = 0, seq_lens = 0, cu_seqlens_q = 0, out = 0;
  uintptr_t o_partial = 0, lse_partial = 0;  // workspace (num_splits > 1)
  int64_t q_stride = 0;                      // elements between tokens of q
  int tokens = 0, batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0, page_size = 0;
  int bt_stride = 0, bt_cols = 0, num_pages = 0;
  int max_q_len = 0;   // the longest query span the grid covers
  int num_splits = 1;  // key splits per tile (a merge kernel combines them)
  int tile_rows = 0;   // query rows per CTA: 64 (0: the default) or 128 (head_dim 128)
  int tile_warps = 0;  // 4 (0: the default; 128 rows: 2 m16 tiles a warp) or 8 (128 rows)
  int mainloop = 0;    // 0: mma.sync; 1: wgmma (sm_90a; head_dim 128, 64 rows / 4 warps or 128 / 8)
  uintptr_t err = 0;   // OpErrorRecord* (fusedist/common/op_error.h), or 0
  float scale = 0.f;
  DType q_dtype = DType::kBFloat16, kv_dtype = DType::kBFloat16;
};

// Launch on `stream`. The grid is (ceil(max_q_len / (tile_rows / group)) * num_splits,
// kv_heads, batch), fixed by the arguments, never by the lengths (one graph replays with new
// ones).
void attention_prefill(const PrefillArgs& args, uintptr_t stream);

// Query tokens per CTA tile for a GQA group (tile_rows / group).
int attention_prefill_tile_tokens(int group, int tile_rows = 64);

constexpr int kAttentionPrefillMaxSplits = 64;

// ---- rope_append.cu ----------------------------------------------------------------------
// RoPE on q and k plus the paged-cache append, one kernel (csrc/include/fusedist/attention/
// rope_append.cuh has the layouts).
struct RopeAppendArgs {
  uintptr_t q = 0, k = 0, v = 0, positions = 0, cos_sin = 0;
  uintptr_t k_cache = 0, v_cache = 0, k_scale = 0, v_scale = 0, slot_mapping = 0;
  int64_t tokens = 0;
  int64_t num_slots = 0;   // num_pages * page_size: slots at or past it are bad metadata
  uintptr_t err = 0;       // OpErrorRecord* (fusedist/common/op_error.h), or 0
  int q_heads = 0, kv_heads = 0, head_dim = 0, rot = 0, max_position = 0;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;   // elements between tokens
  bool positions_int64 = true;
  int style = 0;   // 0 neox, 1 gptj
  DType dtype = DType::kBFloat16, cache_dtype = DType::kBFloat16;
  // Head norm before the rotation (rope_append.cuh): [head_dim] weights of norm_dtype
  // (float32 or dtype), both or neither.
  uintptr_t q_norm = 0, k_norm = 0;
  float norm_eps = 0.f;
  DType norm_dtype = DType::kFloat32;
};

void rope_append(const RopeAppendArgs& args, uintptr_t stream);

}  // namespace fusedist
