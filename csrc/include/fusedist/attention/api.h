// fusedist/attention/api.h -- host entry points of the attention kernels (no torch).
// Pointers are device addresses as integers; the launchers validate and throw
// std::invalid_argument / std::runtime_error naming the argument.
#pragma once
#include <cstdint>

#include "fusedist/common/common.h"

namespace fusedist {

// One paged decode call (csrc/include/fusedist/attention/decode.cuh has the layouts).
struct DecodeArgs {
  uintptr_t q = 0, k_cache = 0, v_cache = 0, k_scale = 0, v_scale = 0;
  uintptr_t block_table = 0, seq_lens = 0, out = 0;
  uintptr_t o_partial = 0, lse_partial = 0, counters = 0;  // workspace (num_splits > 1)
  int batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0, page_size = 0, bt_stride = 0;
  int num_splits = 1;
  float scale = 0.f;
  DType q_dtype = DType::kBFloat16, kv_dtype = DType::kBFloat16;
};

// Launch on `stream` (a cudaStream_t as an integer). The grid is (num_splits,
// kv_heads * ceil(group / 16), batch): fixed by the arguments, never by the lengths.
void attention_decode(const DecodeArgs& args, uintptr_t stream);

// Resident CTAs per SM of the instantiation (the planner sizes its grid with it).
int attention_decode_ctas_per_sm(int head_dim, DType q_dtype, DType kv_dtype);

constexpr int kAttentionDecodeMaxSplits = 128;
constexpr int kAttentionDecodeTileHeads = 8;
constexpr int kAttentionDecodeSlab = 16;

}  // namespace fusedist
