// One CUTLASS kernel of fusedist.gemm(kernel="sm90"): fp16, w the .t() of an [N, K] weight, 128 x 256 tiles.
#include "gemm_sm90_run.cuh"

template void fusedist::gemm_sm90_run<__half, true, 0>(const fusedist::GemmSm90Call&);
