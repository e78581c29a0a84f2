// The (head_dim, q dtype, KV dtype) combinations the paged attention kernels are built for
// (decode.cu, prefill.cu): one check, the op's name in its message.
#pragma once
#include <string>

#include "fusedist/common/common.h"

namespace fusedist {

inline void check_attention_dtypes(const char* op, int head_dim, DType q, DType kv) {
  const std::string w = std::string(op) + ": ";
  FUSEDIST_CHECK_ARG(q == DType::kBFloat16 || q == DType::kFloat16,
                     w + "q must be bfloat16 or float16, got " + dtype_name(q));
  FUSEDIST_CHECK_ARG(kv == q || kv == DType::kFloat8E4M3,
                     w + "the KV cache must have q's dtype (" + dtype_name(q) +
                         ") or float8_e4m3fn, got " + dtype_name(kv));
  FUSEDIST_CHECK_ARG(head_dim == 64 || head_dim == 128 || head_dim == 256,
                     w + "head_dim must be 64, 128 or 256, got " + std::to_string(head_dim));
}

}  // namespace fusedist
