// fusedist/symmetric.cuh -- addressing into a communicator's symmetric buffers (layout.h
// has the layout) and the receive-and-clear step every symmetric kernel uses.
#pragma once
#include <cstdint>

#include "fusedist/layout.h"
#include "fusedist/signals.cuh"

namespace fusedist {

__device__ __forceinline__ Vec16* slot_ptr(const SymmView& v, int owner, uint32_t epoch,
                                           int slot) {
  return reinterpret_cast<Vec16*>(v.base[owner] + (epoch % kGenerations) * v.gen_bytes +
                                  slot * v.slot_bytes);
}
__device__ __forceinline__ Vec16* gather_ptr(const SymmView& v, int owner, uint32_t epoch) {
  return reinterpret_cast<Vec16*>(v.base[owner] + (epoch % kGenerations) * v.gen_bytes +
                                  v.world * v.slot_bytes);
}

__device__ __forceinline__ Vec16 nan_vec() {
  // All-ones is a NaN in fp32, fp16 and bf16: an output that a failed wait poisons.
  return Vec16{{0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}};
}

// Receive vector `i` of `slot` in my own buffer: wait for it, then clear it for reuse.
__device__ __forceinline__ Vec16 receive(const SymmView& v, Vec16* mine, int64_t i, int peer,
                                         uint32_t epoch, uint32_t op) {
  Vec16 y;
  if (!wait_vec(mine + i, y, v.ctl, v.err, v.timeout_ns, v.rank, peer, epoch, op))
    return nan_vec();
  mine[i] = empty_vec();
  return y;
}

}  // namespace fusedist
