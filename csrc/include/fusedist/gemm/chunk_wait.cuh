// fusedist/gemm/chunk_wait.cuh -- the flags the Hopper GEMM (gemm_sm90.cuh) waits on and signals
// in the fused GEMM + collective engines (gemm_sm90.cuh has the protocols):
//   ChunkWait   a tile waits for the copy-engine flags of the rows it reads: its A rows
//               (ag_gemm) or its C rows (gemm_rs), bounded by the communicator's timeout;
//   ChunkSignal after a tile's D stores land, +1 on the owner rank's counter of each row
//               piece the tile wrote (gemm_rs: the owner's comm stream pulls finished pieces);
//   wait_geq    the bounded spin both use (the comm stream's counter wait: gemm_comm.cuh).
// No CUTLASS here, so host launchers can include it cheaply.
#pragma once

#include <cstdint>

#include "fusedist/common/layout.h"
#include "fusedist/common/signals.cuh"

namespace fusedist {

// What a tile waits for; flags == nullptr: nothing. on_c == false (ag_gemm engine='fused'):
// every role of the CTA waits for the tile's A rows before its first load. on_c == true
// (gemm_rs engine='fused', the own block's GEMM): only the epilogue's C-load warp waits, for
// the tile's C rows, so the mainloop runs while the rows are still in flight.
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
  int peer = -1;                    // the rank a timeout names; -1: the block's rank
  uint32_t op = kOpAgGemm;          // OpCode a timeout records
  bool on_c = false;
};

// What a tile signals after its D stores land (gemm_rs engine='fused', the GEMM of the other
// ranks' blocks into this rank's staging); offset == 0: nothing.
struct ChunkSignal {
  uint8_t* base[kMaxRanks] = {};    // every rank's symmetric buffer, mapped here
  uint64_t offset = 0;              // bytes from a base to that rank's counters
  int rows = 0;                     // rows of this launch's problem
  int row0 = 0;                     // global row (block layout) of the launch's row 0
  int block_rows = 1;               // rows of one rank's block
  int piece_rows = 1;               // rows of one piece (a block's last piece: fewer)
  int pieces = 1;                   // pieces per block (<= kMaxSignalPieces)
  int src = 0;                      // this rank: its counter slots on the owners
};

__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Spin until *p >= target (acquire); false after a timeout (recorded) or when the
// communicator failed. Sleeps 64 ns between polls and checks the clock every 64.
__device__ __forceinline__ bool wait_geq(const uint32_t* p, uint32_t target, Control* ctl,
                                         ErrorRecord* err, uint64_t timeout_ns, int rank, int peer,
                                         uint32_t op) {
  return bounded_spin<63u, 64u>([&] { return ld_acquire_sys_u32(p) >= target; }, ctl, err,
                                timeout_ns, rank, peer, 0u, op);
}

// Flags are set to 1 by the copying stream.
__device__ __forceinline__ bool wait_flag(const uint32_t* flag, const ChunkWait& w, int peer) {
  return wait_geq(flag, 1u, w.ctl, w.err, w.timeout_ns, w.rank, w.peer >= 0 ? w.peer : peer, w.op);
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

__device__ __forceinline__ void red_release_sys_add_u32(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Rows [r0, r1) of the launch's problem are in global memory (their TMA stores completed and
// were fenced against the generic proxy): +1 on the owner's counter of every piece they touch.
__device__ __forceinline__ void signal_rows(const ChunkSignal& s, int r0, int r1) {
  __threadfence_system();
  for (int row = s.row0 + r0, end = s.row0 + r1; row < end;) {
    const int block = row / s.block_rows;
    const int piece = (row - block * s.block_rows) / s.piece_rows;
    uint32_t* counters = reinterpret_cast<uint32_t*>(s.base[block] + s.offset);
    red_release_sys_add_u32(counters + s.src * kMaxSignalPieces + piece, 1u);
    row = block * s.block_rows + min((piece + 1) * s.piece_rows, s.block_rows);
  }
}

}  // namespace fusedist
