// fusedist/common/layout.h -- host-visible layout of a symmetric communicator: the control block,
// the error record, the buffer layout and the SymmView that kernels receive by value (so a
// CUDA graph captures it once). Plain structs, no device code: the bindings include it too.
//
// Buffer layout, identical on every rank (byte offsets from that rank's base):
//
//   generation g (g = epoch % kGenerations), at g * gen_bytes:
//     slot s, s = 0..world-1, at s * slot_bytes   one-shot: rank s's whole input;
//                                                  two-shot: rank s's share of MY chunk
//     gather, at world * slot_bytes               two-shot: reduced chunks from their owners
//     call descriptors, the last kDescBytes       16 bytes per source rank s: what rank s
//                                                  called (op, dtype, sizes: desc_word below;
//                                                  exchanged in symmetric.cuh and by the call
//                                                  check, call_check.cuh)
//
// Writers: rank s writes only slot s (and descriptor s) of a peer's generation (and owners
// write the gather region at their own chunk's offsets). Readers: only the owning rank reads
// its buffer, and it writes kEmptyWord back behind itself. A generation is written again
// kGenerations calls later; by then every reader has consumed and cleared it (see
// docs/design/allreduce.md). The epoch wraps at kEpochPeriod, a multiple of kGenerations, so
// consecutive calls always use different generations, across the wrap too.
#pragma once
#include <cstdint>

#include "fusedist/common/common.h"

