// The 128 x 128 block-scaled form of fusedist.ops.fp8_gemm (Fp8GemmBlockSm90 in
// csrc/include/fusedist/gemm/fp8_gemm_sm90.cuh): its CUTLASS arguments (operands, the 1 x 128 and
// 128 x 128 scale layouts, the bias), workspace size and launch. fp8_gemm.cu checks the call
// and dispatches here.
#include <stdexcept>
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/gemm/api.h"
#include "fusedist/gemm/fp8_gemm_sm90.cuh"

namespace fusedist {
namespace {

using GB = Fp8GemmBlockSm90<cutlass::bfloat16_t>;
using GemmB = GB::Gemm;

typename GemmB::Arguments block_arguments(const Fp8GemmArgs& a) {
  using Kernel = GB::Kernel;
  using E8 = GB::E8;
  using Out = GB::Out;
  typename Kernel::StrideA sa{};
  typename Kernel::StrideB sb{};
  typename Kernel::StrideC sc{};
  typename Kernel::StrideD sd{};
  cute::get<0>(sa) = a.ldx;
  cute::get<0>(sb) = a.ldw;
  cute::get<0>(sd) = a.ldo;
  cute::get<0>(sc) = a.ldo;
  const auto shape = cute::make_shape(a.m, a.n, a.k, 1);
  const auto layout_sfa = GB::ScaleConfig::tile_atom_to_shape_SFA(shape);
  const auto layout_sfb = GB::ScaleConfig::tile_atom_to_shape_SFB(shape);

  cutlass::KernelHardwareInfo hw;
  FUSEDIST_CUDA_CHECK(cudaGetDevice(&hw.device_id));
  hw.sm_count = a.sms > 0 ? a.sms : current_device_sm_count();

  // The epilogue tree: acc, then bias[n] (a null bias reads as 0), then the node's own (plus).
  typename GB::Bias::Arguments bias_args{reinterpret_cast<const Out*>(a.bias), Out(0.0f), {}};
  typename GB::Evt::Arguments evt{{}, bias_args, {}};

  return typename GemmB::Arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {a.m, a.n, a.k, 1},
      {reinterpret_cast<const E8*>(a.xq), sa, reinterpret_cast<const E8*>(a.wq), sb,
       reinterpret_cast<const float*>(a.sx), layout_sfa, reinterpret_cast<const float*>(a.sw),
       layout_sfb},
      {evt, nullptr, sc, reinterpret_cast<Out*>(a.out), sd},
      hw};
}

}  // namespace

int64_t fp8_gemm_block_workspace(const Fp8GemmArgs& a) {
  return int64_t(GemmB::get_workspace_size(block_arguments(a)));
}

void fp8_gemm_block_run(const Fp8GemmArgs& a, cudaStream_t st) {
  auto args = block_arguments(a);
  GemmB gemm;
  cutlass::Status s = gemm.can_implement(args);
  FUSEDIST_CHECK_ARG(s == cutlass::Status::kSuccess,
                     std::string("fp8_gemm (block scales): CUTLASS cannot run this problem (") +
                         cutlassGetStatusString(s) + ")");
  const int64_t need = int64_t(GemmB::get_workspace_size(args));
  FUSEDIST_CHECK_ARG(need == 0 || (a.workspace && a.workspace % 16 == 0 &&
                                   a.workspace_bytes >= need),
                     "fp8_gemm (block scales): this call needs a 16-byte aligned workspace of " +
                         std::to_string(need) + " bytes, got " + std::to_string(a.workspace_bytes));
  s = gemm.initialize(args, need ? reinterpret_cast<void*>(a.workspace) : nullptr, st);
  if (s != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("fusedist: fp8_gemm (block scales): CUTLASS initialize "
                                         "failed: ") + cutlassGetStatusString(s));
  s = gemm.run(st);
  FUSEDIST_LAUNCH_CHECK("fp8_gemm (CUTLASS GemmUniversal, FP8 block-scaled)");
  if (s != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("fusedist: fp8_gemm (block scales): CUTLASS launch "
                                         "failed: ") + cutlassGetStatusString(s));
}

}  // namespace fusedist
