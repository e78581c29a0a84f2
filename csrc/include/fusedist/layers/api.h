// fusedist/layers/api.h -- host entry points of the single-GPU layer kernels: residual add +
// RMSNorm (add_rmsnorm.cuh), SiLU-and-multiply (silu_mul.cuh) and per-token FP8 quantization
// (quantize_rows.cuh). No torch: pointers are device addresses as integers, strides are in
// elements; the launchers validate and throw std::invalid_argument naming the argument.
#pragma once
#include <cstdint>

#include "fusedist/common/common.h"

namespace fusedist {

// Widest row add_rmsnorm holds in registers, in 16-byte vectors: hidden <= 32768 for
// bf16/fp16, <= 16384 for fp32 (fusedist/ops/add_rmsnorm.py keeps the same number).
constexpr int kAddRmsNormMaxVectors = 4096;

// h = x + residual (rounded to dtype) written back into residual; out = rmsnorm(h) * weight.
// residual = 0: plain RMSNorm of x (nothing written but out). out may be x itself.
// fp8_out: out is e4m3 [tokens, out_stride] (out_stride in e4m3 elements, a multiple of the
// 16-byte vector's elements of dtype) and scale float32 [tokens]: per row scale = max(amax of
// the fp32 normed row, 1e-12) / 448, out = e4m3(normed / scale) (layers/fp8_rows.cuh).
struct AddRmsNormArgs {
  uintptr_t x = 0, residual = 0, weight = 0, out = 0;
  uintptr_t scale = 0;  // fp8_out only
  bool fp8_out = false;
  int64_t tokens = 0;
  int hidden = 0;
  int64_t x_stride = 0, residual_stride = 0, out_stride = 0;  // elements between rows
  float eps = 1e-6f;
  DType dtype = DType::kBFloat16;
  int vectors_per_thread = 0;  // 0: the launcher's choice; 1, 2, 4 or 8 (benchmarks sweep it)
};

void add_rmsnorm(const AddRmsNormArgs& args, uintptr_t stream);

// out[t, :] = silu(gate_up[t, :inter]) * gate_up[t, inter:], fp32 math, one rounding.
// fp8_out: out is e4m3 [tokens, out_stride] and scale float32 [tokens], as add_rmsnorm's.
struct SiluMulArgs {
  uintptr_t gate_up = 0, out = 0;
  uintptr_t scale = 0;  // fp8_out only
  bool fp8_out = false;
  int64_t tokens = 0;
  int inter = 0;
  int64_t in_stride = 0, out_stride = 0;  // elements between rows
  DType dtype = DType::kBFloat16;
};

void silu_mul(const SiluMulArgs& args, uintptr_t stream);

// Per-token FP8 quantization (quantize_rows.cuh): out e4m3 [tokens, out_stride], scale float32
// [tokens], scale = max(amax |x|, 1e-30) / 448 (1 for a row of zeros), out = e4m3(x / scale).
struct QuantizeRowsArgs {
  uintptr_t x = 0, out = 0, scale = 0;
  int64_t tokens = 0;
  int k = 0;
  int64_t in_stride = 0, out_stride = 0;  // elements between rows
  DType dtype = DType::kBFloat16;
  // 0: one scale per row (scale [tokens]); else one per `group` consecutive elements of a row
  // (scale [tokens, k / group], contiguous): group a multiple of the 16-byte vector, k of group,
  // and group / vector elements 8, 16 or 32.
  int group = 0;
};

void quantize_rows(const QuantizeRowsArgs& args, uintptr_t stream);

}  // namespace fusedist
