// fusedist/common/launch.h -- host-side kernel launch with programmatic dependent launch (PDL).
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
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "fusedist/common/common.h"

namespace fusedist {

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("FUSEDIST_PDL");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

// SMs of the current device. Cached per device (queried once per device and process).
inline int current_device_sm_count() {
  static std::mutex mu;
  static std::map<int, int> cache;
  int dev = 0;
  FUSEDIST_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  int sms = 0;
  FUSEDIST_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return cache[dev] = sms;
}

// Resident blocks per SM of `kernel` at `threads` threads and `smem_bytes` of dynamic shared
// memory on the current device, after raising the kernel's dynamic shared-memory limit to
// at least `smem_bytes`. Cached per (kernel, device): a property of the build and the GPU model, so
// identical on every rank of a homogeneous group.
inline int blocks_per_sm(const void* kernel, int threads, int smem_bytes) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, int>, int> cache;
  int dev = 0;
  FUSEDIST_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(kernel, dev, threads, smem_bytes);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  // Any dynamic size is set explicitly (the default limit is 48 KB minus the kernel's static
  // shared memory), and the limit only ever grows (a smaller request after a larger one must
  // not lower it under a size whose answer is cached and launched with).
  static std::map<std::pair<const void*, int>, int> raised;
  int& limit = raised[std::make_pair(kernel, dev)];
  if (smem_bytes > limit) {
    FUSEDIST_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             smem_bytes));
    limit = smem_bytes;
  }
  int o = 0;
  FUSEDIST_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, kernel, threads, smem_bytes));
  return cache[key] = o < 1 ? 1 : o;
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
  if (err != cudaSuccess) {
    cudaGetLastError();  // the launch error is not sticky: clear it so later checks are clean
    throw_cuda_error(err, name, __FILE__, __LINE__);
  }
}

template <typename... KArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                   cudaStream_t stream, Args&&... args) {
  launch_kernel_smem(name, kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}

}  // namespace fusedist
