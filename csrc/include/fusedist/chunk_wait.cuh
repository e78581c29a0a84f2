// fusedist/chunk_wait.cuh -- what a tile of the all-gather GEMM waits for (gemm_sm90.cuh has
// the protocol): the copy-engine flags of the rows it reads, bounded by the communicator's
// timeout. No CUTLASS here, so host launchers can include it cheaply.
#pragma once

#include <cstdint>

#include "fusedist/layout.h"
#include "fusedist/signals.cuh"

namespace fusedist {

// The GEMM's tile: 128 rows (M) per CTA, 2-CTA clusters along M (gemm_sm90.cuh).
constexpr int kGemmSm90BlockM = 128;
constexpr int kGemmSm90ClusterM = 2;

// What a tile waits for before it loads A (ag_gemm engine='fused'); flags == nullptr: nothing.
struct ChunkWait {
  const uint32_t* flags = nullptr;  // [blocks * pieces], set to 1 by the copy streams
  int rows = 0;                     // rows of A (blocks * block_rows)
  int block_rows = 1;               // rows of one rank's block
  int piece_rows = 1;               // rows of one copy piece (a block's last piece: fewer)
  int pieces = 1;                   // pieces per block
  int rotate_tiles = 0;             // M tiles the walk is rotated by (multiple of cluster M)
  int tiles_m = 1;                  // M tiles, rounded up to the cluster's M
  Control* ctl = nullptr;           // the communicator's control block and error record
  ErrorRecord* err = nullptr;
  uint64_t timeout_ns = 0;
  int rank = 0;
};

__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Spin until *flag != 0; false after a timeout (recorded) or when the communicator failed.
__device__ __forceinline__ bool wait_flag(const uint32_t* flag, const ChunkWait& w, int peer) {
  if (ld_acquire_sys_u32(flag) != 0u) return true;
  uint64_t start = 0;
  for (uint32_t spins = 1;; ++spins) {
    __nanosleep(64);
    if (ld_acquire_sys_u32(flag) != 0u) return true;
    if ((spins & 63u) == 0) {
      if (ld_volatile_u32(&w.ctl->failed)) return false;
      const uint64_t now = globaltimer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > w.timeout_ns) {
        record_timeout(w.ctl, w.err, w.rank, peer, 0u, kOpAgGemm);
        return false;
      }
    }
  }
}

// Wait for every copy piece that rows [r0, r1) of A touch.
__device__ __forceinline__ void wait_rows(const ChunkWait& w, int r0, int r1) {
  bool ok = true;
  for (int row = r0; ok && row < r1;) {
    const int block = row / w.block_rows;
    const int piece = (row - block * w.block_rows) / w.piece_rows;
    ok = wait_flag(w.flags + block * w.pieces + piece, w, block);
    row = block * w.block_rows + min((piece + 1) * w.piece_rows, w.block_rows);
  }
  // The rows were written by the copy engine and are read next by TMA (async proxy).
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace fusedist
