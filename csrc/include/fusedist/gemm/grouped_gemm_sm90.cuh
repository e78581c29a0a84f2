// fusedist/gemm/grouped_gemm_sm90.cuh -- the Hopper grouped GEMM over experts behind
// fusedist.ops.moe.grouped_gemm at prefill sizes: CUTLASS's ptr-array grouped kernels (TMA,
// wgmma, persistent warp-specialized cooperative CTAs, the group tile scheduler), one problem
// per expert, problem sizes and operand pointers written on the device.
//
// Problem. For every expert e with c_e = counts[e] rows starting at row o_e = offsets[e] of
// the permuted buffer (the layout of fusedist.ops.moe.sort_by_expert):
//   out[o_e + i, n] = epi(sum_k x[o_e + i, k] w[e, n, k]),   0 <= i < c_e, 0 <= n < N
// x [rows, K] row-major (row stride ldx), w [E, N, K] contiguous (each expert an nn.Linear
// weight, K-major: CUTLASS's column-major B), out [rows, N] contiguous bf16. Rows of out
// outside every expert's segment (the layout's padding) are never written: each problem is
// c_e x N, and the TMA store clips the last tile at row c_e.
//
// Protocol (no host synchronization: a captured CUDA graph replays with new routings).
//   1. grouped_gemm_setup<G>, one thread per expert, reads counts / offsets and writes the
//      expert's problem size (c_e, N, K), its operand pointers (x + o_e ldx, w + e N K,
//      out + o_e N, and the scale pointers of the FP8 forms) and strides into the caller's
//      workspace (GroupedArrays). It waits for the previous kernel first (PDL: counts come
//      from the sort just before). An expert whose segment is not inside [0, rows) or whose
//      count is negative becomes an empty problem: the GEMM never reads or writes outside
//      x / out whatever the layout holds.
//   2. The CUTLASS kernel, next on the stream, reads those arrays: the grid is one persistent
//      CTA per SM (host problem shapes are not available, so CUTLASS sizes the grid by the SM
//      count), the group scheduler walks the experts' output tiles in order, an expert with
//      no rows has no tiles. Before the first tile of each expert a CTA rewrites its TMA
//      descriptors (address, rows) in its own slot of the workspace.
//
// Forms (one CUTLASS instantiation each, each in its own translation unit):
//   bf16        x, w bf16; fp32 accumulation; out = bf16(acc).
//   fp8         x e4m3 with x_scale float32 per row, w e4m3 with w_scale float32 per output
//               channel ([E, N]) or per expert ([E]: the row broadcast's stride is 0);
//               the non-"FastAccum" FP8 mainloop adds the wgmma accumulators into fp32
//               every 4 k-blocks of 128 (512 k; fusedist.ops.fp8_gemm's error model);
//               out = bf16(sx[row] * (sw[e, n] * acc)).
//   fp8_block   x e4m3 with x_scale float32 [rows, K / 128] (per row and 128 k), w e4m3 with
//               128 x 128 block scales [E, ceil(N / 128), ceil(K / 128)]; CUTLASS's blockwise
//               mainloop multiplies each 128-k block's wgmma sum by its two scales and adds it
//               into fp32; out = bf16(acc).
// Limits (moe_grouped_gemm_why_not): K % 8 (bf16) or % 16 (e4m3) and N % 8 (16-byte TMA
// rows), K % 128 for the block form, 16-byte aligned x, w, out and x rows.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <cstdint>

#include "fusedist/common/signals.cuh"  // pdl_wait

