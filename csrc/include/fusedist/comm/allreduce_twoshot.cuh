// fusedist/comm/allreduce_twoshot.cuh -- barrier-free two-shot (reduce-scatter + all-gather).
//
// The input's nvec vectors are cut into `world` chunks of C = ceil(nvec / world) vectors;
// rank j owns chunk j. Per call:
//   1. scatter: for each peer j, push chunk j of my input into slot `rank` of j's buffer.
//   2. reduce:  for my chunk, sum all ranks' shares in fp32, rank order 0..world-1; the
//               rounded (and sanitized) result goes to my output and into the gather region
//               of every peer at the same offsets.
//   3. gather:  for every other chunk, wait for its owner's result in my gather region.
// Each vector is reduced exactly once, by its owner, so all ranks hold bitwise the same
// output. Each rank sends and receives 2 (world-1)/world of the tensor, the bus-bandwidth
// optimum. Readers clear what they read (signals.cuh); no barrier, one launch. Block 0 also
// exchanges the call descriptors (symmetric.cuh).
#pragma once
#include "fusedist/comm/symmetric.cuh"

namespace fusedist {

// kUnroll vectors per thread per step keep that many independent loads in flight (the
// large messages this kernel serves are bandwidth-bound, not latency-bound).
constexpr int kTwoShotUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(512)
    allreduce_twoshot_kernel(const __grid_constant__ SymmView v, const T* __restrict__ in, T* out,
                             int64_t n) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  constexpr int U = kTwoShotUnroll;
  pdl_wait();
  pdl_trigger();
  const uint32_t epoch = begin_epoch(v.ctl, load_epoch(v.ctl));
  const int64_t nvec = (n + kPer - 1) / kPer;
  const int64_t chunk = (nvec + v.world - 1) / v.world;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // The call descriptor (symmetric.cuh): op, dtype, element count.
  const auto desc = [&] {
    return collective_desc(kOpTwoShot, ElemTraits<T>::kDType, 0u, uint64_t(n), 0u);
  };
  send_desc(v, epoch, desc());

  // 1. scatter
#pragma unroll 1
  for (int d = 1; d < v.world; ++d) {
    const int j = (v.rank + d) % v.world;  // stagger so ranks do not all hit one peer first
    Vec16* dst = slot_ptr(v, j, epoch, v.rank);
    const int64_t lim = min(chunk, nvec - j * chunk);
    for (int64_t k0 = first; k0 < lim; k0 += U * stride) {
      Vec16 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = k0 + u * stride;
        if (k < lim) x[u] = sanitize(load_vec_tail(in, j * chunk + k, n));
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = k0 + u * stride;
        if (k < lim) st_volatile(dst + k, x[u]);
      }
    }
  }

  check_desc(v, epoch, desc(), kOpTwoShot);

  // 2. reduce my chunk, broadcast the result
  {
    const int64_t lim = min(chunk, nvec - v.rank * chunk);
    for (int64_t k0 = first; k0 < lim; k0 += U * stride) {
      float acc[U][kPer];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int e = 0; e < kPer; ++e) acc[u][e] = 0.f;
#pragma unroll 1
      for (int s = 0; s < v.world; ++s) {
        Vec16 y[U];
        if (s == v.rank) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int64_t k = k0 + u * stride;
            if (k < lim) y[u] = sanitize(load_vec_tail(in, v.rank * chunk + k, n));
          }
        } else {
          Vec16* mine = slot_ptr(v, v.rank, epoch, s);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int64_t k = k0 + u * stride;
            if (k < lim) y[u] = ld_volatile(mine + k);  // all U loads in flight first
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int64_t k = k0 + u * stride;
            if (k < lim) {
              if (has_empty(y[u])) y[u] = receive(v, mine, k, s, epoch, kOpTwoShot);
              else mine[k] = empty_vec();
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) vec_accumulate<T>(acc[u], y[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = k0 + u * stride;
        if (k >= lim) continue;
        const int64_t i = v.rank * chunk + k;
        const Vec16 r = sanitize(vec_from_floats<T>(acc[u]));
        store_vec_tail(out, i, n, r);
#pragma unroll 1
        for (int d = 1; d < v.world; ++d)
          st_volatile(gather_ptr(v, (v.rank + d) % v.world, epoch) + i, r);
      }
    }
  }

  // 3. gather the other chunks
  Vec16* gather = gather_ptr(v, v.rank, epoch);
#pragma unroll 1
  for (int d = 1; d < v.world; ++d) {
    const int j = (v.rank + d) % v.world;
    const int64_t lim = min(chunk, nvec - j * chunk);
    for (int64_t k0 = first; k0 < lim; k0 += U * stride) {
      Vec16 y[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = k0 + u * stride;
        if (k < lim) y[u] = ld_volatile(gather + j * chunk + k);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = k0 + u * stride;
        if (k >= lim) continue;
        const int64_t i = j * chunk + k;
        if (has_empty(y[u])) y[u] = receive(v, gather, i, j, epoch, kOpTwoShot);
        else gather[i] = empty_vec();
        store_vec_tail(out, i, n, y[u]);
      }
    }
  }
  finish_epoch(v.ctl, v.err, v.timeout_ns, v.rank, epoch, kOpTwoShot);
}

}  // namespace fusedist
