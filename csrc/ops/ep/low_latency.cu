// Host launchers of the low-latency expert-parallel kernels (ep/low_latency.cuh): the buffer's
// layout, argument checks, the fixed grid, launch and error check.
#include <algorithm>
#include <string>

#include "fusedist/common/launch.h"
#include "fusedist/ep/api.h"
#include "fusedist/ep/low_latency.cuh"

namespace fusedist {
namespace ep {

namespace {
uint64_t round16(uint64_t x) { return (x + 15) / 16 * 16; }

// Shared memory of both kernels (low_latency.cuh): 5 E + 1 + max_tokens * top_k ints.
int smem_for(int num_experts, int max_tokens, int top_k) {
  return int(round16(uint64_t(5 * num_experts + 1 + max_tokens * top_k) * 4));
}
}  // namespace

std::string ep_why_not(int hidden, int num_experts, int world, int top_k, int max_tokens,
                       bool fp8) {
  if (world < 1 || world > kMaxRanks)
    return "world " + std::to_string(world) + " is outside 1.." + std::to_string(kMaxRanks) +
           " (ranks of one NVLink domain)";
  if (hidden < 8 || hidden % 8)
    return "hidden " + std::to_string(hidden) + " is not a positive multiple of 8 (16-byte rows "
           "of bf16)";
  if (fp8 && hidden % kEpFp8Block)
    return "hidden " + std::to_string(hidden) + " is not a multiple of " +
           std::to_string(kEpFp8Block) + " (one FP8 scale per 128 elements)";
  if (num_experts < 1 || num_experts > kEpMaxExperts)
    return "num_experts " + std::to_string(num_experts) + " is outside 1.." +
           std::to_string(kEpMaxExperts);
  if (num_experts % world)
    return "num_experts " + std::to_string(num_experts) + " is not a multiple of the world " +
           std::to_string(world);
  if (top_k < 1 || top_k > num_experts)
    return "top_k " + std::to_string(top_k) + " is outside 1..num_experts";
  if (max_tokens < 1 || int64_t(max_tokens) * top_k > kEpMaxPairs)
    return "max_tokens_per_rank x top_k = " + std::to_string(int64_t(max_tokens) * top_k) +
           " is outside 1.." + std::to_string(kEpMaxPairs) + " (the layout's shared memory)";
  return "";
}

EpConfig ep_config(int world, int rank, int hidden, int num_experts, int top_k, int max_tokens,
                   int cap_rows, bool fp8, int max_blocks) {
  const std::string why = ep_why_not(hidden, num_experts, world, top_k, max_tokens, fp8);
  FUSEDIST_CHECK_ARG(why.empty(), "ep: " + why);
  FUSEDIST_CHECK_ARG(rank >= 0 && rank < world, "ep: rank outside the world");
  FUSEDIST_CHECK_ARG(cap_rows >= 1, "ep: cap_rows must be >= 1");
  FUSEDIST_CHECK_ARG(max_blocks >= 1, "ep: max_blocks must be >= 1");
  EpConfig c;
  c.world = world;
  c.rank = rank;
  c.hidden = hidden;
  c.num_experts = num_experts;
  c.local_experts = num_experts / world;
  c.top_k = top_k;
  c.max_tokens = max_tokens;
  c.cap_rows = cap_rows;
  c.fp8 = fp8 ? 1 : 0;
  c.blocks = std::min(max_blocks, kEpMaxBlocks);
  c.smem_bytes = smem_for(num_experts, max_tokens, top_k);
  c.counts_off = kEpFlagBytes;
  c.rows_off = c.counts_off + round16(uint64_t(c.local_experts) * 4);
  c.dispatch_row_bytes = round16(fp8 ? uint64_t(hidden) + uint64_t(hidden / kEpFp8Block) * 4
                                     : uint64_t(hidden) * 2);
  c.row_bytes = std::max(c.dispatch_row_bytes, round16(uint64_t(hidden) * 2));
  c.slot_bytes = c.rows_off + uint64_t(cap_rows) * c.row_bytes;
  return c;
}

namespace {
void check_comm(const SymmComm& comm, const EpConfig& c, const char* op) {
  FUSEDIST_CHECK_ARG(comm.view.world == c.world && comm.view.rank == c.rank,
                     std::string(op) + ": the buffer's world or rank is not the communicator's");
  FUSEDIST_CHECK_ARG(comm.view.slot_bytes >= c.slot_bytes,
                     std::string(op) + ": the symmetric slots are smaller than the layout's");
  FUSEDIST_CHECK_ARG(c.blocks >= 1 && c.blocks <= comm.max_blocks,
                     std::string(op) + ": the grid exceeds the SMs the group may fill");
}
}  // namespace

void ep_dispatch(const SymmComm& comm, const EpConfig& c, const EpDispatchArgs& a,
                 uintptr_t stream) {
  check_comm(comm, c, "ep dispatch");
  FUSEDIST_CHECK_ARG(a.tokens >= 0 && a.tokens <= c.max_tokens,
                     "ep dispatch: " + std::to_string(a.tokens) + " tokens, more than the "
                     "buffer's max_tokens_per_rank " + std::to_string(c.max_tokens));
  FUSEDIST_CHECK_ARG(a.recv_x % 16 == 0 && (a.tokens == 0 || a.x % 16 == 0),
                     "ep dispatch: x and recv_x must be 16-byte aligned");
  FUSEDIST_CHECK_ARG(a.recv_counts && a.recv_offsets && a.recv_src && a.status &&
                         (a.tokens == 0 || (a.ids && a.send_pos)),
                     "ep dispatch: a null pointer");
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const EpDispatchParams p{reinterpret_cast<const __nv_bfloat16*>(a.x),
                           reinterpret_cast<const int32_t*>(a.ids), a.tokens,
                           reinterpret_cast<__nv_bfloat16*>(a.recv_x),
                           reinterpret_cast<int32_t*>(a.recv_counts),
                           reinterpret_cast<int32_t*>(a.recv_offsets),
                           reinterpret_cast<int32_t*>(a.recv_src),
                           reinterpret_cast<int32_t*>(a.send_pos),
                           reinterpret_cast<EpStatus*>(a.status)};
  if (c.fp8) {
    blocks_per_sm(reinterpret_cast<const void*>(ep_dispatch_kernel<true>), kEpThreads,
                  c.smem_bytes);
    launch_kernel_smem("ep_dispatch_kernel<fp8>", ep_dispatch_kernel<true>, dim3(c.blocks),
                       dim3(kEpThreads), size_t(c.smem_bytes), s, comm.view, c, p);
  } else {
    blocks_per_sm(reinterpret_cast<const void*>(ep_dispatch_kernel<false>), kEpThreads,
                  c.smem_bytes);
    launch_kernel_smem("ep_dispatch_kernel", ep_dispatch_kernel<false>, dim3(c.blocks),
                       dim3(kEpThreads), size_t(c.smem_bytes), s, comm.view, c, p);
  }
}

void ep_combine(const SymmComm& comm, const EpConfig& c, const EpCombineArgs& a,
                uintptr_t stream) {
  check_comm(comm, c, "ep combine");
  FUSEDIST_CHECK_ARG(a.tokens >= 0 && a.tokens <= c.max_tokens,
                     "ep combine: " + std::to_string(a.tokens) + " tokens, more than the "
                     "buffer's max_tokens_per_rank " + std::to_string(c.max_tokens));
  FUSEDIST_CHECK_ARG(a.y % 16 == 0 && (a.tokens == 0 || a.out % 16 == 0),
                     "ep combine: y and out must be 16-byte aligned");
  FUSEDIST_CHECK_ARG(a.y && a.recv_src && a.recv_offsets &&
                         (a.tokens == 0 || (a.ids && a.weights && a.send_pos && a.out)),
                     "ep combine: a null pointer");
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const EpCombineParams p{reinterpret_cast<const __nv_bfloat16*>(a.y),
                          reinterpret_cast<const int32_t*>(a.ids),
                          reinterpret_cast<const float*>(a.weights),
                          reinterpret_cast<const int32_t*>(a.send_pos),
                          reinterpret_cast<const int32_t*>(a.recv_src),
                          reinterpret_cast<const int32_t*>(a.recv_offsets), a.tokens,
                          reinterpret_cast<__nv_bfloat16*>(a.out)};
  launch_kernel("ep_combine_kernel", ep_combine_kernel, dim3(c.blocks), dim3(kEpThreads), s,
                comm.view, c, p);
}

}  // namespace ep
}  // namespace fusedist
