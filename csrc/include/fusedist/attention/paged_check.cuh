// fusedist/attention/paged_check.cuh -- the paged-metadata check of the plain-torch attention
// paths on CUDA (device tier: raw pointers, no torch).
//
// One warp per sequence row r: its length len = seq_lens[r] must lie in [0, cols * page_size],
// and the block-table entries it reads, columns [0, ceil(len / page_size)), in [0, num_pages).
// The warp writes bad_rows[r] (1 when either fails, else 0; every row is written, so the
// buffer needs no clearing) and records the first failure in err (op_error.h). The torch path
// then reads pages clamped into range and poisons the bad rows' outputs with NaN
// (poison_rows_kernel, below).
#pragma once
#include <cstdint>

#include "fusedist/common/op_error.h"

namespace fusedist {
namespace attention {

struct PagedCheckParams {
  const int* block_table;   // [rows, >= cols] with row stride bt_stride
  const int* seq_lens;      // [rows]
  uint8_t* bad_rows;        // [rows]
  OpErrorRecord* err;
  int rows, cols, bt_stride, page_size, num_pages;
  uint32_t op;
};

__global__ void paged_check_kernel(const PagedCheckParams p) {
  const int r = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= p.rows) return;   // whole warps leave together
  const int len = p.seq_lens[r];
  const int64_t max_len = int64_t(p.cols) * p.page_size;
  bool bad = len < 0 || len > max_len;
  if (bad && lane == 0) record_op_error(p.err, p.op, kOpErrSeqLen, r, -1, len, max_len);
  const int used = bad ? 0 : (len + p.page_size - 1) / p.page_size;
  const int* bt = p.block_table + int64_t(r) * p.bt_stride;
  for (int c0 = 0; c0 < used; c0 += 32) {
    const int c = c0 + lane;
    const int page = c < used ? bt[c] : 0;
    const bool mine = c < used && static_cast<unsigned>(page) >= static_cast<unsigned>(p.num_pages);
    const unsigned any = __ballot_sync(0xffffffffu, mine);
    if (any) {
      if (lane == __ffs(any) - 1 && !bad)
        record_op_error(p.err, p.op, kOpErrPage, r, c, page, p.num_pages);
      bad = true;
    }
  }
  if (lane == 0) p.bad_rows[r] = bad ? 1 : 0;
}

// The poison of the bad rows' outputs, after the torch path wrote them: sequence s's `tokens`
// rows (row t at out + (s * tokens + t) * token_stride bytes, row_words 4-byte words each) are
// filled with nan_word where bad_rows[s] is set. Blocks (s, j) take rows j, j + gridDim.y, ...
// of sequence s; a good sequence's blocks read one byte and leave, so the call costs a launch
// when nothing is bad, not a pass over the output.
struct PoisonRowsParams {
  const uint8_t* bad_rows;  // [seqs]
  char* out;
  int64_t token_stride;     // bytes
  int seqs, tokens, row_words;
  uint32_t nan_word;        // two 16-bit NaNs, or one float32 NaN
};

__global__ void poison_rows_kernel(const PoisonRowsParams p) {
  const int s = blockIdx.x;
  if (!p.bad_rows[s]) return;
  for (int t = blockIdx.y; t < p.tokens; t += gridDim.y) {
    uint32_t* row = reinterpret_cast<uint32_t*>(p.out + (int64_t(s) * p.tokens + t) * p.token_stride);
    for (int i = threadIdx.x; i < p.row_words; i += blockDim.x) row[i] = p.nan_word;
  }
}

}  // namespace attention
}  // namespace fusedist
