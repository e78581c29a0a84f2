// fusedist/common/signals.cuh -- the "empty word" sentinel that makes symmetric-buffer slots
// self-signalling, the bounded wait built on it, and the per-communicator control block.
//
// Protocol (docs/design/allreduce.md has the full argument):
//  * Every 32-bit word of a receive slot holds kEmptyWord while it is free. A writer never
//    stores kEmptyWord (sanitize() rewrites it), so a reader knows a word has arrived as soon
//    as it differs from kEmptyWord. Words are checked one by one, so a 16-byte store that
//    lands in pieces is still read correctly (each aligned 32-bit word is single-copy atomic).
//  * The reader of a slot -- always the rank that owns the memory -- writes kEmptyWord back
//    after consuming it. No memset and no barrier between calls.
//  * kEmptyWord = 0x80008000 is a pair of -0.0 in fp16/bf16 and the fp32 denormal -4.59e-41.
//    sanitize() turns it into 0x00008000: elements (-0.0, +0.0) for 16-bit types (little
//    endian: the low half is the first element), and +4.59e-41 for fp32. Only the sign of a
//    zero (16-bit) or of that single denormal (fp32) changes, identically on every rank.
#pragma once
#include <cstdint>

#include "fusedist/common/layout.h"
#include "fusedist/common/vec.cuh"

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

// Mark the communicator failed and, if this is the first failure, fill the host-visible
// error record (the host reads `code` last, after the fields it describes).
__device__ __forceinline__ void record_timeout(Control* ctl, ErrorRecord* err, int rank,
                                               int peer, uint32_t epoch, uint32_t op) {
  if (atomicCAS(&ctl->failed, 0u, 1u) != 0u) return;
  volatile ErrorRecord* e = err;
  e->rank = rank;
  e->peer = peer;
  e->epoch = epoch;
  e->op = op;
  __threadfence_system();
  e->code = kErrTimeout;
  __threadfence_system();
}

// Mark the communicator failed and, if this is the first failure, record that `peer` made a
// different call than this rank (both descriptors, for the host's message).
__device__ __forceinline__ void record_mismatch(Control* ctl, ErrorRecord* err, int rank,
                                                int peer, uint32_t epoch, uint32_t op,
                                                const Vec16& mine, const Vec16& theirs) {
  if (atomicCAS(&ctl->failed, 0u, 1u) != 0u) return;
  volatile ErrorRecord* e = err;
  e->rank = rank;
  e->peer = peer;
  e->epoch = epoch;
  e->op = op;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    e->mine[k] = mine.w[k];
    e->theirs[k] = theirs.w[k];
  }
  __threadfence_system();
  e->code = kErrMismatch;
  __threadfence_system();
}

// The bounded spin every cross-rank wait uses: poll ready() until it returns true. Every
// kCheckMask + 1 polls, give up if the communicator already failed, or record a timeout
// (naming rank, peer, epoch and op) once timeout_ns passed since the first check. The clock is
// read only then, so the fast path is the poll alone. kSleepNs > 0 sleeps between polls, for
// waits that may last a whole GEMM.
template <uint32_t kCheckMask, uint32_t kSleepNs, typename Ready>
__device__ __forceinline__ bool bounded_spin(Ready&& ready, Control* ctl, ErrorRecord* err,
                                             uint64_t timeout_ns, int rank, int peer,
                                             uint32_t epoch, uint32_t op) {
  if (ready()) return true;
  uint64_t start = 0;
  for (uint32_t spins = 1;; ++spins) {
    if constexpr (kSleepNs > 0) __nanosleep(kSleepNs);
    if (ready()) return true;
    if ((spins & kCheckMask) == 0) {
      if (ld_volatile_u32(&ctl->failed)) return false;
      const uint64_t now = globaltimer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > timeout_ns) {
        record_timeout(ctl, err, rank, peer, epoch, op);
        return false;
      }
    }
  }
}

// Spin until every word of *p differs from kEmptyWord (the value lands in `out`). Returns
// false on timeout (after recording it) or when the communicator already failed; checks the
// clock every 256 polls.
__device__ __forceinline__ bool wait_vec(const Vec16* p, Vec16& out, Control* ctl,
                                         ErrorRecord* err, uint64_t timeout_ns, int rank,
                                         int peer, uint32_t epoch, uint32_t op) {
  return bounded_spin<255u, 0u>(
      [&] {
        out = ld_volatile(p);
        return !has_empty(out);
      },
      ctl, err, timeout_ns, rank, peer, epoch, op);
}

// Programmatic dependent launch (launch.h): wait for the previous grid before touching any
// memory it may write; let the next fusedist kernel get scheduled early.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Epoch rotation. Every block must read the epoch before anyone advances it, and all blocks
// of one launch must agree on it.
//  * begin_epoch: every thread loads the epoch (one L2 line, broadcast within a warp; issued
//    beside the thread's first input load). The barrier's predicate consumes each thread's
//    value, so once it passes the whole block holds the epoch; thread 0 then announces the
//    block with a fire-and-forget add to `arrive`.
//  * finish_epoch: thread 0 of block 0, after its own work, checks that every block arrived
//    (by then they all have: they are resident and arrive first thing), clears the count and
//    advances the epoch. No block waits on a returning atomic, and no fence is needed: the
//    next kernel reads the new epoch after this one completed (pdl_wait or stream order). The
//    epoch counts modulo kEpochPeriod (layout.h), so it never wraps onto the generation it
//    just used. A
//    __threadfence() here would make thread 0 wait for its NVLink stores to be acknowledged
//    (sm_90: MEMBAR.GPU drains outstanding remote writes), about 1 us a call.
__device__ __forceinline__ uint32_t load_epoch(const Control* ctl) {
  return ld_volatile_u32(&ctl->epoch);
}

__device__ __forceinline__ uint32_t begin_epoch(Control* ctl, uint32_t epoch) {
  __syncthreads_or(epoch == 0xFFFFFFFFu);
  if (threadIdx.x == 0 && gridDim.x > 1) atomicAdd(&ctl->arrive, 1u);
  return epoch;
}

__device__ __forceinline__ void finish_epoch(Control* ctl, ErrorRecord* err,
                                             uint64_t timeout_ns, int rank, uint32_t epoch,
                                             uint32_t op) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  if (gridDim.x > 1) {
    uint64_t start = 0;
    for (uint32_t spins = 0; ld_volatile_u32(&ctl->arrive) != gridDim.x; ++spins) {
      if ((spins & 255u) == 255u) {  // resident blocks arrive within microseconds
        const uint64_t now = globaltimer_ns();
        if (start == 0) {
          start = now;
        } else if (now - start > timeout_ns) {
          record_timeout(ctl, err, rank, rank, epoch, op);  // peer == rank: our own blocks
          break;
        }
      }
    }
    ctl->arrive = 0;
  }
  // The only writer: every block read `epoch` before it arrived.
  *reinterpret_cast<volatile uint32_t*>(&ctl->epoch) = next_epoch(epoch);
}

}  // namespace fusedist
