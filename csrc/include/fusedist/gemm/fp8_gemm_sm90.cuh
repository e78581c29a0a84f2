// fusedist/gemm/fp8_gemm_sm90.cuh -- the Hopper FP8 (W8A8) GEMM behind fusedist.ops.fp8_gemm:
// CUTLASS 3 collectives (TMA loads, FP8 wgmma, persistent warp-specialized cooperative kernel)
// with the scales and the bias applied in the epilogue (an epilogue visitor tree).
//
// out[M, N] = T(sx[m] * (sw[n] * sum_k xq[m, k] wq[n, k]) + bias[n])
//   xq  e4m3 [M, K] row-major (per-token quantized activations), sx float32 [M]
//   wq  e4m3 [N, K] row-major (an nn.Linear weight), sw float32 [N] (per output channel)
//   bias T [N] or none (the visitor's null fallback adds 0); out T [M, N] row-major, T bf16.
// Precision: Hopper's FP8 wgmma accumulates in reduced precision; the non-"FastAccum"
// schedule (MainloopSm90TmaGmmaWarpSpecializedFP8) adds the wgmma accumulators into fp32
// registers every 4 k-blocks of 128 (mma_promotion_interval), so the sum over K is fp32 up to
// 512-term partial sums. Both operands are K-major (the only FP8 wgmma layout).
// Scheduling: persistent CTAs, one per SM, under CUTLASS's stream-K scheduler with its heuristic
// decomposition: output tiles whole where they fill the SMs evenly (data-parallel), and the
// k-blocks of the remaining tiles spread over the idle SMs where they do not (decode-sized M,
// few N tiles), the partial tiles added in a fixed order (deterministic reduction) through a
// workspace the caller provides (fp8_gemm_workspace_size).
// Shapes: K % 16 == 0 and N % 8 == 0 (16-byte TMA rows of e4m3 and of bf16), any M.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

namespace fusedist {

// One instantiation per (output type, tile N): 128 x kBlockN x 128 tiles, clusters of 2 along N
// (the activation tile is multicast to both CTAs of a cluster; each streams its own weight
// tile). Along N, not M: at decode-sized M there is one M tile, and a cluster along M would
// leave half of the CTAs without work.
template <typename T, int kBlockN = 128>
struct Fp8GemmSm90 {
  using E8 = cutlass::float_e4m3_t;
  using Out = T;
  using TileShape = cute::Shape<cute::_128, cute::Int<kBlockN>, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

  // The epilogue: sx[m] * (sw[n] * acc) + bias[n], in fp32, one rounding to T.
  using ScaleX = cutlass::epilogue::fusion::Sm90ColBroadcast<
      0, TileShape, float, float, cute::Stride<cute::_1, cute::_0, int64_t>>;
  using ScaleW = cutlass::epilogue::fusion::Sm90RowBroadcast<
      0, TileShape, float, float, cute::Stride<cute::_0, cute::_1, int64_t>>;
  using Bias = cutlass::epilogue::fusion::Sm90RowBroadcast<
      0, TileShape, Out, float, cute::Stride<cute::_0, cute::_1, int64_t>>;
  using Acc = cutlass::epilogue::fusion::Sm90AccFetch;
  using MulW = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>;
  using ScaledW = cutlass::epilogue::fusion::Sm90EVT<MulW, ScaleW, Acc>;
  using Fma = cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, Out,
                                                      float, kRound>;
  using Evt = cutlass::epilogue::fusion::Sm90EVT<Fma, ScaleX, ScaledW, Bias>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, 16 / sizeof(Out),   // no C operand
      Out, cutlass::layout::RowMajor, 16 / sizeof(Out), EpilogueSchedule, Evt>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E8, cutlass::layout::RowMajor, 16,
      E8, cutlass::layout::ColumnMajor, 16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue,
                                                      cutlass::gemm::StreamKScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The 128 x 128 block-scaled form (DeepSeek-V3 / Hugging Face `quant_method: fp8` weights):
//   out[M, N] = T(sum_kb sx[m, kb] sw[n / 128, kb] sum_{k in block kb} xq[m, k] wq[n, k] + bias[n])
//   xq e4m3 [M, K] with sx float32 [M, ceil(K / 128)] (per token and 128 k, K-major,
//   contiguous); wq e4m3 [N, K] with sw float32 [ceil(N / 128), ceil(K / 128)] (contiguous).
// CUTLASS's blockwise-scaling FP8 mainloop multiplies each 128-k block's wgmma sum by its two
// scales and adds it into fp32 registers (so the promotion interval is 128 k); the epilogue
// adds the bias and rounds once. 128 x 128 x 128 tiles (one scale block of the weight per tile),
// clusters of 2 along N, the persistent data-parallel scheduler.
template <typename T>
struct Fp8GemmBlockSm90 {
  using E8 = cutlass::float_e4m3_t;
  using Out = T;
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  // Scales: 1 x 128 for x, 128 x 128 for the weight, both K-major (K / 128 fastest).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  // The epilogue: acc + bias[n], in fp32, one rounding to T.
  using Bias = cutlass::epilogue::fusion::Sm90RowBroadcast<
      0, TileShape, Out, float, cute::Stride<cute::_0, cute::_1, int64_t>>;
  using Acc = cutlass::epilogue::fusion::Sm90AccFetch;
  using Add = cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, Out, float, kRound>;
  using Evt = cutlass::epilogue::fusion::Sm90EVT<Add, Acc, Bias>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, 16 / sizeof(Out),   // no C operand
      Out, cutlass::layout::RowMajor, 16 / sizeof(Out), EpilogueSchedule, Evt>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      E8, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, 16,
      E8, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16, float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace fusedist
