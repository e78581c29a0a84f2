// Host launchers of gemm_comm.cuh: the fused decode GEMM + all-reduce (argument checks, the
// tile configuration for M, grid sizing from values identical on every rank), the fused
// gemm_rs's comm-stream counter wait and the closing gather of gemm_ar's copy-engine pipeline.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <string>
#include <vector>

#include "fusedist/gemm/api.h"
#include "fusedist/gemm/gemm_comm.cuh"
#include "fusedist/common/launch.h"

namespace fusedist {

namespace {
static_assert(kGemmArFusedMaxM == GemmArTile<2, 4, 8>::kMPad, "largest tile config covers kGemmArFusedMaxM rows");

// cuTensorMapEncodeTiled, reached through the runtime (fusedist links no driver library).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static auto fn =
      reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(driver_entry_point("cuTensorMapEncodeTiled"));
  return fn;
}

// A 2-D row-major tensor (rows x cols, row stride `ld` elements) as box_rows x 64 tiles with
// the 128-byte swizzle the kernel's ldmatrix addressing expects; the copy engine zero-fills
// the out-of-range part of edge tiles.
CUtensorMap tile_map(uintptr_t ptr, uint64_t rows, uint64_t cols, int64_t ld, uint32_t box_rows,
                     DType dtype, const char* what) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * dtype_size(dtype)};
  const cuuint32_t box[2] = {64, box_rows};  // 64 elements = one 128-byte swizzle row
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      2, reinterpret_cast<void*>(ptr), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string("fusedist: gemm_ar: cuTensorMapEncodeTiled failed (CUresult ") +
                             std::to_string(int(r)) + ") for " + what);
  return map;
}

struct Args {
  SymmView view;
  CUtensorMap wmap, xmap;
  int max_blocks;
  uintptr_t x, w, bias, out;
  int64_t ldx, ldw;
  int m, n, k;
  DType dtype;
  cudaStream_t stream;
};

template <typename T, int kMT, int kWM, int kWarps, bool kNK>
void launch_cfg(Args& a) {
  using Cfg = GemmArTile<kMT, kWM, kWarps>;
  auto kernel = gemm_ar_kernel<T, kMT, kWM, kWarps, kNK>;
  a.xmap = tile_map(a.x, a.m, a.k, a.ldx, Cfg::kMPad, a.dtype, "x");
  const int strips = (a.n + kGemmArBN - 1) / kGemmArBN;
  const int per_sm =
      blocks_per_sm(reinterpret_cast<const void*>(kernel), Cfg::kThreads, Cfg::kSmemBytes);
  const int grid = std::min(strips, a.max_blocks * per_sm);
  launch_kernel_smem("gemm_ar_kernel", kernel, grid, Cfg::kThreads, Cfg::kSmemBytes, a.stream,
                     a.view, a.wmap, a.xmap, reinterpret_cast<const T*>(a.bias),
                     reinterpret_cast<T*>(a.out), a.m, a.n, a.k);
}

// Four tile configurations (rows per stage 16 / 32 / 64 / 128) x two weight layouts.
template <typename T, bool kNK>
void launch_layout(Args& a) {
  if (a.m <= 16)
    launch_cfg<T, 1, 1, 4, kNK>(a);
  else if (a.m <= 32)
    launch_cfg<T, 2, 1, 4, kNK>(a);
  else if (a.m <= 64)
    launch_cfg<T, 2, 2, 8, kNK>(a);
  else
    launch_cfg<T, 2, 4, 8, kNK>(a);
}

template <typename T>
void launch_dtype(Args& a, bool w_nk) {
  if (w_nk)
    launch_layout<T, true>(a);
  else
    launch_layout<T, false>(a);
}
}  // namespace

