// Launcher of the paged-metadata check (csrc/include/fusedist/attention/paged_check.cuh).
#include <string>

#include "fusedist/attention/api.h"
#include "fusedist/attention/paged_check.cuh"
#include "fusedist/common/launch.h"

namespace fusedist {

void paged_check(const PagedCheckArgs& a, uintptr_t stream) {
  const std::string w = "paged_check: ";
  FUSEDIST_CHECK_ARG(a.rows >= 0 && a.cols >= 0 && a.cols <= a.bt_stride,
                     w + "need rows >= 0 and 0 <= cols <= bt_stride");
  FUSEDIST_CHECK_ARG(a.page_size > 0 && a.num_pages > 0,
                     w + "page_size and num_pages must be > 0");
  FUSEDIST_CHECK_ARG(a.op == kOpErrDecode || a.op == kOpErrPrefill,
                     w + "op must be the decode or prefill code");
  FUSEDIST_CHECK_ARG(a.block_table && a.seq_lens && a.bad_rows,
                     w + "block_table, seq_lens and bad_rows must be non-null");
  if (a.rows == 0) return;
  attention::PagedCheckParams p{};
  p.block_table = reinterpret_cast<const int*>(a.block_table);
  p.seq_lens = reinterpret_cast<const int*>(a.seq_lens);
  p.bad_rows = reinterpret_cast<uint8_t*>(a.bad_rows);
  p.err = reinterpret_cast<OpErrorRecord*>(a.err);
  p.rows = a.rows, p.cols = a.cols, p.bt_stride = a.bt_stride;
  p.page_size = a.page_size, p.num_pages = a.num_pages, p.op = a.op;
  constexpr int kWarps = 4;
  const dim3 grid((a.rows + kWarps - 1) / kWarps);
  attention::paged_check_kernel<<<grid, kWarps * 32, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  FUSEDIST_LAUNCH_CHECK("paged_check_kernel");
}

void poison_rows(const PoisonRowsArgs& a, uintptr_t stream) {
  const std::string w = "poison_rows: ";
  FUSEDIST_CHECK_ARG(a.seqs >= 0 && a.tokens >= 0, w + "need seqs >= 0 and tokens >= 0");
  FUSEDIST_CHECK_ARG(a.elem_bytes == 2 || a.elem_bytes == 4, w + "elem_bytes must be 2 or 4");
  FUSEDIST_CHECK_ARG(a.row_bytes > 0 && a.row_bytes % 4 == 0 && a.row_bytes / 4 <= 0x7fffffff,
                     w + "row_bytes must be a positive multiple of 4");
  FUSEDIST_CHECK_ARG(a.token_stride >= a.row_bytes && a.token_stride % 4 == 0 && a.out % 4 == 0,
                     w + "rows must be 4-byte aligned and not overlap (token_stride >= row_bytes)");
  FUSEDIST_CHECK_ARG(a.bad_rows && a.out, w + "bad_rows and out must be non-null");
  if (a.seqs == 0 || a.tokens == 0) return;
  attention::PoisonRowsParams p{};
  p.bad_rows = reinterpret_cast<const uint8_t*>(a.bad_rows);
  p.out = reinterpret_cast<char*>(a.out);
  p.token_stride = a.token_stride;
  p.seqs = a.seqs, p.tokens = a.tokens, p.row_words = int(a.row_bytes / 4);
  p.nan_word = a.elem_bytes == 2 ? (a.nan_bits & 0xffffu) * 0x10001u : a.nan_bits;
  const dim3 grid(unsigned(a.seqs), unsigned(a.tokens < 16 ? a.tokens : 16));
  attention::poison_rows_kernel<<<grid, 128, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  FUSEDIST_LAUNCH_CHECK("poison_rows_kernel");
}

}  // namespace fusedist
