// fusedist/gemm/gemm_sm90.cuh -- the Hopper tensor-core GEMM behind fusedist.gemm (prefill sizes)
// and ag_gemm(engine='fused'): CUTLASS 3 collectives (TMA loads, wgmma, persistent
// warp-specialized cooperative kernel, TMA-store epilogue) with fusedist's own tile scheduler.
//
// D[M, N] = A[M, K] @ B + beta * C + bias[N], fp32 accumulation, one rounding to T.
// A row-major; B is w [K, N] row-major or the .t() of an [N, K] row-major nn.Linear weight.
//
// ChunkScheduler: CUTLASS's static persistent scheduler plus what the fused engines need
// (docs/design/gemm_comm.md has the protocols and timelines; chunk_wait.cuh the structs).
// all-gather + GEMM (ag_gemm engine='fused'), ChunkWait on A:
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
// GEMM + reduce-scatter (gemm_rs engine='fused'), two launches per rank:
//  * The peers' blocks, ChunkSignal: after the consumer warps stored a tile (TMA store into
//    this rank's symmetric staging), they wait for the stores to complete (bulk wait_group,
//    not .read), fence the async proxy, meet at the epilogue barrier, and one thread adds 1
//    (release, system scope) to the owner rank's counter of every row piece the tile wrote.
//    The owner's comm stream waits for a piece's full count, then pulls it (copy engine).
//  * The own block, ChunkWait on C: C is the peers' pulled partials; only the epilogue's
//    C-load warp waits for a tile's flags, so the mainloop of the tile runs meanwhile.
// Every wait is bounded: past timeout_ns the communicator is marked failed and the error
// record filled (the host raises); the kernel then finishes with whatever the rows hold
// instead of hanging.
// Without flags or signals (plain GEMM) the scheduler is CUTLASS's static persistent one.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "fusedist/gemm/chunk_wait.cuh"

