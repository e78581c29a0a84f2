// One CUTLASS kernel of fusedist.gemm(kernel="sm90"): bf16, w the .t() of an [N, K] weight, 256 x 128 tiles.
#include "gemm_sm90_run.cuh"

template void fusedist::gemm_sm90_run<__nv_bfloat16, true, 1>(const fusedist::GemmSm90Call&);
