// fusedist/ep/api.h -- the host API of the expert-parallel launchers (csrc/ops/ep/low_latency.cu):
// the buffer's layout from its sizes, why the kernels cannot take a configuration, and the
// dispatch / combine launches over a symmetric communicator's handle (comm/api.h SymmComm).
// Plain C++: pointers travel as uintptr_t, streams as cudaStream_t.
#pragma once
#include <cstdint>
#include <string>

#include "fusedist/comm/api.h"
#include "fusedist/ep/config.h"

namespace fusedist {
namespace ep {

// Why the low-latency kernels cannot take a buffer of these sizes ("" when they can).
std::string ep_why_not(int hidden, int num_experts, int world, int top_k, int max_tokens,
                       bool fp8);

// The layout of a buffer (config.h): slot sizes and offsets, the grid (at most max_blocks,
// the SMs every rank of the group may fill) and the kernels' shared memory. Throws
// std::invalid_argument with ep_why_not's reason. cap_rows: rows of a slot.
EpConfig ep_config(int world, int rank, int hidden, int num_experts, int top_k, int max_tokens,
                   int cap_rows, bool fp8, int max_blocks);

// One dispatch: x bf16 [tokens, hidden], ids int32 [tokens, top_k]; writes recv_x
// [world * cap_rows, hidden], recv_counts int32 [L], recv_offsets int32 [L + 1], recv_src
// int32 [world * cap_rows], send_pos int32 [tokens * top_k]; data errors into status
// (host-mapped EpStatus).
struct EpDispatchArgs {
  uintptr_t x = 0, ids = 0;
  int tokens = 0;
  uintptr_t recv_x = 0, recv_counts = 0, recv_offsets = 0, recv_src = 0, send_pos = 0;
  uintptr_t status = 0;  // device alias of the host-mapped record
};
void ep_dispatch(const SymmComm& comm, const EpConfig& c, const EpDispatchArgs& a,
                 uintptr_t stream);

// One combine of the dispatch whose ids / send_pos / recv_src / recv_offsets it takes: y bf16
// [world * cap_rows, hidden] in recv_x's row order, weights fp32 [tokens, top_k]; writes out
// bf16 [tokens, hidden].
struct EpCombineArgs {
  uintptr_t y = 0, ids = 0, weights = 0, send_pos = 0, recv_src = 0, recv_offsets = 0;
  int tokens = 0;
  uintptr_t out = 0;
};
void ep_combine(const SymmComm& comm, const EpConfig& c, const EpCombineArgs& a,
                uintptr_t stream);

}  // namespace ep
}  // namespace fusedist
