// csrc/ops/gemm_sm90.h -- the call the Hopper GEMM launcher (gemm.cu) hands to its
// instantiations (gemm_sm90_<dtype>_<layout>.cu, one CUTLASS kernel each, compiled in
// parallel). Host code; no CUTLASS here.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "fusedist/chunk_wait.cuh"

namespace fusedist {

struct GemmSm90Call {
  uintptr_t x, w, bias, c, out;  // c == 0: no C term
  int64_t ldx, ldw, ldc, ldo;    // row strides (elements)
  float beta;
  int m, n, k;
  ChunkWait wait;                // wait.flags == nullptr: no wait
  ChunkSignal signal;            // signal.offset == 0: no signals
  int sms;                       // persistent CTAs
  cudaStream_t stream;
};

// T: __nv_bfloat16 or __half; kWNK: w is the .t() of an [N, K] row-major weight.
template <typename T, bool kWNK>
void gemm_sm90_run(const GemmSm90Call& a);

}  // namespace fusedist
