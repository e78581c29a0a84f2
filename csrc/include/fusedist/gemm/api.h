// fusedist/gemm/api.h -- the host API of the GEMM area's launchers (gemm_comm.cu, gemm.cu,
// gemv.cu): what the bindings expose of the fused decode GEMM + all-reduce, the fused engines'
// comm-stream kernels, the Hopper GEMM and the decode GEMV. Plain C++ (no torch, no device code): pointers
// travel as uintptr_t, streams as cudaStream_t.
#pragma once
#include <string>
// SymmComm and CallDesc, and with them common.h (DType), layout.h (GEMM tile constants,
// kMaxSignalPieces), <cstdint> and <vector>.
#include "fusedist/comm/api.h"

namespace fusedist {

// ---- gemm_comm.cu --------------------------------------------------------------------------
// Fused decode GEMM + all-reduce: out[m, n] = sum over ranks of x[m, k] @ w (+ bias), one kernel
// (gemm_comm.cuh). comm == nullptr: no exchange, a plain skinny GEMM on the current device.
// w is [k, n] with row stride ldw, or [n, k] with row stride ldw when w_nk (nn.Linear weight).
constexpr int kGemmArFusedMaxM = 128;
void gemm_ar_fused(const SymmComm* comm, uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw,
                   bool w_nk, uintptr_t bias, uintptr_t out, int m, int n, int k, DType dtype,
                   uintptr_t stream);
// gemm_rs engine='fused', on the comm stream: wait (one thread, bounded by the communicator's
// timeout) until rank `src`'s GEMM signalled `expected` tiles of piece `piece` of this rank's
// block into this rank's counters at `signal_offset` (gemm_sm90.cuh), then clear the counter.
void gemm_rs_counter_wait(const SymmComm& comm, uint64_t signal_offset, int src, int piece,
                          uint32_t expected, uintptr_t stream);

// gemm_ar engine='overlap', transport='copy_engine', last step: out rows [b[p], b[p + 1]) =
// rank p's staging rows there. SMs push this rank's rows into every peer's staging (the rows
// of the partials it pulled), one token per block; on timeout the peers' rows become NaN.
// row_bytes: bytes per row in both; out: row 0 of out. desc: the call's descriptor (the one
// its call checks carry), exchanged by block 0.
void gemm_ar_staging_gather(const SymmComm& comm, uint64_t staging_offset,
                            const std::vector<int64_t>& row_bounds, int64_t row_bytes,
                            uintptr_t out, const CallDesc& desc, uintptr_t stream);

// ---- gemm.cu ------------------------------------------------------------------------------
// Hopper GEMM (gemm_sm90.cuh): out[m, n] = x[m, k] @ w + beta * c + bias, fp32 accumulation.
// w as in gemm_ar_fused; c (0: none) and out row-major with row strides ldc / ldo.
// The fused engines' protocols (gemm_sm90.cuh); both need comm and leave a few SMs free:
//  * `wait` (flags != 0), on_c == false, ag_gemm: x is the gathered input, rank comm.rank's
//    block first, each tile after the copy pieces of its A rows are flagged.
//  * `wait`, on_c == true, gemm_rs's own block: one block of m rows whose C rows arrive in
//    `pieces` flagged pieces from rank `peer`; the C-load warp waits for them.
//  * `signal` (pieces != 0), gemm_rs's peer blocks: rows [row0, row0 + m) of the block layout
//    (none of them this rank's); each stored tile adds 1 on the owner's counters.
// tile (layout.h, Sm90Tile): 0 picks (a plain GEMM: the narrow tile up to 64 rows, the
// one-warpgroup swap tile to 128, the mid tile up to kGemmSm90MidMaxM rows with whole tiles
// readable; else the wide one);
// 1 wide; 2 narrow; 3 mid; 4 swap; 5 swap_1wg (all but wide: plain GEMMs only).
// raster (layout.h, Sm90Raster): 0 picks by tile; 1 along N; 2 along M (plain GEMMs only).
// m_load (plain GEMMs): rows of x (from row 0, row stride ldx) that may be read, m or more;
// the mainloop reads up to a whole tile of them, so no tile load runs past x's end (those
// loads are slow); rows past m never reach out. 0: m.
struct GemmWaitArgs {
  uintptr_t flags = 0;  // uint32 [blocks * pieces]; 0: no wait
  int block_rows = 0;   // rows per block
  int pieces = 1;       // copy pieces per block
  bool on_c = false;
  int peer = -1;        // on_c: the rank the rows come from (a timeout names it)
};
struct GemmSignalArgs {
  uint64_t offset = 0;  // bytes from every rank's symmetric base to its counters
  int row0 = 0;         // block-layout row of x's row 0
  int block_rows = 0;   // rows per rank block
  int pieces = 0;       // pieces per block (<= kMaxSignalPieces); 0: no signals
};
void gemm_sm90(const SymmComm* comm, uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw, bool w_nk,
               uintptr_t bias, uintptr_t c, int64_t ldc, float beta, uintptr_t out, int64_t ldo,
               int m, int n, int k, DType dtype, const GemmWaitArgs& wait,
               const GemmSignalArgs& signal, uintptr_t stream, int tile = 0, int raster = 0,
               int m_load = 0);

// ---- gemv.cu ------------------------------------------------------------------------------
// Decode GEMM at GEMV scale (gemv.cuh): out[m, n] = x[m, k] @ w[n, k]^T (* scale) (+ bias),
// fp32 accumulation, one rounding. x, bias and out bf16; w bf16 or e4m3 (w_dtype), row-major
// [n, k] (an nn.Linear weight) with row stride ldw elements. 1 <= m <= kGemvMaxM; k a multiple
// of 8 (bf16 w) or 16 (e4m3 w); any n. Scales (e4m3 w only; float32): kGemvScaleTensor
// scale[0]; kGemvScaleChannel scale[n]; kGemvScaleBlock scale[n / 128][k / 128], rows
// scale_ld floats apart (>= ceil(k / 128)). The workspace (gemv_plan says how much):
// `workspace` float32 [workspace_floats], `counters` int32 [counters], zero before the first
// call and left zero by every call; calls sharing them run one at a time (stream order).
// x_dtype e4m3 (W8A8, e4m3 w with tensor or channel scales only, the register pipeline):
// x is e4m3 with x_scale float32 [m] per row, out[m, n] = x_scale[m] * scale * (x_q @ w_q^T),
// 1 <= m <= kGemvMaxMFp8X.
constexpr int kGemvMaxM = 16;
constexpr int kGemvMaxMFp8X = 64;
constexpr int kGemvScaleBlockSize = 128;
// Weight pipelines: 0 streams through registers (two units per thread in flight); 1..8 through
// a ring of that many units (~35 KB each) in shared memory filled by the copy engine; auto: the
// default.
constexpr int kGemvStagesAuto = -1;
constexpr int kGemvMaxStages = 6;
constexpr int kGemvDefaultStages = 0;
enum GemvScale : int {
  kGemvScaleNone = 0,
  kGemvScaleTensor = 1,
  kGemvScaleChannel = 2,
  kGemvScaleBlock = 3,
};
struct GemvArgs {
  uintptr_t x = 0, w = 0, scale = 0, bias = 0, out = 0;
  uintptr_t x_scale = 0;              // x_dtype e4m3: float32 [m]
  uintptr_t workspace = 0, counters = 0;
  int m = 0, n = 0, k = 0;
  int64_t ldx = 0, ldw = 0, ldo = 0;  // elements between rows
  int64_t scale_ld = 0;               // block scales: floats between scale rows
  DType dtype = DType::kBFloat16;     // bias, out (and x unless x_dtype says e4m3)
  DType w_dtype = DType::kBFloat16;   // bf16 or float8_e4m3fn
  DType x_dtype = DType::kBFloat16;   // bf16, or float8_e4m3fn with x_scale (W8A8)
  int scale_mode = kGemvScaleNone;
  int64_t workspace_floats = 0;       // capacities, checked against the plan
  int64_t counters_len = 0;
  int max_ctas = 0;                   // 0: every resident CTA; else at most this many
  int stages = -1;                    // kGemvStagesAuto, 0 (register pipeline) or ring stages
};
// Grid and workspace of a call: grid CTAs, `workspace_floats` floats of partial sums and
// `counters` strip counters (both 0: no strip is split), strip_rows rows per strip, at
// ctas_per_sm resident CTAs per SM. Reads m, n, k, w_dtype, scale_mode and max_ctas only.
struct GemvPlan {
  int grid = 0;
  int64_t workspace_floats = 0;
  int64_t counters = 0;
  int strip_rows = 0;
  int ctas_per_sm = 0;
  int units = 0;
  int stages = 0;      // 0: register pipeline; else shared-memory ring stages
  int smem_bytes = 0;  // dynamic shared memory per CTA
};
GemvPlan gemv_plan(const GemvArgs& args);
void gemv(const GemvArgs& args, uintptr_t stream);

// ---- FP8 (W8A8) GEMM, Hopper (fp8_gemm_sm90.cuh) ------------------------------------------
// out[M, N] = out_dtype(sx[m] * sw[n] * sum_k xq[m, k] wq[n, k] + bias[n]); xq e4m3 [M, K],
// wq e4m3 [N, K] (row strides ldx, ldw elements), sx float32 [M], sw float32 [N], bias
// out_dtype [N] or 0, out [M, N] (row stride ldo). out_dtype: bf16.
struct Fp8GemmArgs {
  uintptr_t xq = 0, sx = 0, wq = 0, sw = 0, bias = 0, out = 0;
  int m = 0, n = 0, k = 0;
  int64_t ldx = 0, ldw = 0, ldo = 0;
  DType out_dtype = DType::kBFloat16;
  int sms = 0;  // persistent CTAs; 0: the device's SM count
  // block = 1: the 128 x 128 block-scaled form (fp8_gemm_sm90.cuh Fp8GemmBlockSm90): sx float32
  // [m, ceil(k / 128)] and sw float32 [ceil(n / 128), ceil(k / 128)], both contiguous.
  int block = 0;
  // Stream-K partial tiles and their flags: fp8_gemm_workspace_size(args) bytes, 16-byte
  // aligned; calls sharing a workspace run one at a time (stream order).
  uintptr_t workspace = 0;
  int64_t workspace_bytes = 0;
};
// Why the kernel cannot take these sizes and strides ("" when it can); never throws.
std::string fp8_gemm_why_not(const Fp8GemmArgs& args);
// Workspace bytes the call needs (0 when every tile is whole); args must pass fp8_gemm_why_not.
int64_t fp8_gemm_workspace_size(const Fp8GemmArgs& args);
void fp8_gemm(const Fp8GemmArgs& args, uintptr_t stream);

}  // namespace fusedist