void gemm_ar_fused(const SymmComm* comm, uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw,
                   bool w_nk, uintptr_t bias, uintptr_t out, int m, int n, int k, DType dtype,
                   uintptr_t stream) {
  const std::string op = "gemm_ar(engine='fused'): ";
  FUSEDIST_CHECK_ARG(m >= 1 && m <= kGemmArFusedMaxM,
                     op + "M = " + std::to_string(m) + " rows; the fused kernel takes 1.." +
                         std::to_string(kGemmArFusedMaxM) + " (use engine='overlap' or 'unfused')");
  FUSEDIST_CHECK_ARG(n >= 1 && k >= 1, op + "N and K must be positive");
  FUSEDIST_CHECK_ARG(n % 8 == 0 && k % 8 == 0 && ldx % 8 == 0 && ldw % 8 == 0,
                     op + "N (" + std::to_string(n) + "), K (" + std::to_string(k) +
                         ") and the row strides of x and w must be multiples of 8 elements");
  FUSEDIST_CHECK_ARG(ldx >= k && ldw >= (w_nk ? k : n), op + "row stride smaller than the row");
  for (uintptr_t p : {x, w, out})
    FUSEDIST_CHECK_ARG(p % 16 == 0, op + "x, w and out must be 16-byte aligned");
  FUSEDIST_CHECK_ARG(dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                     op + std::string("dtype ") + dtype_name(dtype) +
                         " unsupported; use bfloat16 or float16");
  Args a{};
  a.x = x, a.w = w, a.bias = bias, a.out = out, a.ldx = ldx, a.ldw = ldw;
  a.m = m, a.n = n, a.k = k;
  a.stream = reinterpret_cast<cudaStream_t>(stream);
  if (comm != nullptr && comm->view.world > 1) {
    const uint64_t bytes = uint64_t(m) * n * dtype_size(dtype);
    FUSEDIST_CHECK_ARG(bytes <= comm->view.slot_bytes,
                       op + "the [M, N] output (" + std::to_string(bytes) +
                           " bytes) exceeds the communicator's one-shot slot of " +
                           std::to_string(comm->view.slot_bytes) + " bytes");
    a.view = comm->view;
    a.max_blocks = comm->max_blocks;
  } else {
    a.view.world = 1;
    a.view.rank = 0;
    a.max_blocks = current_device_sm_count();
  }
  a.dtype = dtype;
  // w as [K, N] tiles of 64 k-rows x 64 n, or [N, K] tiles of 64 n-rows x 64 k.
  a.wmap = w_nk ? tile_map(w, n, k, ldw, kGemmArBN, dtype, "w")
                : tile_map(w, k, n, ldw, kGemmArBK, dtype, "w");
  if (dtype == DType::kBFloat16)
    launch_dtype<__nv_bfloat16>(a, w_nk);
  else
    launch_dtype<__half>(a, w_nk);
}

void gemm_rs_counter_wait(const SymmComm& comm, uint64_t signal_offset, int src, int piece,
                          uint32_t expected, uintptr_t stream) {
  const SymmView& v = comm.view;
  FUSEDIST_CHECK_ARG(src >= 0 && src < v.world && src != v.rank,
                     "gemm_rs counter wait: src must be another rank of the group");
  FUSEDIST_CHECK_ARG(piece >= 0 && piece < kMaxSignalPieces,
                     "gemm_rs counter wait: piece outside 0.." + std::to_string(kMaxSignalPieces - 1));
  uint32_t* counter = reinterpret_cast<uint32_t*>(v.base[v.rank] + signal_offset) +
                      src * kMaxSignalPieces + piece;
  counter_wait_kernel<<<1, 32, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      counter, expected, v.ctl, v.err, v.timeout_ns, v.rank, src);
  FUSEDIST_LAUNCH_CHECK("counter_wait_kernel");
}

void gemm_ar_staging_gather(const SymmComm& comm, uint64_t staging_offset,
                            const std::vector<int64_t>& row_bounds, int64_t row_bytes,
                            uintptr_t out, const CallDesc& desc, uintptr_t stream) {
  const SymmView& v = comm.view;
  const std::string op = "gemm_ar staging gather: ";
  FUSEDIST_CHECK_ARG(int(row_bounds.size()) == v.world + 1,
                     op + "row_bounds needs world + 1 = " + std::to_string(v.world + 1) + " entries");
  FUSEDIST_CHECK_ARG(row_bytes > 0 && row_bytes % 16 == 0 && out % 16 == 0,
                     op + "rows must be whole 16-byte vectors and out 16-byte aligned");
  RowSplit split{};
  for (int p = 0; p <= v.world; ++p) {
    split.lo[p] = row_bounds[p];
    FUSEDIST_CHECK_ARG(row_bounds[p] >= 0 && (p == 0 || row_bounds[p] >= row_bounds[p - 1]),
                       op + "row_bounds must be non-negative and non-decreasing");
  }
  const int64_t row_vecs = row_bytes / 16;
  int64_t rank_rows = 0;  // the most rows one rank pushes
  for (int p = 0; p < v.world; ++p) rank_rows = std::max(rank_rows, split.lo[p + 1] - split.lo[p]);
  const auto kernel = reinterpret_cast<const void*>(staging_gather_kernel);
  const int64_t per_block = int64_t(kStagingGatherThreads) * kStagingGatherUnroll;
  const int64_t want = (rank_rows * row_vecs + per_block - 1) / per_block;
  // Resident blocks only (block b waits for the peers' block b), from values identical on
  // every rank; one token per block must fit a slot.
  const int64_t cap = std::min<int64_t>(
      int64_t(comm.max_blocks) * blocks_per_sm(kernel, kStagingGatherThreads, 0),
      int64_t(v.slot_bytes / 16));
  const int grid = int(std::max<int64_t>(1, std::min(want, cap)));
  launch_kernel("staging_gather_kernel", staging_gather_kernel, grid, kStagingGatherThreads,
                reinterpret_cast<cudaStream_t>(stream), v, staging_offset, split, row_vecs,
                reinterpret_cast<Vec16*>(out), desc);
}

}  // namespace fusedist
