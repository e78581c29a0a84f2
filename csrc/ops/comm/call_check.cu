// Host launcher of the call check (call_check.cuh): one warp, on the caller's stream.
#include "fusedist/comm/api.h"
#include "fusedist/comm/call_check.cuh"
#include "fusedist/common/launch.h"

namespace fusedist {

void call_check(const SymmComm& comm, const CallDesc& desc, uintptr_t stream) {
  FUSEDIST_CHECK_ARG(desc.op >= 1 && desc.op <= 0xFF && desc.dtype <= 0xFF && desc.flags <= 0xFF,
                     "call_check: op, dtype and flags must fit a byte (op >= 1)");
  launch_kernel("call_check_kernel", call_check_kernel, 1, kCallCheckThreads,
                reinterpret_cast<cudaStream_t>(stream), comm.view, desc);
}

}  // namespace fusedist
