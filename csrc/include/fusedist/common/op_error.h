// fusedist/common/op_error.h -- the sticky input-error record of the single-GPU ops (device tier and
// host layout; no torch).
//
// A kernel that meets metadata it must not follow (a page id outside the cache, a sequence
// longer than its block-table row, a slot or position outside the cache or the RoPE table, an
// expert id or a permuted-row index out of range)
// never touches memory outside its tensors: it substitutes a safe value, poisons the outputs
// that depend on the bad value (NaN), and records the first such event here. The record lives
// in host-mapped memory, one per device, allocated once (fusedist/ops/device_errors.py): the
// host reads it without a copy at the next check (any later fusedist op on the device,
// fusedist.check_device_errors(), the runner after each step) and raises a FusedistError
// naming the op, the row and the value. First error wins; the record stays set until cleared.
//
// Layout (40 bytes, mirrored in fusedist/ops/device_errors.py):
//   u32 state   0 clear, 2 being written, 1 complete (the host reads the fields only at 1)
//   u32 op      OpErrorOp
//   u32 what    OpErrorWhat
//   i32 row     batch row (decode, prefill), token (rope_append, MoE sort / unpermute) or
//               permuted row (MoE permute)
//   i64 value   the bad value
//   i64 limit   the valid range: [0, limit) (a length: [0, limit])
//   i32 index   e.g. the block-table column; -1 when none
//   u32 pad
#pragma once
#include <cstdint>

namespace fusedist {

enum OpErrorOp : uint32_t {
  kOpErrDecode = 1,
  kOpErrRopeAppend = 2,
  kOpErrPrefill = 3,
  kOpErrMoeSort = 4,       // moe/gating.cuh: sort_by_expert
  kOpErrMoePermute = 5,    // moe/permute.cuh
  kOpErrMoeUnpermute = 6,  // moe/permute.cuh
};
enum OpErrorWhat : uint32_t {
  kOpErrPage = 1,      // a block-table entry outside [0, num_pages)
  kOpErrSeqLen = 2,    // a sequence length outside [0, block-table columns * page_size]
  kOpErrSlot = 3,      // a slot_mapping entry >= num_pages * page_size
  kOpErrPosition = 4,  // a position outside [0, max_position)
  kOpErrQuerySpan = 5, // a prefill query span (cu_seqlens_q) outside [0, seq_len] or the tokens
  kOpErrExpertId = 6,  // an expert id outside [0, num_experts) (row: token, index: slot)
  kOpErrRowIndex = 7,  // a MoE layout index outside its range: src_index (row: permuted row) or
                       // dest_index (row: token, index: slot)
};

struct OpErrorRecord {
  uint32_t state;
  uint32_t op;
  uint32_t what;
  int32_t row;
  int64_t value;
  int64_t limit;
  int32_t index;
  uint32_t pad;
};
static_assert(sizeof(OpErrorRecord) == 40, "OpErrorRecord: keep the Python mirror in sync");

#ifdef __CUDACC__
// Record (op, what, row, index, value, limit) unless an earlier error holds the record.
__device__ __forceinline__ void record_op_error(OpErrorRecord* rec, uint32_t op, uint32_t what,
                                                int row, int index, int64_t value,
                                                int64_t limit) {
  if (rec == nullptr) return;
  if (atomicCAS(&rec->state, 0u, 2u) != 0u) return;
  volatile OpErrorRecord* r = rec;
  r->op = op, r->what = what, r->row = row, r->index = index;
  r->value = value, r->limit = limit;
  __threadfence_system();
  atomicExch(&rec->state, 1u);
}
#endif

}  // namespace fusedist
