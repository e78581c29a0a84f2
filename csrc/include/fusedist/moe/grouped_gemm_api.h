// fusedist/moe/grouped_gemm_api.h -- host entry points of the MoE grouped GEMMs: the CUTLASS
// grouped GEMM (gemm/grouped_gemm_sm90.cuh; launchers csrc/ops/moe/grouped_gemm*.cu) and the
// grouped decode GEMV (gemm/grouped_gemv.cuh; csrc/ops/moe/grouped_gemv.cu). No torch:
// pointers are device addresses as integers, strides in elements; checks throw
// std::invalid_argument naming the argument (the why_not functions return the reason
// instead, and never throw).
#pragma once
#include <cstdint>
#include <string>

#include "fusedist/common/common.h"

namespace fusedist {

// Scale layouts (MoeGroupedGemmArgs.x_scale_mode / w_scale_mode; fusedist/ops/moe/
// grouped_gemm.py keeps the same numbers).
enum MoeXScale : int {
  kMoeXScaleNone = 0,   // bf16 x
  kMoeXScaleRow = 1,    // e4m3 x, x_scale float32 [x_rows]
  kMoeXScaleGroup = 2,  // e4m3 x, x_scale float32 [x_rows, k / 128]
};
enum MoeWScale : int {
  kMoeWScaleNone = 0,     // bf16 w
  kMoeWScaleExpert = 1,   // e4m3 w, w_scale float32 [experts]
  kMoeWScaleChannel = 2,  // e4m3 w, w_scale float32 [experts, n]
  kMoeWScaleBlock = 3,    // e4m3 w, w_scale float32 [experts, ceil(n / 128), ceil(k / 128)]
};

// The grouped decode GEMV's tasks: rows of one expert handled together (x rows padded to 8),
// and the most experts a call may have (the kernel keeps a prefix over them in shared memory).
constexpr int kMoeGemvTaskRows = 8;
constexpr int kMoeGemvMaxExperts = 1024;

// One call: out[offsets[e] + i, :] = x_row(offsets[e] + i) @ dequant(w[e]).t() for every expert
// e and i < counts[e] (fusedist.ops.moe.grouped_gemm). The layout is the device tensors of a
// fusedist.ops.moe.MoeLayout (int32): counts [experts], offsets [experts + 1], src_index [rows].
// x_row(r) is row r of x, or with gather row src_index[r] / top_k of a token-order x.
struct MoeGroupedGemmArgs {
  uintptr_t x = 0, w = 0, out = 0;     // x [x_rows, ldx], w [experts, n, k], out [rows, n] bf16
  uintptr_t x_scale = 0, w_scale = 0;  // float32, as the scale modes say
  uintptr_t counts = 0, offsets = 0, src_index = 0;
  int experts = 0, n = 0, k = 0;
  int64_t rows = 0;    // rows of out (the layout's capacity)
  int64_t x_rows = 0;  // rows of x: rows, or the tokens with gather
  int64_t ldx = 0;     // elements between rows of x
  int top_k = 1;
  int gather = 0;      // 1: x in token order (the GEMV only)
  DType x_dtype = DType::kBFloat16;
  DType w_dtype = DType::kBFloat16;
  int x_scale_mode = kMoeXScaleNone;
  int w_scale_mode = kMoeWScaleNone;
  // The GEMM's workspace: moe_grouped_gemm_workspace_size(args) bytes, 128-byte aligned;
  // calls sharing one run one at a time (stream order).
  uintptr_t workspace = 0;
  int64_t workspace_bytes = 0;
  // The GEMV's: partial sums (float32) and task counters (int32, zero before the first call
  // and left zero by every call), as moe_grouped_gemv_plan says.
  uintptr_t partial = 0, counters = 0;
  int64_t partial_floats = 0, counters_len = 0;
  int64_t pairs = 0;  // GEMV: (token, slot) pairs of the layout (T top_k): sizes the worst case
  int max_ctas = 0;   // GEMV: 0 every resident CTA, else at most this many
};

// ---- the grouped GEMM (CUTLASS, prefill sizes) ----------------------------------------------
// Takes bf16 x with bf16 w; e4m3 x with per-row scales and e4m3 w with per-expert or
// per-channel scales; e4m3 x with per-128-k scales and 128 x 128 block-scaled w.
std::string moe_grouped_gemm_why_not(const MoeGroupedGemmArgs& args);
int64_t moe_grouped_gemm_workspace_size(const MoeGroupedGemmArgs& args);
void moe_grouped_gemm(const MoeGroupedGemmArgs& args, uintptr_t stream);

// ---- the grouped GEMV (decode: a few rows per expert) ---------------------------------------
// bf16 x (gather or not) with bf16 w or e4m3 w under any w scale mode. The work is sized at
// plan time for the worst routing of `pairs` pairs; the kernel reads the routing on the
// device and divides the actual work evenly over the grid.
struct MoeGroupedGemvPlan {
  int grid = 0;                 // CTAs
  int ctas_per_sm = 0;
  int strip_rows = 0;           // output columns per strip
  int64_t max_tasks = 0;        // worst-case (expert, strip, 8-row chunk) tasks
  int64_t partial_floats = 0;   // workspace the call needs
  int64_t counters = 0;
};
std::string moe_grouped_gemv_why_not(const MoeGroupedGemmArgs& args);
MoeGroupedGemvPlan moe_grouped_gemv_plan(const MoeGroupedGemmArgs& args);
void moe_grouped_gemv(const MoeGroupedGemmArgs& args, uintptr_t stream);

}  // namespace fusedist
