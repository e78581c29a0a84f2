// fusedist/attention/rope_api.h -- host entry point of the fused RoPE + cache append (no torch).
// Pointers are device addresses as integers; the launcher validates and throws
// std::invalid_argument naming the argument. Layouts: csrc/include/fusedist/attention/
// rope_append.cuh.
#pragma once
#include <cstdint>

#include "fusedist/common/common.h"

namespace fusedist {

struct RopeAppendArgs {
  uintptr_t q = 0, k = 0, v = 0, positions = 0, cos_sin = 0;
  uintptr_t k_cache = 0, v_cache = 0, k_scale = 0, v_scale = 0, slot_mapping = 0;
  int64_t tokens = 0;
  int q_heads = 0, kv_heads = 0, head_dim = 0, rot = 0, max_position = 0;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;   // elements between tokens
  bool positions_int64 = true;
  int style = 0;   // 0 neox, 1 gptj
  DType dtype = DType::kBFloat16, cache_dtype = DType::kBFloat16;
};

void rope_append(const RopeAppendArgs& args, uintptr_t stream);

}  // namespace fusedist
