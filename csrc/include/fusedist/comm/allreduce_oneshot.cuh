// fusedist/comm/allreduce_oneshot.cuh -- barrier-free one-shot all-reduce.
//
// Protocol: every rank pushes its (sanitized) input into slot `rank` of every peer's current
// generation, then reads the world-1 peer slots of its own buffer, spinning per 32-bit word
// until the data is there (signals.cuh), sums all ranks in fp32 in rank order 0..world-1,
// and clears what it read. Same inputs, same order, same rounding: every rank gets bitwise
// the same output. No flags, no barrier, no memset; one launch per call.
// Block b of every rank handles the same vectors, so block b only waits on the peers' block
// b; the grid never exceeds the SM count, so every block is resident. Block 0 also exchanges
// the call descriptors (symmetric.cuh) that catch ranks calling with another size or dtype.
#pragma once
#include "fusedist/comm/symmetric.cuh"

namespace fusedist {

template <typename T>
__global__ void __launch_bounds__(512)
    allreduce_oneshot_kernel(const __grid_constant__ SymmView v, const T* __restrict__ in, T* out, int64_t n) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int64_t nvec = (n + kPer - 1) / kPer;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  pdl_wait();
  pdl_trigger();
  // The first input load and the epoch load are independent: both in flight at once.
  Vec16 x0 = {{0u, 0u, 0u, 0u}};
  if (first < nvec) x0 = sanitize(load_vec_tail(in, first, n));
  const uint32_t epoch = begin_epoch(v.ctl, load_epoch(v.ctl));
  // The call descriptor (symmetric.cuh): op, dtype, element count.
  const auto desc = [&] {
    return collective_desc(kOpOneShot, ElemTraits<T>::kDType, 0u, uint64_t(n), 0u);
  };
  send_desc(v, epoch, desc());

  for (int64_t i = first; i < nvec; i += stride) {
    const Vec16 x = i == first ? x0 : sanitize(load_vec_tail(in, i, n));
#pragma unroll 1
    for (int p = 0; p < v.world; ++p)
      if (p != v.rank) st_volatile(slot_ptr(v, p, epoch, v.rank) + i, x);
  }
  check_desc(v, epoch, desc(), kOpOneShot);

  for (int64_t i = first; i < nvec; i += stride) {
    float acc[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) acc[k] = 0.f;
#pragma unroll 1
    for (int s = 0; s < v.world; ++s) {
      // My own share comes from registers for the first vector (no reload on the critical
      // path), from L1/L2 for the rest.
      const Vec16 y = (s == v.rank) ? (i == first ? x0 : sanitize(load_vec_tail(in, i, n)))
                                    : receive(v, slot_ptr(v, v.rank, epoch, s), i, s, epoch,
                                              kOpOneShot);
      vec_accumulate<T>(acc, y);
    }
    store_vec_tail(out, i, n, vec_from_floats<T>(acc));
  }
  finish_epoch(v.ctl, v.err, v.timeout_ns, v.rank, epoch, kOpOneShot);
}

}  // namespace fusedist
