// fusedist/comm/call_check.cuh -- the call check: a device barrier that carries the calling op's
// call descriptor (layout.h CallDesc), for the paths whose data does not move through the
// sentinel slots: the NCCL calls of a communicator with symmetric memory, and the steps of the
// copy-engine pipelines and the fused Hopper GEMM engines (their data moves by cudaMemcpyAsync).
//
// Protocol, one warp of one block; lane p meets rank p:
//   1. griddepcontrol.wait: everything queued before the check on this stream has completed
//      (stream order where the previous work is not a PDL kernel). Read the epoch.
//   2. Lane p (p != rank) stores this rank's descriptor into descriptor slot `rank` of peer p's
//      current generation (send_desc).
//   3. Lane p waits, bounded, for peer p's descriptor in its own generation, clears it and
//      compares it with its own (check_desc). A difference is recorded as a mismatch, a peer
//      that never comes as a timeout: the communicator fails for good (signals.cuh) and the
//      host raises from check().
//   4. Advance the epoch (finish_epoch).
// A peer stores its descriptor only after everything queued before its check completed, so a
// rank's check completes only after every peer reached the same point of its stream: a barrier
// (the pipelines' ordering) and a call check in one. It uses only the descriptor slots and the
// epoch of the sentinel protocol, so it also meets the symmetric kernels: a rank whose call
// went to a one-shot all-reduce while a peer's went to NCCL compares descriptors with that
// peer's call check, and both report the mismatch.
// A check cannot stop the work queued behind it: the NCCL call (or the copies) after a failed
// check still run. The host learns of the failure from the record in bounded time, and
// Communicator.check() then aborts the communicator's NCCL communicator so that an NCCL kernel
// waiting for a peer that called differently exits (fusedist/communicator.py).
// Cost: one launch and one NVLink round trip (a 16-byte store per peer, a poll, a clear).
#pragma once
#include "fusedist/comm/symmetric.cuh"

namespace fusedist {

constexpr int kCallCheckThreads = 32;  // one warp: lane p meets rank p (kMaxRanks <= 32)
static_assert(kMaxRanks <= kCallCheckThreads, "one lane per rank");

__global__ void __launch_bounds__(kCallCheckThreads)
    call_check_kernel(const __grid_constant__ SymmView v, const CallDesc desc) {
  pdl_wait();
  pdl_trigger();
  const uint32_t epoch = begin_epoch(v.ctl, load_epoch(v.ctl));
  send_desc(v, epoch, desc);
  check_desc(v, epoch, desc, kOpCallCheck);
  finish_epoch(v.ctl, v.err, v.timeout_ns, v.rank, epoch, kOpCallCheck);
}

}  // namespace fusedist
