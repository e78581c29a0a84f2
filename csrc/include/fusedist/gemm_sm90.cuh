// fusedist/gemm_sm90.cuh -- the Hopper tensor-core GEMM behind fusedist.gemm (prefill sizes)
// and ag_gemm(engine='fused'): CUTLASS 3 collectives (TMA loads, wgmma, persistent
// warp-specialized cooperative kernel, TMA-store epilogue) with fusedist's own tile scheduler.
//
// D[M, N] = A[M, K] @ B + beta * C + bias[N], fp32 accumulation, one rounding to T.
// A row-major; B is w [K, N] row-major or the .t() of an [N, K] row-major nn.Linear weight.
//
// ChunkScheduler (the fused all-gather + GEMM protocol, docs/design/gemm_comm.md):
//  * A is the gathered [W * block_rows, K] input. Rank j's block is copied in `pieces` row
//    pieces by the copy engine; after piece p of block j lands, the copying stream writes
//    flags[j * pieces + p] = 1 with cuStreamWriteValue32 (no SM: the GEMM owns every SM, so a
//    flag kernel could never run). The host zeroes the flags before any copy of the call.
//  * The persistent tiles walk M in an order rotated to start at this rank's own block (its
//    rows are local first), then the peers' blocks in the order they are pulled. Tiles are
//    rasterized along N in groups of 8 M-clusters (CUTLASS swizzle), so M still advances
//    group by group while a wave reuses its A and B tiles from L2.
//  * Before a tile's first TMA load, every thread of the CTA that computes it waits until the
//    flags of every piece its rows touch are set (acquire, system scope: the copy engine
//    wrote them), then fences the generic proxy against the async (TMA) proxy.
//  * The wait is bounded: past timeout_ns the communicator is marked failed and the error
//    record filled (the host raises); the kernel then finishes with whatever the rows hold
//    instead of hanging.
// Without flags (plain GEMM) the scheduler is CUTLASS's static persistent one.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "fusedist/chunk_wait.cuh"

namespace fusedist {

struct ChunkSchedulerTag {};

template <int kBlockM>
class ChunkScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    ChunkWait wait{};
  };
  struct Params : Base::Params {
    ChunkWait wait{};
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile,
                                        ClusterShape cluster, cutlass::KernelHardwareInfo const& hw,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(
        problem, tile, cluster, hw, args, workspace, epilogue_subtile, ktile_start_alignment_count);
    p.wait = args.wait;
    return p;
  }

  CUTLASS_HOST_DEVICE ChunkScheduler() {}
  CUTLASS_DEVICE explicit ChunkScheduler(Params const& p) : Base(p), wait_(p.wait) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return ready(Base::get_current_work());
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    Base::advance_to_next_work();
    return cute::make_tuple(ready(Base::get_current_work()), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo w, Pipeline&, PipelineState) {
    return fetch_next_work(w);
  }

 private:
  ChunkWait wait_;

  // Every role of the CTA (loads, MMA, epilogue) asks the scheduler for the same tiles, so
  // the rotation stays consistent; the wait only delays the roles that would wait anyway.
  CUTLASS_DEVICE WorkTileInfo ready(WorkTileInfo w) const {
    if (!w.is_valid() || wait_.rotate_tiles == 0 && wait_.flags == nullptr) return w;
    // A permutation of [0, tiles_m); indices past it (the scheduler pads M to its swizzle)
    // stay put and fall outside the problem.
    int m = w.M_idx;
    if (m < wait_.tiles_m) {
      m += wait_.rotate_tiles;
      if (m >= wait_.tiles_m) m -= wait_.tiles_m;
    }
    w.M_idx = m;
    if (wait_.flags != nullptr && m * kBlockM < wait_.rows)
      wait_rows(wait_, m * kBlockM, min((m + 1) * kBlockM, wait_.rows));
    return w;
  }
};

template <typename T>
struct CutlassElement;
template <>
struct CutlassElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<__half> {
  using type = cutlass::half_t;
};

// One kernel configuration per (dtype, weight layout): 128 x 256 x 64 tiles, 2 x 1 clusters
// (the B tile multicast to both CTAs), two consumer warpgroups, as many smem stages as fit
// beside the epilogue.
template <typename T, bool kWNK>
struct GemmSm90 {
  using Element = typename CutlassElement<T>::type;
  static constexpr int kBlockM = kGemmSm90BlockM;
  static constexpr int kClusterM = kGemmSm90ClusterM;
  static constexpr int kAlign = 8;  // elements of one 16-byte TMA access
  using TileShape = cute::Shape<cute::Int<kBlockM>, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;
  using LayoutA = cutlass::layout::RowMajor;
  // CUTLASS's B is K x N: RowMajor = w [K, N]; ColumnMajor = [N, K] rows (nn.Linear weight).
  using LayoutB = std::conditional_t<kWNK, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutD, kAlign,
      Element, LayoutD, kAlign, cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinCombPerColBias<Element, float, Element, Element, float>>::
      CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
      LayoutB, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, ChunkSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace fusedist

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t kStages>
struct TileSchedulerSelector<fusedist::ChunkSchedulerTag, arch::Sm90, TileShape, ClusterShape,
                             kStages> {
  using Scheduler = fusedist::ChunkScheduler<cute::size<0>(TileShape{})>;
};
}  // namespace cutlass::gemm::kernel::detail
