// fusedist/ep/config.h -- the expert-parallel buffer's layout and records: plain structs and
// constants that the kernels (low_latency.cuh), the launchers and the bindings share. No
// device code; compiles for the host.
//
// The buffer is a symmetric memory of the comm area (comm/symmetric.cuh, layout.h): kGenerations
// generations, each of `world` slots of slot_bytes plus the call-descriptor region; the epoch
// (Control::epoch) counts every kernel and call check on it, so dispatch, combine and the
// high-throughput path's call checks rotate through the generations together.
//
// Slot s of rank d's generation g (written only by rank s, read only by rank d):
//
//   [0, kEpFlagBytes)            flags: uint32 per block b of rank s's launch = the epoch of
//                                the call once block b's rows (and, block 0, the counts) are
//                                in place. Never cleared: the next call of this generation
//                                writes a newer epoch; the reader waits for its own epoch.
//   [counts_off, + L * 4)        dispatch: rows rank s sends to each of rank d's L local
//                                experts (uint32, the sender's true count, overflow included)
//   [rows_off, + cap_rows * row_bytes)   rows. Dispatch: rank s's (token, slot) pairs routed
//                                to rank d, by local expert, then by pair index t * k + j
//                                (row = the expert's start among rank s's rows for rank d +
//                                the pair's rank within the expert); bf16 [hidden], or with
//                                fp8 e4m3 [hidden] then fp32 scales [hidden / 128].
//                                Combine: the expert outputs rank s (the expert rank) returns
//                                for rank d's (the source's) pairs, each at the row the pair
//                                had in rank d's dispatch slot of rank s; bf16 [hidden].
//
// A generation is written again kGenerations calls later; every kernel waits for every peer's
// flags of its own call, and a rank starts call n + 1 only after its call n read what it
// received, so by then the reader is done with it (docs/design/ep.md, "Protocol").
#pragma once
#include <cstdint>

#include "fusedist/common/common.h"

namespace fusedist {
namespace ep {

constexpr int kEpThreads = 512;        // threads of every low-latency block
constexpr int kEpMaxBlocks = 256;      // flag words per slot: the grid never exceeds it
constexpr int kEpMaxExperts = 1024;    // num_experts (the layout's shared memory)
constexpr int kEpMaxPairs = 16384;     // max_tokens_per_rank * top_k (shared memory)
constexpr int kEpFp8Block = 128;       // elements per FP8 scale
constexpr uint64_t kEpFlagBytes = uint64_t(kEpMaxBlocks) * 4;

// OpCodes of the expert-parallel kernels and calls (ErrorRecord::op, CallDesc::op), after the
// comm area's 1-10 (layout.h OpCode).
constexpr uint32_t kOpEpDispatch = 11;     // low-latency dispatch kernel
constexpr uint32_t kOpEpCombine = 12;      // low-latency combine kernel
constexpr uint32_t kOpEpHtDispatch = 13;   // the call check before a high-throughput dispatch
constexpr uint32_t kOpEpHtCombine = 14;    // ... before a high-throughput combine

// Identical on every rank (the Buffer checks its arguments across ranks at creation): the
// slot layout above and the fixed grid.
struct EpConfig {
  int world = 0, rank = 0;
  int hidden = 0;          // H: elements per token (a multiple of 8; of 128 with fp8)
  int num_experts = 0;     // E
  int local_experts = 0;   // L = E / world; expert e lives on rank e / L
  int top_k = 0;           // k
  int max_tokens = 0;      // tokens a rank may dispatch per call
  int cap_rows = 0;        // rows of a slot
  int fp8 = 0;             // dispatch payload: 0 bf16, 1 e4m3 + fp32 scale per 128
  int blocks = 0;          // the grid of every kernel (<= kEpMaxBlocks, <= max_blocks)
  int smem_bytes = 0;      // dynamic shared memory of the kernels
  uint64_t counts_off = 0, rows_off = 0;
  uint64_t row_bytes = 0;           // stride of a slot's rows (16-byte multiple)
  uint64_t dispatch_row_bytes = 0;  // bytes a dispatched row carries
  uint64_t slot_bytes = 0;
};

// The call descriptor of an expert-parallel kernel or call check (layout.h CallDesc): what
// every rank must agree on.
__host__ __device__ constexpr CallDesc ep_desc(uint32_t op, const EpConfig& c) {
  return CallDesc{op, uint32_t(DType::kBFloat16), uint32_t(c.fp8), uint32_t(c.hidden),
                  uint32_t(c.num_experts) | uint32_t(c.top_k) << 16, uint32_t(c.cap_rows)};
}

// What went wrong with a call's data (not the protocol: that is the ErrorRecord). Host-mapped,
// owned by the Buffer; the first record wins (code is written last), the host clears it after
// raising.
struct EpStatus {
  uint32_t code;      // 0 ok, kEpOverflow, kEpBadId
  int32_t rank;       // the rank that recorded it
  int32_t src;        // kEpOverflow: the sending rank
  int32_t dst;        // kEpOverflow: the receiving rank (the expert's)
  int32_t expert;     // kEpOverflow: the first expert whose rows did not fit; kEpBadId: the id
  uint32_t count;     // kEpOverflow: rows rank src routed to that expert
  uint32_t capacity;  // kEpOverflow: rows of a slot (all of dst's experts, from one source)
  uint32_t total;     // kEpOverflow: rows rank src routed to rank dst
  uint32_t epoch;
  int32_t token;      // kEpBadId: the token
  int32_t slot;       // kEpBadId: its slot
  uint32_t op;        // kOpEpDispatch (only dispatch records)
  uint32_t pad[4];
};
static_assert(sizeof(EpStatus) == 64, "the host reads EpStatus as 16 words");
constexpr uint32_t kEpOverflow = 1;
constexpr uint32_t kEpBadId = 2;

}  // namespace ep
}  // namespace fusedist
