// csrc/ops/gemm/gemm_sm90_run.cuh -- one instantiation of the Hopper GEMM launch: the tile
// configuration's kernel (Sm90TileConfig), CUTLASS arguments from a GemmSm90Call, checks,
// launch through CUTLASS's adapter. Included by the gemm_sm90_<dtype>_<layout>[_<tile>].cu
// files only (generated from gemm_sm90_inst.cu.in; each compiles one CUTLASS kernel).
#pragma once
#include <stdexcept>
#include <string>

#include "fusedist/common/common.h"
#include "fusedist/gemm/gemm_sm90.cuh"
#include "fusedist/common/launch.h"
#include "gemm_sm90.h"

namespace fusedist {

template <typename T, bool kWNK, int kTile>
struct Sm90TileConfig;
template <typename T, bool kWNK>
struct Sm90TileConfig<T, kWNK, kSm90TileWide> {
  using type = GemmSm90<T, kWNK>;
};
template <typename T, bool kWNK>
struct Sm90TileConfig<T, kWNK, kSm90TileNarrow> {
  using type = GemmSm90<T, kWNK, kGemmSm90NarrowBlockN, 64, 1, 1>;
};
template <typename T, bool kWNK>
struct Sm90TileConfig<T, kWNK, kSm90TileMid> {
  using type = GemmSm90<T, kWNK, kGemmSm90MidBlockN, 64, 1, 1>;
};
template <typename T, bool kWNK>
struct Sm90TileConfig<T, kWNK, kSm90TileSwap> {
  using type = GemmSm90<T, kWNK, kGemmSm90SwapTokens, 64, 1, 2, true>;
};
template <typename T, bool kWNK>
struct Sm90TileConfig<T, kWNK, kSm90TileSwap1wg> {
  using type = GemmSm90<T, kWNK, kGemmSm90SwapTokens, 64, 1, 2, true, true>;
};

template <typename T, bool kWNK, int kTile>
void gemm_sm90_run(const GemmSm90Call& a) {
  using G = typename Sm90TileConfig<T, kWNK, kTile>::type;
  using Gemm = typename G::Gemm;
  using Kernel = typename G::Kernel;
  using E = typename G::Element;
  // Strides are (M or N mode, K mode, batch) for A and B, (M, N, batch) for C and D; the
  // unit-stride mode of each layout is a compile-time 1.
  typename Kernel::StrideA sa{};
  typename Kernel::StrideB sb{};
  typename Kernel::StrideC sc{};
  typename Kernel::StrideD sd{};
  // The operands in CUTLASS's order, and its (M, N) modes: (tokens, weight columns), or the
  // reverse when swapped.
  uintptr_t pa = a.x, pb = a.w;
  int pm = a.m, pn = a.n;
  if constexpr (G::kSwapAB) {
    pa = a.w, pb = a.x, pm = a.n, pn = a.m;
    if constexpr (kWNK)
      cute::get<0>(sa) = a.ldw;  // [N, K] rows: a weight column steps by ldw, k by 1
    else
      cute::get<1>(sa) = a.ldw;  // [K, N] rows: k steps by ldw, a weight column by 1
    cute::get<0>(sb) = a.ldx;    // x [M, K] rows: a token steps by ldx
    cute::get<1>(sd) = a.ldo;    // out [M, N] = D^T: a token steps by ldo
    cute::get<1>(sc) = a.c ? a.ldc : a.ldo;
  } else {
    cute::get<0>(sa) = a.ldx;
    if constexpr (kWNK)
      cute::get<0>(sb) = a.ldw;  // [N, K] rows: n steps by ldw, k by 1
    else
      cute::get<1>(sb) = a.ldw;  // [K, N] rows: k steps by ldw, n by 1
    cute::get<0>(sd) = a.ldo;
    cute::get<0>(sc) = a.c ? a.ldc : a.ldo;
  }

  cutlass::KernelHardwareInfo hw;
  FUSEDIST_CUDA_CHECK(cudaGetDevice(&hw.device_id));
  hw.sm_count = a.sms;

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {pm, pn, a.k, 1},
      {reinterpret_cast<const E*>(pa), sa, reinterpret_cast<const E*>(pb), sb},
      // No c: the C descriptor points at out (a valid tensor map) and beta = 0 skips its load.
      {{}, reinterpret_cast<const E*>(a.c ? a.c : a.out), sc, reinterpret_cast<E*>(a.out), sd},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = a.c ? a.beta : 0.0f;
  args.epilogue.thread.bias_ptr = reinterpret_cast<const E*>(a.bias);
  using Raster =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions;
  args.scheduler.raster_order = a.raster_m ? Raster::AlongM : Raster::AlongN;
  // Along N: a wave of 64 clusters covers 16 M-tiles x 8 N-tiles instead of 2 x 64: the
  // weight is streamed from HBM far fewer times when it does not fit in L2 (N = 14336).
  // CUTLASS pads the M clusters to a multiple of the swizzle and multiplies the padding tiles
  // too (their loads are out of bounds, their MMAs are not skipped), so take the largest
  // swizzle that pads by at most 1/8: 1024 rows (4 clusters) took 2x the time with swizzle 8.
  // Along M (few row blocks): every row block of one weight strip runs in the same wave
  // already; a swizzle would only pad the N tiles.
  // Swapped, CUTLASS's M tiles are weight strips: no swizzle.
  args.scheduler.max_swizzle_size =
      a.raster_m || G::kSwapAB ? 1 : gemm_sm90_swizzle(a.m, G::kClusterM);
  if constexpr (!G::kOneWG) {  // fusedist's scheduler; the one-warpgroup kernel has CUTLASS's
    args.scheduler.wait = a.wait;
    args.scheduler.signal = a.signal;
  }

  Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  FUSEDIST_CHECK_ARG(s == cutlass::Status::kSuccess,
                     std::string("gemm: CUTLASS cannot run this problem (") +
                         cutlassGetStatusString(s) + "); M, N, K and the strides must suit 16-byte TMA rows");
  FUSEDIST_CHECK_ARG(Gemm::get_workspace_size(args) == 0, "gemm: unexpected workspace need");
  // The mainloop's TMA reads a whole tile of x's rows when x has them (m_load): a box whose
  // rows lie past the tensor's end is zero-filled by the TMA unit, and that measured slow
  // (benchmarks/NOTES.md). The stores keep the true M (their own tensor map, which
  // clips the rows past it); the scheduler sees the same tiles either way.
  typename Gemm::Arguments load_args = args;
  cute::get<G::kSwapAB ? 1 : 0>(load_args.problem_shape) = a.m_load;
  s = gemm.initialize(load_args, nullptr, a.stream);
  if (s != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("fusedist: gemm: CUTLASS initialize failed: ") +
                             cutlassGetStatusString(s));
  typename Kernel::Params params = gemm.params();
  if (a.m_load != a.m)
    params.epilogue =
        Kernel::CollectiveEpilogue::to_underlying_arguments(args.problem_shape, args.epilogue, nullptr);
  s = Gemm::run(params, a.stream);
  FUSEDIST_LAUNCH_CHECK("gemm_sm90 (CUTLASS GemmUniversal)");
  if (s != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("fusedist: gemm: CUTLASS launch failed: ") +
                             cutlassGetStatusString(s));
}

}  // namespace fusedist
