// fusedist/launch.h -- host-side kernel launch with programmatic dependent launch (PDL).
//
// sm_90: a kernel launched with programmatic stream serialization may be scheduled while the
// previous kernel on the stream is still running, once every block of that kernel executed
// griddepcontrol.launch_dependents. fusedist kernels begin with pdl_wait() (griddepcontrol.wait:
// returns when the previous grid has completed and its memory is visible), so they read
// nothing early; what PDL hides is the launch latency. Only kernels launched with the
// attribute start early, so a torch kernel that follows ours is never affected.
// FUSEDIST_PDL=0 turns it off.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "fusedist/common.h"

namespace fusedist {

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("FUSEDIST_PDL");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

template <typename... KArgs, typename... Args>
void launch_kernel_smem(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                        size_t smem_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) throw_cuda_error(err, name, __FILE__, __LINE__);
}

template <typename... KArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                   cudaStream_t stream, Args&&... args) {
  launch_kernel_smem(name, kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}

}  // namespace fusedist
