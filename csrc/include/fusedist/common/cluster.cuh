// fusedist/common/cluster.cuh -- thread-block clusters (sm_90): the cluster barrier and reads
// of another CTA's shared memory (distributed shared memory).
//
// A kernel launched with a cluster dimension (launch.h: launch_kernel_cluster) may read the
// shared memory of every CTA of its cluster: cluster_map() turns a shared-memory address of
// this CTA into the same offset in CTA `rank`'s shared memory, and ld_cluster_* read it.
// cluster_sync() is a barrier of every thread of every CTA of the cluster with release /
// acquire semantics: shared-memory writes before it are visible to every CTA's reads after
// it. A CTA whose shared memory others read must not exit before they are done: end with a
// cluster_sync() after the last remote read. All threads of each CTA call cluster_sync()
// (the instructions are .aligned: warp-uniform control flow).
#pragma once
#include <cstdint>

namespace fusedist {

__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n\t"
      "barrier.cluster.wait.acquire.aligned;" ::
          : "memory");
}

__device__ __forceinline__ uint32_t cluster_map(uint32_t smem_byte_addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_byte_addr), "r"(rank));
  return r;
}

__device__ __forceinline__ float ld_cluster_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ float4 ld_cluster_f32x4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

}  // namespace fusedist
