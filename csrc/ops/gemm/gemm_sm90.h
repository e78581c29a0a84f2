// csrc/ops/gemm/gemm_sm90.h -- the call the Hopper GEMM launcher (gemm.cu) hands to its
// instantiations (gemm_sm90_<dtype>_<layout>.cu, one CUTLASS kernel each, compiled in
// parallel). Host code; no CUTLASS here.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "fusedist/gemm/chunk_wait.cuh"

namespace fusedist {

struct GemmSm90Call {
  uintptr_t x, w, bias, c, out;  // c == 0: no C term
  int64_t ldx, ldw, ldc, ldo;    // row strides (elements)
  float beta;
  int m, n, k;
  int m_load;                    // rows of x the mainloop may read: m .. m rounded up to the
                                 // tile (the rows past m are real memory, their output unused)
  ChunkWait wait;                // wait.flags == nullptr: no wait
  ChunkSignal signal;            // signal.offset == 0: no signals
  int sms;                       // persistent CTAs
  bool raster_m;                 // tiles handed out along M (layout.h, Sm90Raster)
  cudaStream_t stream;
};

// The scheduler's swizzle (M clusters per raster group) for m rows: 8, or less where CUTLASS's
// padding of the M clusters to a multiple of it would add more than 1/8 phantom tiles.
inline int gemm_sm90_swizzle(int m, int cluster_m) {
  const int tiles = (m + kGemmSm90BlockM - 1) / kGemmSm90BlockM;
  const int clusters = (tiles + cluster_m - 1) / cluster_m;
  int swizzle = 8;
  while (swizzle > 1 && (clusters + swizzle - 1) / swizzle * swizzle * 8 > clusters * 9)
    swizzle /= 2;
  return swizzle;
}

// T: __nv_bfloat16 or __half; kWNK: w is the .t() of an [N, K] row-major weight; kTile: an
// Sm90Tile other than auto.
template <typename T, bool kWNK, int kTile>
void gemm_sm90_run(const GemmSm90Call& a);

}  // namespace fusedist
