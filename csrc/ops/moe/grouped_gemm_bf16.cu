// The grouped GEMM's bf16 form (bf16 x bf16):
// one CUTLASS instantiation in its own translation unit (grouped_gemm_run.cuh; grouped_gemm.cu
// checks the call and dispatches here).
#include "grouped_gemm_run.cuh"

namespace fusedist {

int64_t moe_grouped_gemm_bf16_workspace(const MoeGroupedGemmArgs& a) {
  return grouped::workspace_bytes<grouped::Bf16>(a);
}

void moe_grouped_gemm_bf16_run(const MoeGroupedGemmArgs& a, cudaStream_t stream) {
  grouped::run<grouped::Bf16>(a, stream, "bf16");
}

}  // namespace fusedist
