// Host launcher of the Hopper FP8 GEMM (csrc/include/fusedist/gemm/fp8_gemm_sm90.cuh): argument
// checks, the CUTLASS arguments (operands, the epilogue's scale and bias vectors, the
// persistent stream-K scheduler over the device's SMs), the workspace size and the launch. One
// instantiation: bf16 output, 128 x 128 x 128 tiles.
#include <stdexcept>
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/gemm/api.h"
#include "fusedist/gemm/fp8_gemm_sm90.cuh"

namespace fusedist {

// The block-scaled form's workspace size and launch (csrc/ops/gemm/fp8_gemm_block.cu, its own
// translation unit: a second CUTLASS kernel compiles in parallel with this one).
int64_t fp8_gemm_block_workspace(const Fp8GemmArgs& a);
void fp8_gemm_block_run(const Fp8GemmArgs& a, cudaStream_t stream);

std::string fp8_gemm_why_not(const Fp8GemmArgs& a) {
  const std::string w = "fp8_gemm: ";
  if (a.out_dtype != DType::kBFloat16)
    return w + "out_dtype must be bfloat16, got " + dtype_name(a.out_dtype);
  if (a.m < 0 || a.n <= 0 || a.k <= 0)
    return w + "sizes must be m >= 0, n > 0, k > 0; got m=" + std::to_string(a.m) +
           ", n=" + std::to_string(a.n) + ", k=" + std::to_string(a.k);
  if (a.k % 16 || a.n % 8)
    return w + "K must be a multiple of 16 and N of 8 (16-byte TMA rows); got N=" +
           std::to_string(a.n) + ", K=" + std::to_string(a.k);
  if (a.ldx < a.k || a.ldw < a.k || a.ldo < a.n || a.ldx % 16 || a.ldw % 16 || a.ldo % 8)
    return w + "row strides must cover the rows and be multiples of 16 bytes (ldx, ldw % 16, "
               "ldo % 8 elements); got ldx=" + std::to_string(a.ldx) + ", ldw=" +
           std::to_string(a.ldw) + ", ldo=" + std::to_string(a.ldo);
  if ((a.xq | a.wq | a.out) % 16 || (a.sx | a.sw) % 16 || a.bias % 16)
    return w + "xq, wq, out, sx, sw and bias must be 16-byte aligned";
  if (a.block != 0 && a.block != 1)
    return w + "block must be 0 (per-token x per-channel scales) or 1 (128 x 128 blocks), got " +
           std::to_string(a.block);
  return "";
}

namespace {

using G = Fp8GemmSm90<cutlass::bfloat16_t>;
using Gemm = G::Gemm;

// The CUTLASS arguments of a checked call: operands and strides, the epilogue tree's scale and
// bias vectors, the persistent grid over the device's SMs, the stream-K scheduler's defaults.
typename Gemm::Arguments gemm_arguments(const Fp8GemmArgs& a) {
  using Kernel = G::Kernel;
  using E8 = G::E8;
  using Out = G::Out;
  // Strides (M or N mode, K mode, batch) for A and B, (M, N, batch) for D; unit strides static.
  typename Kernel::StrideA sa{};
  typename Kernel::StrideB sb{};
  typename Kernel::StrideC sc{};
  typename Kernel::StrideD sd{};
  cute::get<0>(sa) = a.ldx;
  cute::get<0>(sb) = a.ldw;
  cute::get<0>(sd) = a.ldo;
  cute::get<0>(sc) = a.ldo;

  cutlass::KernelHardwareInfo hw;
  FUSEDIST_CUDA_CHECK(cudaGetDevice(&hw.device_id));
  hw.sm_count = a.sms > 0 ? a.sms : current_device_sm_count();

  // The epilogue tree's arguments, children first: sx[m], (sw[n], acc, multiply), bias[n],
  // then the node's own (multiply-add). A null bias reads as 0 (the visitor's fallback).
  typename G::ScaleX::Arguments sx_args{reinterpret_cast<const float*>(a.sx), 0.0f, {}};
  typename G::ScaleW::Arguments sw_args{reinterpret_cast<const float*>(a.sw), 0.0f, {}};
  typename G::Bias::Arguments bias_args{reinterpret_cast<const Out*>(a.bias), Out(0.0f), {}};
  typename G::ScaledW::Arguments scaled_w{sw_args, {}, {}};
  typename G::Evt::Arguments evt{sx_args, scaled_w, bias_args, {}};

  return typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {a.m, a.n, a.k, 1},
      {reinterpret_cast<const E8*>(a.xq), sa, reinterpret_cast<const E8*>(a.wq), sb},
      {evt, nullptr, sc, reinterpret_cast<Out*>(a.out), sd},
      hw};
}

}  // namespace

int64_t fp8_gemm_workspace_size(const Fp8GemmArgs& a) {
  const std::string why = fp8_gemm_why_not(a);
  FUSEDIST_CHECK_ARG(why.empty(), why);
  if (a.m == 0) return 0;
  if (a.block) return fp8_gemm_block_workspace(a);
  return int64_t(Gemm::get_workspace_size(gemm_arguments(a)));
}

void fp8_gemm(const Fp8GemmArgs& a, uintptr_t stream) {
  const std::string why = fp8_gemm_why_not(a);
  FUSEDIST_CHECK_ARG(why.empty(), why);
  FUSEDIST_CHECK_ARG(a.xq && a.wq && a.sx && a.sw && a.out,
                     "fp8_gemm: xq, wq, sx, sw and out must be non-null");
  if (a.m == 0) return;
  if (a.block) {
    fp8_gemm_block_run(a, reinterpret_cast<cudaStream_t>(stream));
    return;
  }
  auto args = gemm_arguments(a);
  Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  FUSEDIST_CHECK_ARG(s == cutlass::Status::kSuccess,
                     std::string("fp8_gemm: CUTLASS cannot run this problem (") +
                         cutlassGetStatusString(s) + ")");
  const int64_t need = int64_t(Gemm::get_workspace_size(args));
  FUSEDIST_CHECK_ARG(need == 0 || (a.workspace && a.workspace % 16 == 0 &&
                                   a.workspace_bytes >= need),
                     "fp8_gemm: this call needs a 16-byte aligned workspace of " +
                         std::to_string(need) + " bytes (fp8_gemm_workspace_size), got " +
                         std::to_string(a.workspace_bytes));
  auto st = reinterpret_cast<cudaStream_t>(stream);
  s = gemm.initialize(args, need ? reinterpret_cast<void*>(a.workspace) : nullptr, st);
  if (s != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("fusedist: fp8_gemm: CUTLASS initialize failed: ") +
                             cutlassGetStatusString(s));
  s = gemm.run(st);
  FUSEDIST_LAUNCH_CHECK("fp8_gemm (CUTLASS GemmUniversal, FP8)");
  if (s != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("fusedist: fp8_gemm: CUTLASS launch failed: ") +
                             cutlassGetStatusString(s));
}

}  // namespace fusedist
