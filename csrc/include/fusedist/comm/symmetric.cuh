// fusedist/comm/symmetric.cuh -- addressing into a communicator's symmetric buffers (layout.h
// has the layout), the receive-and-clear step every symmetric kernel uses, and the call
// descriptor exchange that detects ranks calling different collectives.
#pragma once
#include <cstdint>

#include "fusedist/common/layout.h"
#include "fusedist/common/signals.cuh"

namespace fusedist {

__device__ __forceinline__ Vec16* slot_ptr(const SymmView& v, int owner, uint32_t epoch,
                                           int slot) {
  return reinterpret_cast<Vec16*>(v.base[owner] + generation_of(epoch) * v.gen_bytes +
                                  slot * v.slot_bytes);
}
__device__ __forceinline__ Vec16* gather_ptr(const SymmView& v, int owner, uint32_t epoch) {
  return reinterpret_cast<Vec16*>(v.base[owner] + generation_of(epoch) * v.gen_bytes +
                                  v.world * v.slot_bytes);
}
// Descriptor `src` (what rank src called) in owner's generation: the last kDescBytes of it.
__device__ __forceinline__ Vec16* desc_ptr(const SymmView& v, int owner, uint32_t epoch,
                                           int src) {
  return reinterpret_cast<Vec16*>(v.base[owner] + generation_of(epoch) * v.gen_bytes +
                                  v.gen_bytes - kDescBytes) + src;
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

// Call descriptors: every symmetric kernel tells each peer what it called (layout.h CallDesc:
// op, dtype and the sizes every rank must agree on, plus the low bits of the epoch), so that
// ranks that call different collectives get a CollectiveMismatchError naming both calls instead
// of a wrong sum, a write past a peer's data, or a hang.
//  * send_desc: lane p of block 0 stores my descriptor into descriptor slot `rank` of peer p's
//    current generation, first thing after the epoch is known (before the data, so it arrives
//    no later than the data the peer waits for anyway).
//  * check_desc: after this rank's own pushes, lane p of block 0 waits for peer p's
//    descriptor, clears it (the reader clears, as for data) and compares. A difference marks
//    the communicator failed (record_mismatch): every wait of this rank gives up at its next
//    clock check (bounded_spin) and leaves NaN, and the host raises from check(). The peer
//    sees the same difference from its side. (The fused RMSNorm's widest FP8 rows check
//    after their rows instead: allreduce_rmsnorm.cuh says why.)
// Whatever a rank pushed before its check stays inside its own slot of the peer's generation
// (sized by the communicator, the same on every rank: checked at creation), so a mismatched
// call never writes into another rank's slot, the descriptors or past the buffer; the failed
// communicator is never used again, so what it left there does not matter.
// Cost per call: one 16-byte NVLink store per peer and one local 16-byte load, store and
// compare per peer, all in block 0's first warp; its wait overlaps the wait for the data the
// same warp receives next. The other warps and blocks are untouched.
__device__ __forceinline__ Vec16 call_desc(const CallDesc& d, uint32_t epoch) {
  Vec16 w;
#pragma unroll
  for (int k = 0; k < 4; ++k) w.w[k] = desc_word(k, d, epoch);
  return w;
}

// Callers build the CallDesc where it is used (in the lanes that use it) from the call's
// arguments, rather than keep it in registers across the data loops.
__device__ __forceinline__ void send_desc(const SymmView& v, uint32_t epoch, const CallDesc& d) {
  const int p = int(threadIdx.x);
  if (blockIdx.x == 0 && p < v.world && p != v.rank)
    st_volatile(desc_ptr(v, p, epoch, v.rank), call_desc(d, epoch));
}

template <bool kInline = true>
__device__ __forceinline__ void check_desc(const SymmView& v, uint32_t epoch, const CallDesc& d,
                                           uint32_t kernel_op);

static __device__ __noinline__ void check_desc_call(const SymmView& v, uint32_t epoch,
                                                    CallDesc d, uint32_t kernel_op) {
  check_desc<true>(v, epoch, d, kernel_op);
}

// Wait for peer p's descriptor (lane p of block 0), clear it, compare; a timeout or a mismatch
// is recorded as `kernel_op`'s (the running kernel's OpCode, for the message). kInline = false:
// the check as a call, for kernels at their register limit.
template <bool kInline>
__device__ __forceinline__ void check_desc(const SymmView& v, uint32_t epoch, const CallDesc& d,
                                           uint32_t kernel_op) {
  const int p = int(threadIdx.x);
  if (blockIdx.x != 0 || p >= v.world || p == v.rank) return;
  if constexpr (!kInline) {
    check_desc_call(v, epoch, d, kernel_op);
    return;
  }
  Vec16* slot = desc_ptr(v, v.rank, epoch, p);
  Vec16 theirs;
  if (!wait_vec(slot, theirs, v.ctl, v.err, v.timeout_ns, v.rank, p, epoch, kernel_op))
    return;
  *slot = empty_vec();
  const Vec16 mine = call_desc(d, epoch);
  if ((theirs.w[0] != mine.w[0]) | (theirs.w[1] != mine.w[1]) | (theirs.w[2] != mine.w[2]) |
      (theirs.w[3] != mine.w[3]))
    record_mismatch(v.ctl, v.err, v.rank, p, epoch, kernel_op, mine, theirs);
}

}  // namespace fusedist
