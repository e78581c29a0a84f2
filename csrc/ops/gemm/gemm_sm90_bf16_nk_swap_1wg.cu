// One CUTLASS kernel of fusedist.gemm(kernel="sm90"): bf16, w the .t() of an [N, K] weight, swap tile, one consumer warpgroup.
#include "gemm_sm90_run.cuh"

template void fusedist::gemm_sm90_run<__nv_bfloat16, true, fusedist::kSm90TileSwap1wg>(const fusedist::GemmSm90Call&);
