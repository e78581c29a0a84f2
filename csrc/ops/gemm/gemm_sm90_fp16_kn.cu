// One CUTLASS kernel of fusedist.gemm(kernel="sm90"): fp16, w [K, N] row-major, wide tile.
#include "gemm_sm90_run.cuh"

template void fusedist::gemm_sm90_run<__half, false, fusedist::kSm90TileWide>(const fusedist::GemmSm90Call&);
