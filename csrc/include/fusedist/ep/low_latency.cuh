// fusedist/ep/low_latency.cuh -- expert-parallel dispatch and combine for decode: each rank
// writes its tokens straight into the owning peers' receive slots over NVLink (symmetric
// memory, the slot layout of ep/config.h), counts and readiness by per-block flags that carry
// the call's epoch, no host synchronization, a fixed grid: one CUDA graph replays any routing.
//
// Dispatch protocol, one launch on every rank (all blocks resident: the grid is the buffer's
// fixed `blocks`, at most the group's SMs or their share):
//   1. Every block: the epoch; block 0 sends its call descriptor to every peer (symmetric.cuh).
//   2. Every block computes the send layout from ids [T, k] alone (shared memory): count per
//      expert, each pair's rank within its expert in pair order t * k + j (warp 0, one
//      __match_any_sync sweep), each expert's start among the rows for its rank. Same input,
//      same layout in every block. Block 0 writes send_pos [T * k] (the pair's row in the
//      slot it went to; the combine reads it), the counts into each peer's slot, and records
//      an id out of range or a slot overflow (EpStatus) -- such pairs are not sent.
//   3. Warp w of the grid copies pairs w, w + warps, ...: the token's row, bf16 or quantized
//      to e4m3 with a fp32 scale per 128 elements on the way, to its row of slot `rank` of the
//      expert's rank (NVLink stores; its own rank's slot too).
//   4. Every thread fences (system scope), the block synchronizes, thread p writes the block's
//      flag (the epoch, a release store) into peer p's slot. Block 0 checks the descriptors.
//   5. Every block waits, bounded, for all world x blocks flags of its own slots, then reads
//      the counts, lays the received rows out by local expert (sources in rank order, each
//      source's rows in pair order), clipped to the slots, and copies (dequantizes) them into
//      recv_x; block 0 writes recv_counts [L] and recv_offsets [L + 1] (recv_offsets[L]: rows
//      in use), recv_src[r] = source * cap_rows + row.
//   6. finish_epoch (signals.cuh).
// Combine protocol, one launch: rows r < recv_offsets[L] of y go back to slot `rank` of their
// source's buffer at the row they came from; fence, flags, descriptor check as above; then
// every rank waits for every peer's flags and forms out[t] = sum over j = 0..k-1 of
// weights[t, j] * y_row(t, j) in fp32, the products and sums rounded one by one (no FMA), in
// slot order, rounded once to bf16: the bits of the single-GPU unpermute reference.
// A wait that times out, or a peer whose descriptor differs, fails the communicator
// (ErrorRecord, signals.cuh); later waits give up at once and the call's outputs are undefined.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "fusedist/comm/symmetric.cuh"
#include "fusedist/ep/config.h"

namespace fusedist {
namespace ep {

struct EpDispatchParams {
  const __nv_bfloat16* x;   // [tokens, hidden]
  const int32_t* ids;       // [tokens, top_k]
  int tokens;
  __nv_bfloat16* recv_x;    // [world * cap_rows, hidden]
  int32_t* recv_counts;     // [L]
  int32_t* recv_offsets;    // [L + 1]
  int32_t* recv_src;        // [world * cap_rows]: source * cap_rows + row
  int32_t* send_pos;        // [tokens * top_k]: the pair's row in its slot, -1 if not sent
  EpStatus* status;         // host-mapped, the Buffer's
};

struct EpCombineParams {
  const __nv_bfloat16* y;        // [world * cap_rows, hidden], rows in recv_x's order
  const int32_t* ids;            // [tokens, top_k] (the dispatch's)
  const float* weights;          // [tokens, top_k]
  const int32_t* send_pos;       // the dispatch's
  const int32_t* recv_src;       // the dispatch's
  const int32_t* recv_offsets;   // the dispatch's
  int tokens;
  __nv_bfloat16* out;            // [tokens, hidden]
};

// ---- memory access -------------------------------------------------------------------------
__device__ __forceinline__ uint8_t* ep_slot(const SymmView& v, int owner, uint32_t epoch,
                                            int slot) {
  return reinterpret_cast<uint8_t*>(slot_ptr(v, owner, epoch, slot));
}

__device__ __forceinline__ uint32_t ld_acquire_u32(const uint32_t* p) {
  uint32_t x;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(x) : "l"(p) : "memory");
  return x;
}
__device__ __forceinline__ void st_release_u32(uint32_t* p, uint32_t x) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(x) : "memory");
}
__device__ __forceinline__ void st_volatile_u32(uint32_t* p, uint32_t x) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(x) : "memory");
}
// The caller's own input (never written during the kernel): the read-only path.
__device__ __forceinline__ Vec16 ld_input(const void* p) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  return Vec16{{u.x, u.y, u.z, u.w}};
}
// Received data, written by peers: past L1 (a line from an earlier call may sit there).
__device__ __forceinline__ Vec16 ld_received(const void* p) {
  Vec16 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_vec(void* p, const Vec16& v) {
  *reinterpret_cast<uint4*>(p) = make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);
}

