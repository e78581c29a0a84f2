// The grouped GEMM's fp8 form (e4m3 x e4m3, per-row x per-channel / per-expert scales):
// one CUTLASS instantiation in its own translation unit (grouped_gemm_run.cuh; grouped_gemm.cu
// checks the call and dispatches here).
#include "grouped_gemm_run.cuh"

namespace fusedist {

int64_t moe_grouped_gemm_fp8_workspace(const MoeGroupedGemmArgs& a) {
  return grouped::workspace_bytes<grouped::Fp8>(a);
}

void moe_grouped_gemm_fp8_run(const MoeGroupedGemmArgs& a, cudaStream_t stream) {
  grouped::run<grouped::Fp8>(a, stream, "fp8");
}

}  // namespace fusedist
