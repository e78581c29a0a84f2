// csrc/ops/gemm_sm90.h -- the call the Hopper GEMM launcher (gemm.cu) hands to its
// instantiations (gemm_sm90_<dtype>_<layout>_<tile>.cu, one CUTLASS kernel each, compiled in
// parallel). Host code; no CUTLASS here.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "fusedist/chunk_wait.cuh"

namespace fusedist {

// Tile configurations (gemm_sm90.cuh GemmSm90Tile): output rows per CTA tile and CTAs per
// cluster along M, which the chunk-wait rotation needs on the host.
enum GemmSm90Tile : int { kTile128x256 = 0, kTile256x128 = 1 };
constexpr int gemm_sm90_block_m(int tile) { return tile == kTile256x128 ? 256 : 128; }
constexpr int gemm_sm90_cluster_m(int tile) { return tile == kTile256x128 ? 1 : 2; }

struct GemmSm90Call {
  uintptr_t x, w, bias, c, out;  // c == 0: no C term
  int64_t ldx, ldw, ldc, ldo;    // row strides (elements)
  float beta;
  int m, n, k;
  ChunkWait wait;                // wait.flags == nullptr: a plain GEMM
  int sms;                       // persistent CTAs
  cudaStream_t stream;
};

// T: __nv_bfloat16 or __half; kWNK: w is the .t() of an [N, K] row-major weight.
template <typename T, bool kWNK, int kTile>
void gemm_sm90_run(const GemmSm90Call& a);

}  // namespace fusedist