// ---- FP8 payload (quantize_groups' recipe, fusedist/ops/quantize_rows.py) -------------------
constexpr float kEpE4M3Max = 448.f;
constexpr float kEpMinAmax = 1e-30f;
__device__ __forceinline__ float ep_nan_max(float a, float b) {
  return (a > b || a != a) ? a : b;
}
// max(amax, 1e-30) / 448, 1 for a group of zeros, NaN stays NaN: the bits of the plain-torch
// unit_scale on the CPU (IEEE division).
__device__ __forceinline__ float ep_fp8_scale(float amax) {
  if (amax != amax) return amax;
  if (amax == 0.f) return 1.f;
  return __fdiv_rn(fmaxf(amax, kEpMinAmax), kEpE4M3Max);
}
__device__ __forceinline__ float bf16_at(const Vec16& v, int i) {
  return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(&v)[i]);
}

// ---- shared-memory helpers -----------------------------------------------------------------
// One warp: out[i] = in[0] + ... + in[i - 1] for i < n (in place allowed); returns the total.
__device__ __forceinline__ int warp_exclusive_scan(const int* in, int* out, int n) {
  const int lane = threadIdx.x & 31;
  int carry = 0;
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const int x = i < n ? in[i] : 0;
    int incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (i < n) out[i] = carry + incl - x;
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  return carry;
}

// Record a data error once (block 0 only writes; a record the host has not cleared yet stays).
__device__ __forceinline__ void ep_record(EpStatus* st, int* claim, uint32_t code, int rank,
                                          int src, int dst, int expert, uint32_t count,
                                          uint32_t capacity, uint32_t total, uint32_t epoch,
                                          int token, int slot) {
  if (atomicCAS(claim, 0, 1) != 0) return;
  volatile EpStatus* e = st;
  if (e->code != 0) return;
  e->rank = rank;
  e->src = src;
  e->dst = dst;
  e->expert = expert;
  e->count = count;
  e->capacity = capacity;
  e->total = total;
  e->epoch = epoch;
  e->token = token;
  e->slot = slot;
  e->op = kOpEpDispatch;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// Wait, bounded, until every flag of this rank's slots for the call reads `epoch`: world x
// gridDim.x words, spread over the block's threads. Returns false if any wait gave up.
__device__ __forceinline__ bool ep_wait_flags(const SymmView& v, uint32_t epoch, uint32_t op) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const int n = v.world * int(gridDim.x);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int s = i / int(gridDim.x), b = i % int(gridDim.x);
    const uint32_t* f = reinterpret_cast<const uint32_t*>(ep_slot(v, v.rank, epoch, s)) + b;
    if (!bounded_spin<255u, 0u>([&] { return ld_acquire_u32(f) == epoch; }, v.ctl, v.err,
                                v.timeout_ns, v.rank, s, epoch, op))
      failed = 1;
  }
  __threadfence();
  return !__syncthreads_or(failed);
}

// Every thread's stores are out (system scope) before thread p publishes the block's flag in
// peer p's slot `rank`.
__device__ __forceinline__ void ep_publish(const SymmView& v, uint32_t epoch) {
  __threadfence_system();
  __syncthreads();
  const int p = threadIdx.x;
  if (p < v.world)
    st_release_u32(reinterpret_cast<uint32_t*>(ep_slot(v, p, epoch, v.rank)) + blockIdx.x,
                   epoch);
}

