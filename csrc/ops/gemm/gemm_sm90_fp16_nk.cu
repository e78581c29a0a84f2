// One CUTLASS kernel of fusedist.gemm(kernel="sm90"): fp16, w the .t() of an [N, K] weight, wide tile.
#include "gemm_sm90_run.cuh"

template void fusedist::gemm_sm90_run<__half, true, fusedist::kSm90TileWide>(const fusedist::GemmSm90Call&);