namespace fusedist {

struct ChunkSchedulerTag {};

template <int kBlockM>
class ChunkScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    ChunkWait wait{};
    ChunkSignal signal{};
  };
  struct Params : Base::Params {
    ChunkWait wait{};
    ChunkSignal signal{};
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
    p.signal = args.signal;
    return p;
  }

  CUTLASS_HOST_DEVICE ChunkScheduler() {}
  CUTLASS_DEVICE explicit ChunkScheduler(Params const& p)
      : Base(p), wait_(p.wait), signal_(&p.signal) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return ready(Base::get_current_work());
  }
  // Called by every role after it is done with tile w (the consumers: after its epilogue
  // issued the stores).
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo w) {
    signal_stored(w);
    Base::advance_to_next_work();
    return cute::make_tuple(ready(Base::get_current_work()), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo w, Pipeline&, PipelineState) {
    return fetch_next_work(w);
  }

 private:
  ChunkWait wait_;
  // Read in place from the kernel's (grid-constant) parameters: a copy indexed by the owner
  // rank (signal_rows) would put the whole scheduler in local memory.
  ChunkSignal const* signal_ = nullptr;

  // The warp that loads C (the cooperative kernel's producer warpgroup, warp 2).
  CUTLASS_DEVICE static bool is_c_load_warp() {
    return threadIdx.x < cutlass::NumThreadsPerWarpGroup && threadIdx.x / cutlass::NumThreadsPerWarp == 2;
  }

  // gemm_rs fused: once the consumers' stores of tile w are in global memory, count its rows
  // done on their owners. Consumer threads only (the cooperative kernel's warpgroups 1 and 2,
  // all of which reach this point for every tile, so the barrier is uniform).
  CUTLASS_DEVICE void signal_stored(WorkTileInfo const& w) const {
    if (signal_->offset == 0 || !w.is_valid() || threadIdx.x < cutlass::NumThreadsPerWarpGroup)
      return;
    const int r0 = w.M_idx * kBlockM;
    if (r0 >= signal_->rows) return;  // a padding tile (cluster or swizzle): no rows
    // The TMA stores this thread committed have completed (not only read shared memory) ...
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    // ... and are ordered before generic-proxy accesses that follow.
    asm volatile("fence.proxy.async.global;" ::: "memory");
    cutlass::arch::NamedBarrier::sync(2 * cutlass::NumThreadsPerWarpGroup,
                                      cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
    if (threadIdx.x == cutlass::NumThreadsPerWarpGroup)
      signal_rows(*signal_, r0, min(r0 + kBlockM, signal_->rows));
  }

  // Every role of the CTA (loads, MMA, epilogue) asks the scheduler for the same tiles, so
  // the rotation stays consistent; an A wait only delays the roles that would wait anyway.
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
    if (wait_.flags != nullptr && m * kBlockM < wait_.rows && (!wait_.on_c || is_c_load_warp()))
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

// One kernel configuration per (dtype, weight layout, tile; layout.h, Sm90Tile). The wide
// tile (prefill and the fused engines): 128 x 256 x 64 tiles, 2 x 1 clusters (the B tile
// multicast to both CTAs). The narrow tile (plain GEMMs of few rows): 128 x 64 x 64, no
// cluster, so an N = 8192 weight is streamed by 128 CTAs instead of 32 (1 x 2 clusters
// multicasting A, and 128-deep K tiles, measured no faster: benchmarks/NOTES.md).
// The mid tile (plain GEMMs of 129-256 rows): 128 x 128 x 64, no cluster: half the bytes per
// output of the narrow tile's two tiles per SM at those rows (layout.h).
// All but kOneWG: two consumer warpgroups (cooperative); all: as many smem stages as fit
// beside the epilogue.
// kSwapAB: CUTLASS computes D^T = W^T X^T: its M is our N (weight columns), its N our M
// (tokens); A is the weight, B is x, D (and C) column-major, the bias per row of D.
// kOneWG: one consumer warpgroup per CTA, not persistent (CUTLASS's KernelTmaWarpSpecialized,
// its own scheduler: no ChunkScheduler hooks), for plain GEMMs.
template <typename T, bool kWNK, int kBlockN = kGemmSm90BlockN, int kBlockK = 64,
          int kClusterM_ = kGemmSm90ClusterM, int kClusterN = 1, bool kSwapAB_ = false,
          bool kOneWG_ = false>
struct GemmSm90 {
  using Element = typename CutlassElement<T>::type;
  static constexpr int kBlockM = kGemmSm90BlockM;
  static constexpr int kClusterM = kClusterM_;
  static constexpr bool kSwapAB = kSwapAB_;
  static constexpr bool kOneWG = kOneWG_;
  static constexpr int kAlign = 8;  // elements of one 16-byte TMA access
  using TileShape = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kBlockK>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using RowMajor = cutlass::layout::RowMajor;
  using ColumnMajor = cutlass::layout::ColumnMajor;
  // CUTLASS's A is M x K, RowMajor = K contiguous. Swapped, A is the weight: [N, K] rows are
  // K-major, [K, N] rows N-major.
  using LayoutA = std::conditional_t<kSwapAB && !kWNK, ColumnMajor, RowMajor>;
  // CUTLASS's B is K x N: RowMajor = w [K, N]; ColumnMajor = [N, K] rows (nn.Linear weight).
  // Swapped, B is x: [M, K] rows, K-major.
  using LayoutB = std::conditional_t<kSwapAB || kWNK, ColumnMajor, RowMajor>;
  using LayoutD = std::conditional_t<kSwapAB, ColumnMajor, RowMajor>;
  using Fusion = std::conditional_t<
      kSwapAB, cutlass::epilogue::fusion::LinCombPerRowBias<Element, float, Element, Element, float>,
      cutlass::epilogue::fusion::LinCombPerColBias<Element, float, Element, Element, float>>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutD, kAlign,
      Element, LayoutD, kAlign,
      std::conditional_t<kOneWG, cutlass::epilogue::TmaWarpSpecialized,
                         cutlass::epilogue::TmaWarpSpecializedCooperative>,
      Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
      LayoutB, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      std::conditional_t<kOneWG, cutlass::gemm::KernelTmaWarpSpecialized,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, Mainloop, Epilogue,
      std::conditional_t<kOneWG, void, ChunkSchedulerTag>>;
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