namespace fusedist {

// Value of every free 32-bit word of a receive slot (signals.cuh explains the protocol).
constexpr uint32_t kEmptyWord = 0x80008000u;
constexpr uint32_t kSanitizedWord = 0x00008000u;

// Error record in host-mapped (zero-copy) memory: the host reads it without a CUDA call,
// so a timed-out wait is reported even while the device is stuck elsewhere.
struct ErrorRecord {
  uint32_t code;        // 0 = ok, kErrTimeout = a peer never arrived, kErrMismatch = a peer
                        // made a different call (another op, dtype or size)
  int32_t rank;         // the rank that recorded it
  int32_t peer;         // the peer it was waiting for / that called differently
  uint32_t epoch;       // the communicator call index (modulo kEpochPeriod)
  uint32_t op;          // OpCode of the kernel
  uint32_t pad[3];
  uint32_t mine[4];     // kErrMismatch: this rank's call descriptor (desc_word)
  uint32_t theirs[4];   // kErrMismatch: the peer's call descriptor
};
constexpr uint32_t kErrTimeout = 1;
constexpr uint32_t kErrMismatch = 2;
// What a kernel is (ErrorRecord::op) and what a rank called (a call descriptor's op). 1-7 are
// kernels; 4-6 also name the GEMM + collective op in the descriptors of its symmetric paths
// (the fused kernels, the copy-engine pipelines' call checks); 8-10 name only descriptors: the
// NCCL call that a call check guards (call_check.cuh).
enum OpCode : uint32_t { kOpOneShot = 1, kOpTwoShot = 2, kOpOneShotRmsNorm = 3, kOpGemmAr = 4,
                       kOpAgGemm = 5, kOpGemmRs = 6, kOpCallCheck = 7, kOpNcclAllReduce = 8,
                       kOpNcclAllGather = 9, kOpNcclReduceScatter = 10 };

// Per-rank control block in local device memory (not shared with peers).
//   epoch:  calls completed on this communicator, modulo kEpochPeriod; generation =
//           epoch % kGenerations. Block 0 of each kernel advances it once every block has
//           arrived, so CUDA-graph replays rotate buffers too (signals.cuh: begin_epoch /
//           finish_epoch).
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
// The epoch counts modulo kEpochPeriod, the largest multiple of kGenerations that fits a
// uint32_t (2^32 - 1 = 3 x 1431655765). Counting modulo 2^32 instead would map 0xFFFFFFFF and
// the 0 after it to the same generation (2^32 is not a multiple of 3): a fast rank would push
// the next call into a slot its peer has not read yet.
constexpr uint32_t kEpochPeriod = 0xFFFFFFFFu / kGenerations * kGenerations;
static_assert(kEpochPeriod % kGenerations == 0, "the epoch must wrap on a generation boundary");
__host__ __device__ constexpr uint32_t next_epoch(uint32_t epoch) {
  return epoch + 1 >= kEpochPeriod ? 0u : epoch + 1;
}
__host__ __device__ constexpr uint32_t generation_of(uint32_t epoch) {
  return epoch % kGenerations;
}
static_assert(generation_of(kEpochPeriod - 1) != generation_of(next_epoch(kEpochPeriod - 1)),
              "consecutive epochs across the wrap share a generation");

// Call descriptor region at the end of every generation: one 16-byte vector per source rank.
constexpr uint64_t kDescBytes = uint64_t(kMaxRanks) * 16;
// A call descriptor: what one rank called, as (op, dtype, flags, a, b, c), sent as four words.
// Word 0 carries the tag 0xFD in its top byte and words 1-3 keep bit 31 clear, so none is ever
// kEmptyWord (0x80008000: 0x80 on top, bit 31 set):
//   w0 = 0xFD << 24 | flags << 16 | op << 8 | dtype
//   w1 = a (31 bits)
//   w2 = b (31 bits)
//   w3 = c (23 bits) << 8 | (epoch & 0xFF)
// What the fields hold, by op:
//  * all-reduce kernels (kOpOneShot, kOpTwoShot, kOpOneShotRmsNorm) and the NCCL calls a call
//    check guards (kOpNccl*): a, b = the element count's bits 0..30 and 31..61 (an NCCL
//    call's input elements); c = the fused RMSNorm's row width, or the number of NCCL calls
//    the check covers (the overlap engine's chunks), else 0; flags: kDescFp8Out.
//  * GEMM + collective ops (kOpGemmAr, kOpAgGemm, kOpGemmRs): what every rank must agree on.
//    a = M, the GEMM's rows (ag_gemm: world x the shard's rows); b = N for gemm_ar and
//    gemm_rs (they sum [M, N] partials), 0 for ag_gemm; c = K for ag_gemm (it gathers [m, K]
//    shards), 0 for gemm_ar and gemm_rs. The other dimension is a per-rank shard that may
//    differ (uneven tensor-parallel shards compute correctly and set no peer offset).
//    flags = engine | chunks << 2: kDescEngine*, the pipeline's chunks or pieces modulo 64.
// Fields wider than their bits are compared modulo 2^31 (a, b) or 2^23 (c).
// fusedist/symmetric.py builds (the call checks') and decodes (error messages) them.
struct CallDesc {
  uint32_t op, dtype, flags, a, b, c;
};
constexpr uint32_t kDescFp8Out = 1;
constexpr uint32_t kDescEngineCopyEngine = 1;  // the overlap engine's copy-engine transport
constexpr uint32_t kDescEngineFused = 2;       // the fused kernels (decode gemm_ar, Hopper GEMM)
__host__ __device__ constexpr CallDesc collective_desc(uint32_t op, DType dtype, uint32_t flags,
                                                       uint64_t numel, uint32_t c) {
  return CallDesc{op, uint32_t(dtype), flags, uint32_t(numel & 0x7FFFFFFFu),
                  uint32_t((numel >> 31) & 0x7FFFFFFFu), c};
}
__host__ __device__ constexpr CallDesc gemm_desc(uint32_t op, DType dtype, uint32_t engine,
                                                 uint32_t chunks, uint32_t m, uint32_t n,
                                                 uint32_t k) {
  return CallDesc{op, uint32_t(dtype), (engine & 3u) | (chunks & 63u) << 2, m, n, k};
}
__host__ __device__ constexpr uint32_t desc_word(int k, const CallDesc& d, uint32_t epoch) {
  return k == 0   ? 0xFD000000u | (d.flags & 0xFFu) << 16 | (d.op & 0xFFu) << 8 | (d.dtype & 0xFFu)
         : k == 1 ? d.a & 0x7FFFFFFFu
         : k == 2 ? d.b & 0x7FFFFFFFu
                  : (d.c & 0x7FFFFFu) << 8 | (epoch & 0xFFu);
}
static_assert(desc_word(1, CallDesc{0, 0, 0, kEmptyWord, kEmptyWord, kEmptyWord}, 0) !=
                  kEmptyWord && desc_word(3, CallDesc{0, 0, 0, 0, 0, ~0u}, ~0u) != kEmptyWord,
              "a descriptor word equal to the empty sentinel");

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
// tile gave 0.88-0.94 (block-timed on one H200); auto's tile for those rows.
// swap_1wg: the swap tile with one consumer warpgroup doing the whole 128 x 64 tile, not
// persistent (CUTLASS's KernelTmaWarpSpecialized; the other tiles run two cooperative
// warpgroups on fusedist's persistent scheduler). Plain GEMMs only. Auto's tile for 65-128
// rows: 5-11% faster than the cooperative swap tile at 96-128 rows under load (paced
// back-to-back calls on one H200), 0.92-1.11x cuBLAS.
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
// at 160-256 rows, faster at 320-384; benchmarks/NOTES.md). kSm90RasterAuto: along
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
