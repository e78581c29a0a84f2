// The grouped GEMM's fp8_block form (e4m3 x e4m3, 1 x 128 / 128 x 128 block scales):
// one CUTLASS instantiation in its own translation unit (grouped_gemm_run.cuh; grouped_gemm.cu
// checks the call and dispatches here).
#include "grouped_gemm_run.cuh"

namespace fusedist {

int64_t moe_grouped_gemm_fp8_block_workspace(const MoeGroupedGemmArgs& a) {
  return grouped::workspace_bytes<grouped::Fp8Block>(a);
}

void moe_grouped_gemm_fp8_block_run(const MoeGroupedGemmArgs& a, cudaStream_t stream) {
  grouped::run<grouped::Fp8Block>(a, stream, "fp8_block");
}

}  // namespace fusedist