// Shared memory of both kernels, in ints: cnt[E] off[E] pos[max pairs] rcnt[E] soff[E]
// seg[E + 1] (ep_config sizes it).
template <bool kFp8>
__global__ void __launch_bounds__(kEpThreads, 1)
    ep_dispatch_kernel(const __grid_constant__ SymmView v, const __grid_constant__ EpConfig c,
                       const __grid_constant__ EpDispatchParams p) {
  extern __shared__ int smem[];
  __shared__ int claim;
  const int E = c.num_experts, L = c.local_experts, W = v.world, K = c.top_k, H = c.hidden;
  const int P = p.tokens * K, cap = c.cap_rows;
  int* cnt = smem;                         // [E] pairs per expert
  int* off = cnt + E;                      // [E] expert's first row among those for its rank
  int* pos = off + E;                      // [max pairs] the pair's row (-1: not sent)
  int* rcnt = pos + c.max_tokens * K;      // [E] = [W][L] received counts, by source
  int* soff = rcnt + E;                    // [W][L] the expert's first row in source s's slot
  int* seg = soff + E;                     // [L][W] + 1: start of (l, s) in recv_x
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int gwarp = blockIdx.x * warps + warp, gwarps = gridDim.x * warps;

  pdl_wait();
  pdl_trigger();
  const uint32_t epoch = begin_epoch(v.ctl, load_epoch(v.ctl));
  send_desc(v, epoch, ep_desc(kOpEpDispatch, c));

  // ---- 2. the send layout ----
  for (int i = tid; i < E; i += blockDim.x) cnt[i] = 0;
  if (tid == 0) claim = 0;
  __syncthreads();
  if (warp == 0) {
    for (int base = 0; base < P; base += 32) {
      const int q = base + lane;
      int e = -1;
      if (q < P) {
        e = p.ids[q];
        if (e < 0 || e >= E) {
          if (blockIdx.x == 0)
            ep_record(p.status, &claim, kEpBadId, v.rank, v.rank, -1, e, 0, 0, 0, epoch, q / K,
                      q % K);
          e = -1;
        }
      }
      const unsigned same = __match_any_sync(0xffffffffu, e);
      const int before = __popc(same & ((1u << lane) - 1u));
      const int c0 = e >= 0 ? cnt[e] : 0;
      if (q < P) pos[q] = e >= 0 ? c0 + before : -1;
      __syncwarp();
      if (e >= 0 && before == 0) cnt[e] = c0 + __popc(same);
      __syncwarp();
    }
  }
  __syncthreads();
  for (int d = warp; d < W; d += warps) warp_exclusive_scan(cnt + d * L, off + d * L, L);
  __syncthreads();
  for (int q = tid; q < P; q += blockDim.x) {
    const int r = pos[q];
    if (r >= 0) pos[q] = r + off[p.ids[q]];
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int q = tid; q < P; q += blockDim.x) p.send_pos[q] = pos[q];
    for (int i = tid; i < E; i += blockDim.x) {
      const int d = i / L;
      uint32_t* counts =
          reinterpret_cast<uint32_t*>(ep_slot(v, d, epoch, v.rank) + c.counts_off);
      st_volatile_u32(counts + i % L, uint32_t(cnt[i]));
    }
    if (tid < W) {  // a slot overflow, as the sender sees it
      const int d = tid, last = d * L + L - 1;
      const int total = off[last] + cnt[last];
      if (total > cap) {
        int l = 0;
        while (off[d * L + l] + cnt[d * L + l] <= cap) ++l;
        ep_record(p.status, &claim, kEpOverflow, v.rank, v.rank, d, d * L + l,
                  uint32_t(cnt[d * L + l]), uint32_t(cap), uint32_t(total), epoch, -1, -1);
      }
    }
  }

  // ---- 3. the rows ----
  for (int q = gwarp; q < P; q += gwarps) {
    const int row = pos[q];
    if (row < 0 || row >= cap) continue;
    const int d = p.ids[q] / L;
    uint8_t* dst = ep_slot(v, d, epoch, v.rank) + c.rows_off + uint64_t(row) * c.row_bytes;
    const __nv_bfloat16* src = p.x + int64_t(q / K) * H;
    if constexpr (!kFp8) {
      for (int i = lane; i < H / 8; i += 32) st_vec(dst + 16 * i, ld_input(src + 8 * i));
    } else {
      // Two 128-element groups per warp step: lanes 0-15 one, 16-31 the next; a lane holds 8.
      const int groups = H / kEpFp8Block, half = lane >> 4, sub = lane & 15;
      float* scales = reinterpret_cast<float*>(dst + H);
      for (int g0 = 0; g0 < groups; g0 += 2) {
        const int g = g0 + half;
        const bool on = g < groups;
        Vec16 xv = {{0u, 0u, 0u, 0u}};
        if (on) xv = ld_input(src + g * kEpFp8Block + 8 * sub);
        float f[8], amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          f[i] = bf16_at(xv, i);
          amax = ep_nan_max(amax, fabsf(f[i]));
        }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1)
          amax = ep_nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float scale = ep_fp8_scale(amax);
        if (on) {
          uint32_t w[2] = {0u, 0u};
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            float y = __fdiv_rn(f[i], scale);
            if (y == y) y = fminf(fmaxf(y, -kEpE4M3Max), kEpE4M3Max);
            w[i / 4] |= uint32_t(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3))
                        << (8 * (i % 4));
          }
          *reinterpret_cast<uint2*>(dst + g * kEpFp8Block + 8 * sub) = make_uint2(w[0], w[1]);
          if (sub == 0) scales[g] = scale;
        }
      }
    }
  }

  // ---- 4. publish, check the descriptors ----
  ep_publish(v, epoch);
  check_desc(v, epoch, ep_desc(kOpEpDispatch, c), kOpEpDispatch);

  // ---- 5. receive ----
  if (ep_wait_flags(v, epoch, kOpEpDispatch)) {
    for (int i = tid; i < E; i += blockDim.x) {
      const int s = i / L;
      const uint32_t* counts =
          reinterpret_cast<const uint32_t*>(ep_slot(v, v.rank, epoch, s) + c.counts_off);
      // At most cap + 1: a count past the slot is an overflow either way, and a word that a
      // mismatched peer never wrote (a failed call) cannot send the copies past the slot.
      rcnt[i] = int(min(ld_volatile_u32(counts + i % L), uint32_t(cap) + 1u));
    }
    __syncthreads();
    for (int s = warp; s < W; s += warps) warp_exclusive_scan(rcnt + s * L, soff + s * L, L);
    __syncthreads();
    // Rows of (l, s) that fit the slot, laid out l-major: seg[l * W + s].
    for (int i = tid; i < E; i += blockDim.x) {
      const int l = i / W, s = i % W;
      const int first = soff[s * L + l], n = rcnt[s * L + l];
      seg[i] = max(0, min(first + n, cap) - first);
    }
    __syncthreads();
    if (warp == 0) {
      const int total = warp_exclusive_scan(seg, seg, E);
      if (lane == 0) seg[E] = total;
    }
    __syncthreads();
    if (blockIdx.x == 0) {
      for (int l = tid; l <= L; l += blockDim.x) {
        const int start = l < L ? seg[l * W] : seg[E];
        p.recv_offsets[l] = start;
        if (l < L) p.recv_counts[l] = (l + 1 < L ? seg[(l + 1) * W] : seg[E]) - start;
      }
      if (tid < W) {  // a slot overflow, as the receiver sees it
        const int s = tid, last = s * L + L - 1;
        const int total = soff[last] + rcnt[last];
        if (total > cap) {
          int l = 0;
          while (soff[s * L + l] + rcnt[s * L + l] <= cap) ++l;
          ep_record(p.status, &claim, kEpOverflow, v.rank, s, v.rank, v.rank * L + l,
                    uint32_t(rcnt[s * L + l]), uint32_t(cap), uint32_t(total), epoch, -1, -1);
        }
      }
    }
    const int total = seg[E];
    for (int r = gwarp; r < total; r += gwarps) {
      int lo = 0, hi = E;  // the last segment starting at or before r (it holds r)
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (seg[mid] <= r) lo = mid; else hi = mid;
      }
      const int l = lo / W, s = lo % W;
      const int row = soff[s * L + l] + (r - seg[lo]);
      const uint8_t* src = ep_slot(v, v.rank, epoch, s) + c.rows_off + uint64_t(row) * c.row_bytes;
      __nv_bfloat16* dst = p.recv_x + int64_t(r) * H;
      if constexpr (!kFp8) {
        for (int i = lane; i < H / 8; i += 32) st_vec(dst + 8 * i, ld_received(src + 16 * i));
      } else {
        const float* scales = reinterpret_cast<const float*>(src + H);
        for (int i = lane; i < H / 8; i += 32) {  // 8 e4m3 of one group -> one bf16 vector
          uint2 q;
          asm volatile("ld.global.cg.v2.u32 {%0,%1}, [%2];" : "=r"(q.x), "=r"(q.y)
                       : "l"(src + 8 * i) : "memory");
          float scale;
          asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(scale)
                       : "l"(scales + (8 * i) / kEpFp8Block) : "memory");
          Vec16 out;
          __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const uint32_t b = ((e < 4 ? q.x : q.y) >> (8 * (e % 4))) & 0xFFu;
            const __half_raw h =
                __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
            o[e] = __float2bfloat16_rn(__fmul_rn(__half2float(__half(h)), scale));
          }
          st_vec(dst + 8 * i, out);
        }
      }
      if (lane == 0) p.recv_src[r] = s * cap + row;
    }
  }
  finish_epoch(v.ctl, v.err, v.timeout_ns, v.rank, epoch, kOpEpDispatch);
}

