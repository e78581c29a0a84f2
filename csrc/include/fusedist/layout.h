// fusedist/layout.h -- host-visible layout of a symmetric communicator: the control block,
// the error record, the buffer layout and the SymmView that kernels receive by value (so a
// CUDA graph captures it once). Plain structs, no device code: the bindings include it too.
//
// Buffer layout, identical on every rank (byte offsets from that rank's base):
//
//   generation g (g = epoch % kGenerations), at g * gen_bytes:
//     slot s, s = 0..world-1, at s * slot_bytes   one-shot: rank s's whole input;
//                                                  two-shot: rank s's share of MY chunk
//     gather, at world * slot_bytes               two-shot: reduced chunks from their owners
//
// Writers: rank s writes only slot s of a peer's generation (and owners write the gather
// region at their own chunk's offsets). Readers: only the owning rank reads its buffer, and
// it writes kEmptyWord back behind itself. A generation is written again kGenerations calls
// later; by then every reader has consumed and cleared it (see docs/design/allreduce.md).
#pragma once
#include <cstdint>

#include "fusedist/common.h"

namespace fusedist {

// Value of every free 32-bit word of a receive slot (signals.cuh explains the protocol).
constexpr uint32_t kEmptyWord = 0x80008000u;
constexpr uint32_t kSanitizedWord = 0x00008000u;

// Error record in host-mapped (zero-copy) memory: the host reads it without a CUDA call,
// so a timed-out wait is reported even while the device is stuck elsewhere.
struct ErrorRecord {
  uint32_t code;      // 0 = ok, kErrTimeout = a peer never arrived
  int32_t rank;       // the rank that gave up waiting
  int32_t peer;       // the peer it was waiting for
  uint32_t epoch;     // the communicator call index (low 32 bits)
  uint32_t op;        // OpCode of the kernel
  uint32_t pad[3];
};
constexpr uint32_t kErrTimeout = 1;
enum OpCode : uint32_t { kOpOneShot = 1, kOpTwoShot = 2, kOpOneShotRmsNorm = 3, kOpGemmAr = 4,
                       kOpAgGemm = 5, kOpGemmRs = 6 };

// Per-rank control block in local device memory (not shared with peers).
//   epoch:  calls completed on this communicator; generation = epoch % kGenerations. Block 0
//           of each kernel advances it once every block has arrived, so CUDA-graph replays
//           rotate buffers too (signals.cuh: begin_epoch / finish_epoch).
//   arrive: blocks of the running kernel that have read the epoch (block 0 resets it).
//   failed: set once any wait timed out; later waits give up at their first clock check
//           (256 spins) instead of waiting out the timeout again.
struct Control {
  uint32_t epoch;
  uint32_t arrive;
  uint32_t failed;
  uint32_t pad;
};

constexpr int kGenerations = 3;

// The Hopper GEMM's tile (gemm_sm90.cuh): 128 x 256 per CTA, 2-CTA clusters along M.
constexpr int kGemmSm90BlockM = 128;
constexpr int kGemmSm90ClusterM = 2;
constexpr int kGemmSm90BlockN = 256;
// Its tile configurations (GemmSm90): wide (the above) for prefill and the fused engines'
// waits and signals; narrow (128 x 64, no cluster) and mid (128 x 128, no cluster) for plain
// GEMMs of few rows. kSm90TileAuto: gemm.cu picks, for plain GEMMs, the narrow tile up to
// kGemmSm90SwapTokens rows (at N = 8192: 128 CTAs stream the weight instead of 32), the swap
// tile's one-warpgroup form (swap_1wg, below) to one row block, and the mid tile up to
// kGemmSm90MidMaxM rows when x has whole tiles of rows to read (m_load). Each SM takes in
// (128 + BlockN) x K elements per tile: at 129-256 rows the mid tile's 128 tiles take in 2 MB
// per SM at K = 4096, the narrow tile's 256 tiles 3 MB (two per SM). Partial row blocks, read
// past x's end, lose to the wide tile (the narrow one: 54-66 us against 44 at M = 160-192).
// swap (plain GEMMs): D^T = W^T X^T in 128 weight columns x 64 tokens, the weight tile
// multicast to a 1 x 2 cluster (cuBLAS's shape at M = 128); tokens on the MMA's N side,
// kGemmSm90SwapTokens per tile. Built for more than one token tile (the cluster's second CTA
// has rows) up to one row block, 65-128 rows: 0.93-1.15x cuBLAS block-timed where the narrow
// tile gave 0.88-0.94 (benchmarks/results/gemm_s9f-*); auto's tile there in session 9.
// swap_1wg: the swap tile with one consumer warpgroup doing the whole 128 x 64 tile, not
// persistent (CUTLASS's KernelTmaWarpSpecialized; the other tiles run two cooperative
// warpgroups on fusedist's persistent scheduler). Plain GEMMs only. Auto's tile for 65-128
// rows since session 10: 5-11% faster than the cooperative swap tile at 96-128 rows under
// load (paced, benchmarks/results/gemm_s10d-*), 0.92-1.11x cuBLAS.
enum Sm90Tile : int {
  kSm90TileAuto = 0, kSm90TileWide = 1, kSm90TileNarrow = 2, kSm90TileMid = 3, kSm90TileSwap = 4,
  kSm90TileSwap1wg = 5
};
constexpr int kGemmSm90NarrowBlockN = 64;
constexpr int kGemmSm90MidBlockN = 128;
constexpr int kGemmSm90MidMaxM = 256;
constexpr int kGemmSm90SwapTokens = 64;
// The order the persistent scheduler hands out tiles. Along N (the wide tile's, with
// swizzled groups of M tiles): a wave covers few row blocks and many weight columns. Along M
// (plain GEMMs only): a wave covers every row block of fewer weight columns, so a weight that
// does not fit in L2 streams from HBM once, not once per row block (the narrow tile: no faster
// at 160-256 rows, faster at 320-384; benchmarks/NOTES.md, session 9). kSm90RasterAuto: along
// N for the wide tile, along M for the others (the swap tile's M is the weight's columns).
enum Sm90Raster : int { kSm90RasterAuto = 0, kSm90RasterAlongN = 1, kSm90RasterAlongM = 2 };
// gemm_rs engine='fused': a rank's counter region holds kMaxSignalPieces uint32 slots per
// source rank (row pieces of its block, at most), source-major.
constexpr int kMaxSignalPieces = 64;

struct SymmView {
  uint8_t* base[kMaxRanks];  // rank p's symmetric buffer, mapped into this process
  uint64_t gen_bytes;        // bytes of one generation
  uint64_t slot_bytes;       // bytes of one slot (one-shot capacity, two-shot chunk capacity)
  Control* ctl;              // this rank's control block (device memory)
  ErrorRecord* err;          // device alias of this rank's host-mapped error record
  uint64_t timeout_ns;       // bounded wait for a peer
  int rank;
  int world;
};

}  // namespace fusedist
