// Host launcher for the Hopper GEMM (gemm_sm90.cuh): argument checks, the fused engines' wait
// and signal parameters, dtype / weight-layout dispatch to the instantiations (gemm_sm90_*.cu,
// generated from gemm_sm90_inst.cu.in by the list in CMakeLists.txt).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "fusedist/gemm/api.h"
#include "fusedist/common/launch.h"
#include "gemm_sm90.h"

namespace fusedist {

namespace {

// SMs a fused engine's GEMM leaves free, so the kernels of its comm stream (the closing
// barrier; gemm_rs's counter waits) run beside it rather than after it.
constexpr int kReservedSms = 4;

// ag_gemm: x is the gathered input of `world` blocks, this rank's first.
void a_wait(ChunkWait& cw, const SymmComm& comm, const GemmWaitArgs& wait, int m) {
  const std::string op = "gemm: ";
  const int world = comm.view.world, rank = comm.view.rank;
  FUSEDIST_CHECK_ARG(wait.block_rows >= 1 && int64_t(wait.block_rows) * world == m,
                     op + "block_rows * world must equal M");
  cw.rows = m;
  // Start at the first cluster whose tiles lie wholly in this rank's block, so the first
  // wave needs no peer rows; the tiles that straddle into the previous block come last.
  const int first = (int64_t(rank) * wait.block_rows + kGemmSm90BlockM - 1) / kGemmSm90BlockM;
  cw.rotate_tiles =
      (first + kGemmSm90ClusterM - 1) / kGemmSm90ClusterM * kGemmSm90ClusterM % cw.tiles_m;
}

// gemm_rs, the own block: C's rows (one block) arrive from `peer`.
void c_wait(ChunkWait& cw, const SymmComm& comm, const GemmWaitArgs& wait, int m) {
  const std::string op = "gemm: ";
  FUSEDIST_CHECK_ARG(wait.block_rows == m, op + "a C wait covers one block: block_rows must equal M");
  FUSEDIST_CHECK_ARG(wait.peer >= 0 && wait.peer < comm.view.world && wait.peer != comm.view.rank,
                     op + "the C rows' peer must be another rank of the group");
  cw.rows = m;
  cw.rotate_tiles = 0;
  cw.on_c = true;
  cw.peer = wait.peer;
  cw.op = kOpGemmRs;
}

template <typename T, int kTile>
void run_layout(const GemmSm90Call& a, bool w_nk) {
  if (w_nk)
    gemm_sm90_run<T, true, kTile>(a);
  else
    gemm_sm90_run<T, false, kTile>(a);
}

template <typename T>
void run_tile(const GemmSm90Call& a, bool w_nk, int tile) {
  if (tile == kSm90TileNarrow)
    run_layout<T, kSm90TileNarrow>(a, w_nk);
  else if (tile == kSm90TileMid)
    run_layout<T, kSm90TileMid>(a, w_nk);
  else if (tile == kSm90TileSwap)
    run_layout<T, kSm90TileSwap>(a, w_nk);
  else if (tile == kSm90TileSwap1wg)
    run_layout<T, kSm90TileSwap1wg>(a, w_nk);
  else
    run_layout<T, kSm90TileWide>(a, w_nk);
}

}  // namespace

void gemm_sm90(const SymmComm* comm, uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw, bool w_nk,
               uintptr_t bias, uintptr_t c, int64_t ldc, float beta, uintptr_t out, int64_t ldo,
               int m, int n, int k, DType dtype, const GemmWaitArgs& wait,
               const GemmSignalArgs& signal, uintptr_t stream, int tile, int raster,
               int m_load) {
  const std::string op = "gemm: ";
  FUSEDIST_CHECK_ARG(m >= 1 && n >= 1 && k >= 1, op + "M, N and K must be positive");
  FUSEDIST_CHECK_ARG(n % 8 == 0 && k % 8 == 0,
                     op + "N (" + std::to_string(n) + ") and K (" + std::to_string(k) +
                         ") must be multiples of 8 (16-byte TMA rows)");
  for (int64_t ld : {ldx, ldw, ldo, c ? ldc : ldo})
    FUSEDIST_CHECK_ARG(ld % 8 == 0, op + "row strides must be multiples of 8 elements");
  FUSEDIST_CHECK_ARG(ldx >= k && ldw >= (w_nk ? k : n) && ldo >= n && (!c || ldc >= n),
                     op + "a row stride is smaller than its row");
  for (uintptr_t p : {x, w, out, c, bias})
    FUSEDIST_CHECK_ARG(p % 16 == 0, op + "x, w, c, bias and out must be 16-byte aligned");
  FUSEDIST_CHECK_ARG(dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                     op + std::string("dtype ") + dtype_name(dtype) +
                         " unsupported; use bfloat16 or float16");
  GemmSm90Call a{};
  a.x = x, a.w = w, a.bias = bias, a.c = c, a.out = out;
  a.ldx = ldx, a.ldw = ldw, a.ldc = ldc, a.ldo = ldo, a.beta = beta;
  a.m = m, a.n = n, a.k = k;
  a.m_load = m;
  a.stream = reinterpret_cast<cudaStream_t>(stream);
  a.sms = current_device_sm_count();
  const bool plain = wait.flags == 0 && signal.pieces == 0;
  FUSEDIST_CHECK_ARG(tile >= kSm90TileAuto && tile <= kSm90TileSwap1wg,
                     op + "tile must be 0 (auto), 1 (wide), 2 (narrow), 3 (mid), 4 (swap) or "
                          "5 (swap_1wg), got " + std::to_string(tile));
  FUSEDIST_CHECK_ARG(plain || tile == kSm90TileAuto || tile == kSm90TileWide,
                     op + "the fused engines' waits and signals run on the wide tile only");
  FUSEDIST_CHECK_ARG(raster >= kSm90RasterAuto && raster <= kSm90RasterAlongM,
                     op + "raster must be 0 (auto), 1 (along N) or 2 (along M), got " +
                         std::to_string(raster));
  FUSEDIST_CHECK_ARG(plain || raster != kSm90RasterAlongM,
                     op + "the fused engines' waits and signals hand out tiles along N only");
  // Rows of x readable (0 or m: none past m), and rows up to a whole tile of them.
  const int readable = m_load > m ? m_load : m;
  FUSEDIST_CHECK_ARG(plain || readable == m, op + "m_load is for plain GEMMs (no waits or signals)");
  auto whole = [m](int rows) { return (m + rows - 1) / rows * rows; };
  const bool whole_tiles = readable >= whole(kGemmSm90BlockM);
  if (tile == kSm90TileAuto) {
    if (plain && m <= kGemmSm90SwapTokens)
      tile = kSm90TileNarrow;
    else if (plain && m <= kGemmSm90BlockM)
      tile = kSm90TileSwap1wg;  // 5-11% ahead of the cooperative swap tile under load
    else if (plain && m <= kGemmSm90MidMaxM && whole_tiles)
      tile = kSm90TileMid;
    else
      tile = kSm90TileWide;
  }
  const int whole_rows = whole(tile == kSm90TileSwap || tile == kSm90TileSwap1wg
                                   ? kGemmSm90SwapTokens
                                   : kGemmSm90BlockM);
  a.m_load = readable < whole_rows ? readable : whole_rows;
  if (raster == kSm90RasterAuto)
    raster = tile == kSm90TileWide ? kSm90RasterAlongN : kSm90RasterAlongM;
  a.raster_m = raster == kSm90RasterAlongM;
  if (wait.flags != 0 || signal.pieces != 0) {
    a.sms -= kReservedSms;
    FUSEDIST_CHECK_ARG(comm != nullptr, op + "the fused engines' waits and signals need a communicator");
  }
  if (wait.flags != 0) {
    FUSEDIST_CHECK_ARG(wait.pieces >= 1 && wait.pieces <= wait.block_rows,
                       op + "pieces must be in 1..block_rows");
    ChunkWait& cw = a.wait;
    cw.flags = reinterpret_cast<const uint32_t*>(wait.flags);
    cw.block_rows = wait.block_rows;
    cw.pieces = wait.pieces;
    cw.piece_rows = (wait.block_rows + wait.pieces - 1) / wait.pieces;
    const int tiles = (m + kGemmSm90BlockM - 1) / kGemmSm90BlockM;
    cw.tiles_m = (tiles + kGemmSm90ClusterM - 1) / kGemmSm90ClusterM * kGemmSm90ClusterM;
    if (wait.on_c)
      c_wait(cw, *comm, wait, m);
    else
      a_wait(cw, *comm, wait, m);
    cw.ctl = comm->view.ctl;
    cw.err = comm->view.err;
    cw.timeout_ns = comm->view.timeout_ns;
    cw.rank = comm->view.rank;
  }
  if (signal.pieces != 0) {
    const int world = comm->view.world, rank = comm->view.rank, br = signal.block_rows;
    FUSEDIST_CHECK_ARG(signal.offset != 0, op + "signal offset missing");
    FUSEDIST_CHECK_ARG(br >= 1 && signal.pieces >= 1 && signal.pieces <= kMaxSignalPieces &&
                           signal.pieces <= br,
                       op + "signal pieces must be in 1.." + std::to_string(kMaxSignalPieces) +
                           " and at most block_rows");
    FUSEDIST_CHECK_ARG(signal.row0 >= 0 && int64_t(signal.row0) + m <= int64_t(br) * world,
                       op + "the signalled rows lie outside the world's blocks");
    // A tile of this rank's own block would add to counters no one waits for.
    FUSEDIST_CHECK_ARG(signal.row0 + m <= int64_t(rank) * br || signal.row0 >= int64_t(rank + 1) * br,
                       op + "the signalled rows must not overlap this rank's own block");
    ChunkSignal& cs = a.signal;
    for (int p = 0; p < world; ++p) cs.base[p] = comm->view.base[p];
    cs.offset = signal.offset;
    cs.rows = m;
    cs.row0 = signal.row0;
    cs.block_rows = br;
    cs.pieces = signal.pieces;
    cs.piece_rows = (br + signal.pieces - 1) / signal.pieces;
    cs.src = rank;
  }
  if (dtype == DType::kBFloat16)
    run_tile<__nv_bfloat16>(a, w_nk, tile);
  else
    run_tile<__half>(a, w_nk, tile);
}

}  // namespace fusedist
