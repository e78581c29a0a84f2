// One CUTLASS kernel of fusedist.gemm(kernel="sm90"): fp16, w [K, N] row-major, mid tile.
#include "gemm_sm90_run.cuh"

template void fusedist::gemm_sm90_run<__half, false, fusedist::kSm90TileMid>(const fusedist::GemmSm90Call&);
