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
#include <stdexcept>
#include <string>
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

// launch_kernel_smem with thread-block clusters of cluster_x CTAs along x (grid.x a multiple
// of it; PDL as above). Sizes above 8 are allowed on the kernel first (non-portable sizes:
// 16 on Hopper). Raises when no cluster of this kernel and size fits one GPC (checked once per
// kernel, size, shared-memory size and device).
template <typename... KArgs, typename... Args>
void launch_kernel_cluster(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                           size_t smem_bytes, int cluster_x, cudaStream_t stream,
                           Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = unsigned(cluster_x);
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 2;
  {
    static std::mutex mu;
    static std::map<std::tuple<const void*, int, int, size_t>, int> fits;
    int dev = 0;
    FUSEDIST_CUDA_CHECK(cudaGetDevice(&dev));
    const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), dev, cluster_x,
                                     smem_bytes);
    std::lock_guard<std::mutex> lock(mu);
    auto it = fits.find(key);
    if (it == fits.end()) {
      if (cluster_x > 8)
        FUSEDIST_CUDA_CHECK(cudaFuncSetAttribute(
            kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      int n = 0;
      FUSEDIST_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
      it = fits.emplace(key, n).first;
    }
    if (it->second < 1)
      throw std::runtime_error(std::string("fusedist: ") + name + ": no cluster of " +
                               std::to_string(cluster_x) + " CTAs (" +
                               std::to_string(smem_bytes) + " bytes of shared memory each) "
                               "fits this GPU; plan fewer splits or the workspace merge");
  }
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw_cuda_error(err, name, __FILE__, __LINE__);
  }
}

template <typename... KArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                   cudaStream_t stream, Args&&... args) {
  launch_kernel_smem(name, kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}

}  // namespace fusedist