namespace fusedist {
namespace grouped {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Problem = typename ProblemShape::UnderlyingProblemShape;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
using RowMajorPtr = cutlass::layout::RowMajor*;
using ColMajorPtr = cutlass::layout::ColumnMajor*;

// The pieces every form shares: the epilogue and mainloop from CUTLASS's builders over one
// tile (no clusters: an expert with a single tile row or column would leave a cluster's other
// CTA idle, and the group scheduler rounds every expert's tiles up to whole clusters).
template <class EA, class EB, class Tile, class KernelSchedule, class Evt,
          class LayoutA = RowMajorPtr, class LayoutB = ColMajorPtr>
struct GroupedGemmOf {
  using Out = cutlass::bfloat16_t;
  using TileShape = Tile;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, RowMajorPtr, 16 / sizeof(Out),  // no C operand
      Out, RowMajorPtr, 16 / sizeof(Out), EpilogueSchedule, Evt>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA, LayoutA, 16 / sizeof(EA), EB,
      LayoutB, 16 / sizeof(EB), float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// acc -> bf16, rounded once.
using EvtPlain = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity,
                                           cutlass::bfloat16_t, float, kRound>,
    cutlass::epilogue::fusion::Sm90AccFetch>;

// bf16 x bf16: 128 x 256 x 64 tiles, two consumer warpgroups (64 x 256 each).
struct Bf16 : GroupedGemmOf<cutlass::bfloat16_t, cutlass::bfloat16_t,
                            cute::Shape<cute::_128, cute::_256, cute::_64>,
                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                            EvtPlain> {
  static constexpr bool kRowScales = false, kBlockScales = false;
};

// e4m3 x e4m3 with a scale per x row and one per output channel (or per expert): the epilogue
// tree sx[m] * (sw[n] * acc) of fusedist.ops.fp8_gemm, each vector an array of per-expert
// pointers (element l of the array for expert l). x's scales are read one float at a time
// (an expert's rows start at any row: its pointer is 4-byte aligned only); sw's stride along
// N is 1 (per channel) or 0 (per expert) at run time.
using ScaleX = cutlass::epilogue::fusion::Sm90ColBroadcast<
    0, cute::Shape<cute::_128, cute::_128, cute::_128>, float*, float,
    cute::Stride<cute::_1, cute::_0, int64_t>, 1>;
using ScaleW = cutlass::epilogue::fusion::Sm90RowBroadcast<
    0, cute::Shape<cute::_128, cute::_128, cute::_128>, float*, float,
    cute::Stride<cute::_0, bool, int64_t>, 1>;
using MulW = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>;
using ScaledW = cutlass::epilogue::fusion::Sm90EVT<MulW, ScaleW,
                                                    cutlass::epilogue::fusion::Sm90AccFetch>;
using MulX = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, cutlass::bfloat16_t,
                                                    float, kRound>;
using EvtRowChannel = cutlass::epilogue::fusion::Sm90EVT<MulX, ScaleX, ScaledW>;

// 128 x 128 x 128 tiles: the FP8 mainloop keeps a second accumulator for its promotion, so a
// 128 x 256 tile would not fit the consumer warpgroups' registers.
struct Fp8 : GroupedGemmOf<cutlass::float_e4m3_t, cutlass::float_e4m3_t,
                           cute::Shape<cute::_128, cute::_128, cute::_128>,
                           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                           EvtRowChannel> {
  static constexpr bool kRowScales = true, kBlockScales = false;
};

// Block scales: 1 x 128 for x (per row and 128 k) and 128 x 128 for w, both K-major (the
// 128-k index fastest), as fusedist stores them.
using BlockScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128,
                                                                   cute::GMMA::Major::K,
                                                                   cute::GMMA::Major::K>;
using LayoutSFA = decltype(BlockScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(BlockScaleConfig::deduce_layoutSFB());

struct Fp8Block
    : GroupedGemmOf<cutlass::float_e4m3_t, cutlass::float_e4m3_t,
                    cute::Shape<cute::_128, cute::_128, cute::_128>,
                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                    EvtPlain, cute::tuple<RowMajorPtr, LayoutSFA*>,
                    cute::tuple<ColMajorPtr, LayoutSFB*>> {
  static constexpr bool kRowScales = false, kBlockScales = true;
};

// ---- the per-expert arrays (workspace) ------------------------------------------------------
// The setup kernel's inputs: device pointers and sizes, identical for every expert.
struct SetupParams {
  const int* counts;      // [experts]
  const int* offsets;     // [experts + 1]
  const uint8_t* x;       // [rows, ldx] (bf16 or e4m3)
  const uint8_t* w;       // [experts, n, k]
  uint8_t* out;           // [rows, n] bf16
  const float* x_scale;   // fp8: [rows]; fp8_block: [rows, k / 128]
  const float* w_scale;   // fp8: [experts] or [experts, n]; fp8_block: [experts, nb, kb]
  int64_t rows;           // rows of x and out
  int64_t ldx;            // elements between x rows
  int64_t w_scale_per_expert;  // floats of w_scale per expert (1, n or nb kb)
  int experts, n, k;
  int x_bytes, w_bytes;   // bytes per element of x and w
  int x_scale_per_row;    // floats of x_scale per row (1 or k / 128)
};

// Where each per-expert array lives: `experts` entries each, 16-byte aligned, in this order,
// then CUTLASS's own workspace (its TMA descriptors, one set per SM) at a 128-byte boundary.
template <class G>
struct GroupedArrays {
  Problem* problems = nullptr;
  const typename G::CollectiveMainloop::ElementA** a = nullptr;
  const typename G::CollectiveMainloop::ElementB** b = nullptr;
  typename G::Out** d = nullptr;
  typename G::StrideA* sa = nullptr;
  typename G::StrideB* sb = nullptr;
  typename G::StrideD* sd = nullptr;
  const float** sx = nullptr;   // kRowScales / kBlockScales: each expert's first x scale
  const float** sw = nullptr;   // ... and its w scales
  LayoutSFA* lsfa = nullptr;    // kBlockScales: the scale layouts (from each expert's rows)
  LayoutSFB* lsfb = nullptr;
  uint8_t* cutlass = nullptr;   // CUTLASS's workspace

  static constexpr int64_t align(int64_t b, int64_t a) { return (b + a - 1) / a * a; }

  // Carve the arrays out of `base` (nullptr: only count); returns the bytes before `cutlass`.
  int64_t carve(uint8_t* base, int experts) {
    int64_t off = 0;
    auto take = [&](auto*& ptr, int64_t elem_bytes, bool used) {
      using P = std::remove_reference_t<decltype(ptr)>;
      if (!used) return;
      if (base != nullptr) ptr = reinterpret_cast<P>(base + off);
      off = align(off + elem_bytes * experts, 16);
    };
    take(problems, sizeof(Problem), true);
    take(a, sizeof(void*), true);
    take(b, sizeof(void*), true);
    take(d, sizeof(void*), true);
    take(sa, sizeof(typename G::StrideA), true);
    take(sb, sizeof(typename G::StrideB), true);
    take(sd, sizeof(typename G::StrideD), true);
    take(sx, sizeof(void*), G::kRowScales || G::kBlockScales);
    take(sw, sizeof(void*), G::kRowScales || G::kBlockScales);
    take(lsfa, sizeof(LayoutSFA), G::kBlockScales);
    take(lsfb, sizeof(LayoutSFB), G::kBlockScales);
    off = align(off, 128);
    if (base != nullptr) cutlass = base + off;
    return off;
  }
};

// One thread per expert (protocol step 1).
template <class G>
__global__ void grouped_gemm_setup(const __grid_constant__ SetupParams p, GroupedArrays<G> arr) {
  pdl_wait();  // counts and offsets (and x) may come from the kernel before this one
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= p.experts) return;
  int c = p.counts[e];
  int64_t o = p.offsets[e];
  if (c < 0 || o < 0 || o + c > p.rows) c = 0;  // never outside x and out
  if (c == 0) o = 0;
  using EA = typename G::CollectiveMainloop::ElementA;
  using EB = typename G::CollectiveMainloop::ElementB;
  arr.problems[e] = Problem(c, p.n, p.k);
  arr.a[e] = reinterpret_cast<const EA*>(p.x + o * p.ldx * p.x_bytes);
  arr.b[e] = reinterpret_cast<const EB*>(p.w + int64_t(e) * p.n * p.k * p.w_bytes);
  arr.d[e] = reinterpret_cast<typename G::Out*>(p.out + o * p.n * int64_t(sizeof(typename G::Out)));
  typename G::StrideA sa{};
  typename G::StrideB sb{};
  typename G::StrideD sd{};
  cute::get<0>(sa) = p.ldx;  // A: (M, K, L) with K unit
  cute::get<0>(sb) = p.k;    // B: (N, K, L) with K unit (each expert's [N, K] weight)
  cute::get<0>(sd) = p.n;    // D: (M, N, L) with N unit
  arr.sa[e] = sa;
  arr.sb[e] = sb;
  arr.sd[e] = sd;
  if constexpr (G::kRowScales || G::kBlockScales) {
    arr.sx[e] = p.x_scale + o * p.x_scale_per_row;
    arr.sw[e] = p.w_scale + int64_t(e) * p.w_scale_per_expert;
  }
  if constexpr (G::kBlockScales) {
    const auto shape = cute::make_shape(c, p.n, p.k, 1);
    arr.lsfa[e] = BlockScaleConfig::tile_atom_to_shape_SFA(shape);
    arr.lsfb[e] = BlockScaleConfig::tile_atom_to_shape_SFB(shape);
  }
}

}  // namespace grouped
}  // namespace fusedist
