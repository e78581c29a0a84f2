// The grouped GEMM of one form (csrc/include/fusedist/gemm/grouped_gemm_sm90.cuh): the CUTLASS
// arguments over the per-expert arrays, the workspace size, and the launch (the setup kernel,
// then the CUTLASS kernel). Included by one translation unit per form
// (grouped_gemm_{bf16,fp8,fp8_block}.cu), so the three CUTLASS kernels compile in parallel;
// grouped_gemm.cu checks the call and dispatches.
#pragma once
#include <stdexcept>
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/gemm/grouped_gemm_sm90.cuh"
#include "fusedist/moe/grouped_gemm_api.h"

namespace fusedist {
namespace grouped {

// The CUTLASS arguments of a call whose per-expert arrays are `arr` (device problem shapes
// only: the host never sees the counts).
template <class G>
typename G::Gemm::Arguments gemm_arguments(const MoeGroupedGemmArgs& a,
                                           const GroupedArrays<G>& arr) {
  using Gemm = typename G::Gemm;
  cutlass::KernelHardwareInfo hw;
  FUSEDIST_CUDA_CHECK(cudaGetDevice(&hw.device_id));
  hw.sm_count = current_device_sm_count();

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{a.experts, arr.problems, nullptr};
  if constexpr (G::kBlockScales) {
    args.mainloop = {arr.a, arr.sa, arr.b, arr.sb, arr.sx, arr.lsfa, arr.sw, arr.lsfb};
  } else {
    args.mainloop = {arr.a, arr.sa, arr.b, arr.sb};
  }
  // The epilogue tree's arguments, children first.
  typename G::CollectiveEpilogue::FusionCallbacks::Arguments thread{};
  if constexpr (G::kRowScales) {
    typename ScaleX::Arguments sx{arr.sx, 0.0f, {cute::_1{}, cute::_0{}, int64_t(0)}};
    // Per channel: stride 1 along N; per expert: 0 (every column reads the expert's one scale).
    const bool per_channel = a.w_scale_mode == kMoeWScaleChannel;
    typename ScaleW::Arguments sw{arr.sw, 0.0f, {cute::_0{}, per_channel, int64_t(0)}};
    thread = {sx, {sw, {}, {}}, {}};
  }
  args.epilogue = {thread, nullptr, nullptr, arr.d, arr.sd};
  args.hw_info = hw;
  return args;
}

// Bytes of the workspace: the per-expert arrays, then CUTLASS's (its TMA descriptors, a set
// per SM).
template <class G>
int64_t workspace_bytes(const MoeGroupedGemmArgs& a) {
  GroupedArrays<G> arr;
  const int64_t head = arr.carve(nullptr, a.experts);
  return head + int64_t(G::Gemm::get_workspace_size(gemm_arguments<G>(a, arr)));
}

template <class G>
void run(const MoeGroupedGemmArgs& a, cudaStream_t st, const char* name) {
  using Gemm = typename G::Gemm;
  const std::string w = std::string("moe_grouped_gemm (") + name + "): ";
  GroupedArrays<G> arr;
  const int64_t head = arr.carve(reinterpret_cast<uint8_t*>(a.workspace), a.experts);
  auto args = gemm_arguments<G>(a, arr);
  const int64_t need = head + int64_t(Gemm::get_workspace_size(args));
  FUSEDIST_CHECK_ARG(a.workspace != 0 && a.workspace % 128 == 0 && a.workspace_bytes >= need,
                     w + "the workspace must be 128-byte aligned and hold >= " +
                         std::to_string(need) + " bytes (moe_grouped_gemm_workspace_size), got " +
                         std::to_string(a.workspace_bytes));
  SetupParams sp{};
  sp.counts = reinterpret_cast<const int*>(a.counts);
  sp.offsets = reinterpret_cast<const int*>(a.offsets);
  sp.x = reinterpret_cast<const uint8_t*>(a.x);
  sp.w = reinterpret_cast<const uint8_t*>(a.w);
  sp.out = reinterpret_cast<uint8_t*>(a.out);
  sp.x_scale = reinterpret_cast<const float*>(a.x_scale);
  sp.w_scale = reinterpret_cast<const float*>(a.w_scale);
  sp.rows = a.rows;
  sp.ldx = a.ldx;
  sp.experts = a.experts, sp.n = a.n, sp.k = a.k;
  sp.x_bytes = dtype_size(a.x_dtype), sp.w_bytes = dtype_size(a.w_dtype);
  sp.x_scale_per_row = a.x_scale_mode == kMoeXScaleGroup ? a.k / 128 : 1;
  const int64_t nb = (a.n + 127) / 128, kb = (a.k + 127) / 128;
  sp.w_scale_per_expert = a.w_scale_mode == kMoeWScaleChannel ? a.n
                          : a.w_scale_mode == kMoeWScaleBlock ? nb * kb
                                                              : 1;
  constexpr int kSetupThreads = 128;
  launch_kernel("grouped_gemm_setup", grouped_gemm_setup<G>,
                dim3(unsigned((a.experts + kSetupThreads - 1) / kSetupThreads)),
                dim3(kSetupThreads), st, sp, arr);

  Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  FUSEDIST_CHECK_ARG(s == cutlass::Status::kSuccess,
                     w + "CUTLASS cannot run this problem (" + cutlassGetStatusString(s) + ")");
  s = gemm.initialize(args, arr.cutlass, st);
  if (s != cutlass::Status::kSuccess)
    throw std::runtime_error("fusedist: " + w + "CUTLASS initialize failed: " +
                             cutlassGetStatusString(s));
  s = gemm.run(st);
  FUSEDIST_LAUNCH_CHECK("moe_grouped_gemm (CUTLASS grouped GEMM)");
  if (s != cutlass::Status::kSuccess)
    throw std::runtime_error("fusedist: " + w + "CUTLASS launch failed: " +
                             cutlassGetStatusString(s));
}

}  // namespace grouped
}  // namespace fusedist
