// One CUTLASS kernel of fusedist.gemm(kernel="sm90"): fp16, w [K, N] row-major, swap tile.
#include "gemm_sm90_run.cuh"

template void fusedist::gemm_sm90_run<__half, false, fusedist::kSm90TileSwap>(const fusedist::GemmSm90Call&);
