// fusedist/signals.cuh -- the "empty word" sentinel that makes symmetric-buffer slots
// self-signalling, the bounded wait built on it, and the per-communicator control block.
//
// Protocol (docs/design/allreduce.md has the full argument):
//  * Every 32-bit word of a receive slot holds kEmptyWord while it is free. A writer never
//    stores kEmptyWord (sanitize() rewrites it), so a reader knows a word has arrived as soon
//    as it differs from kEmptyWord. Words are checked one by one, so a 16-byte store that
//    lands in pieces is still read correctly (each aligned 32-bit word is single-copy atomic).
//  * The reader of a slot -- always the rank that owns the memory -- writes kEmptyWord back
//    after consuming it. No memset and no barrier between calls.
//  * kEmptyWord = 0x80008000 is a pair of -0.0 in fp16/bf16 and a negative fp32 denormal.
//    sanitize() turns it into 0x00008000: (+0.0, -0.0) for 16-bit types, and -4.6e-41 into
//    -0.0 for fp32. Only the sign of a zero (16-bit) or that single denormal (fp32) changes,
//    identically on every rank.
#pragma once
#include <cstdint>

#include "fusedist/layout.h"
#include "fusedist/vec.cuh"

namespace fusedist {


__device__ __forceinline__ uint32_t sanitize_word(uint32_t w) {
  return w == kEmptyWord ? kSanitizedWord : w;
}
__device__ __forceinline__ Vec16 sanitize(Vec16 v) {
#pragma unroll
  for (int k = 0; k < 4; ++k) v.w[k] = sanitize_word(v.w[k]);
  return v;
}
__device__ __forceinline__ bool has_empty(const Vec16& v) {
  return (v.w[0] == kEmptyWord) | (v.w[1] == kEmptyWord) | (v.w[2] == kEmptyWord) |
         (v.w[3] == kEmptyWord);
}
__device__ __forceinline__ Vec16 empty_vec() {
  return Vec16{{kEmptyWord, kEmptyWord, kEmptyWord, kEmptyWord}};
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spin until every word of *p differs from kEmptyWord. Returns false on timeout (after
// recording it) or when the communicator already failed. The clock is read only every 256
// spins, so the fast path is one volatile load and four compares.
__device__ __forceinline__ bool wait_vec(const Vec16* p, Vec16& out, Control* ctl,
                                         ErrorRecord* err, uint64_t timeout_ns, int rank,
                                         int peer, uint32_t epoch, uint32_t op) {
  Vec16 v = ld_volatile(p);
  if (!has_empty(v)) {
    out = v;
    return true;
  }
  uint64_t start = 0;
  for (uint32_t spins = 1;; ++spins) {
    v = ld_volatile(p);
    if (!has_empty(v)) {
      out = v;
      return true;
    }
    if ((spins & 255u) == 0) {
      if (ld_volatile_u32(&ctl->failed)) return false;
      const uint64_t now = globaltimer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > timeout_ns) {
        if (atomicCAS(&ctl->failed, 0u, 1u) == 0u) {
          volatile ErrorRecord* e = err;
          e->rank = rank;
          e->peer = peer;
          e->epoch = epoch;
          e->op = op;
          __threadfence_system();
          e->code = kErrTimeout;
          __threadfence_system();
        }
        return false;
      }
    }
  }
}

// Kernel prologue/epilogue for the epoch rotation. Every block reads the epoch before it
// arrives, and only the last block to arrive advances it, so all blocks of one launch agree.
__device__ __forceinline__ uint32_t read_epoch(Control* ctl) {
  __shared__ uint32_t s_epoch;
  if (threadIdx.x == 0) s_epoch = ld_volatile_u32(&ctl->epoch);
  __syncthreads();
  return s_epoch;
}

// No fence here on purpose: nothing but the epoch read must precede the arrival (it has: the
// value is in shared memory), and the next kernel sees the new epoch through the kernel
// boundary. A __threadfence() would make thread 0 wait for its NVLink stores to be
// acknowledged (sm_90: MEMBAR.GPU drains outstanding remote writes), costing ~1 us a call.
__device__ __forceinline__ void finish_epoch(Control* ctl) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t done = atomicAdd(&ctl->arrive, 1u);
    if (done == gridDim.x - 1) {
      atomicExch(&ctl->arrive, 0u);
      atomicAdd(&ctl->epoch, 1u);
    }
  }
}

}  // namespace fusedist
