// One CUTLASS kernel of fusedist.gemm(kernel="sm90"): fp16, w [K, N] row-major, narrow tile.
#include "gemm_sm90_run.cuh"

template void fusedist::gemm_sm90_run<__half, false, fusedist::kSm90TileNarrow>(const fusedist::GemmSm90Call&);