__global__ void __launch_bounds__(kEpThreads, 1)
    ep_combine_kernel(const __grid_constant__ SymmView v, const __grid_constant__ EpConfig c,
                      const __grid_constant__ EpCombineParams p) {
  const int E = c.num_experts, L = c.local_experts, K = c.top_k, H = c.hidden;
  const int cap = c.cap_rows;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int gwarp = blockIdx.x * warps + warp, gwarps = gridDim.x * warps;

  pdl_wait();
  pdl_trigger();
  const uint32_t epoch = begin_epoch(v.ctl, load_epoch(v.ctl));
  send_desc(v, epoch, ep_desc(kOpEpCombine, c));

  // The expert outputs go back to the rows their tokens came from.
  const int rows = p.recv_offsets[L];
  for (int r = gwarp; r < rows; r += gwarps) {
    const int from = p.recv_src[r], s = from / cap, row = from % cap;
    uint8_t* dst = ep_slot(v, s, epoch, v.rank) + c.rows_off + uint64_t(row) * c.row_bytes;
    const __nv_bfloat16* src = p.y + int64_t(r) * H;
    for (int i = lane; i < H / 8; i += 32) st_vec(dst + 16 * i, ld_input(src + 8 * i));
  }
  ep_publish(v, epoch);
  check_desc(v, epoch, ep_desc(kOpEpCombine, c), kOpEpCombine);

  if (ep_wait_flags(v, epoch, kOpEpCombine)) {
    // out[t] = sum_j w[t, j] * y(t, j): slot order, fp32, every product and sum rounded alone.
    const int nvec = H / 8;
    const int64_t items = int64_t(p.tokens) * nvec;
    for (int64_t it = int64_t(blockIdx.x) * blockDim.x + tid; it < items;
         it += int64_t(gridDim.x) * blockDim.x) {
      const int t = int(it / nvec), cv = int(it % nvec);
      float acc[8];
      bool first = true;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
      for (int j = 0; j < K; ++j) {
        const int q = t * K + j;
        const int ex = p.ids[q], row = p.send_pos[q];
        if (ex < 0 || ex >= E || row < 0 || row >= cap) continue;
        const float w = p.weights[q];
        const uint8_t* src = ep_slot(v, v.rank, epoch, ex / L) + c.rows_off +
                             uint64_t(row) * c.row_bytes + 16 * cv;
        const Vec16 yv = ld_received(src);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float prod = __fmul_rn(w, bf16_at(yv, e));
          acc[e] = first ? prod : __fadd_rn(acc[e], prod);
        }
        first = false;
      }
      Vec16 out;
      __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = __float2bfloat16_rn(acc[e]);
      st_vec(p.out + int64_t(t) * H + 8 * cv, out);
    }
  }
  finish_epoch(v.ctl, v.err, v.timeout_ns, v.rank, epoch, kOpEpCombine);
}

}  // namespace ep
}  // namespace fusedist
