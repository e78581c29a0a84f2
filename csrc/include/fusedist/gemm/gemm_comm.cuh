// fusedist/gemm/gemm_comm.cuh -- decode-sized GEMM + all-reduce in one kernel (gemm_ar, M <= 128).
//
// out[M, N] = sum over ranks r of x_r[M, K] @ w_r[K, N] (+ bias): the row-parallel linear of a
// decode step. With M this small the GEMM is bound by reading w once from HBM, so the kernel
// streams w at full bandwidth and hides the all-reduce behind the stream:
//  * Block b owns the 64-column strips t = b, b + grid, ... of the output. It streams strip t
//    of w through a kStages-deep ring of 64 x 64 tiles that the copy engine (TMA) loads with
//    the matching x tile. A producer warp issues the copies and waits only on "empty"
//    mbarriers; the consumer warps wait on "full" ones, multiply on tensor cores (mma.sync
//    m16n8k16, fp32 accumulators) and release the stage, so no block-wide barrier sits on the
//    streaming path. Consumer warps split K (small M) or M (larger M); a shared-memory pass
//    sums the K-split partials.
//  * The first stages of w are requested before griddepcontrol.wait: weights never depend on
//    the previous kernel, so under PDL (launch.h) their loads overlap that kernel's tail.
//  * Exchange (world > 1): the strip is rounded to T -- what an unfused GEMM hands its
//    all-reduce -- and pushed into slot `rank` of every peer's current generation exactly as
//    the one-shot all-reduce does (signals.cuh: self-signalling slots, no flags, no fence).
//    The block then reads its peers' copies of the same strip from its own buffer, sums all
//    ranks in fp32 in rank order 0..world-1, adds the bias, rounds once and stores. Same values
//    in the same order everywhere: the output is bitwise identical on every rank.
//  * Strip t is computed by block t % grid on every rank (same grid everywhere, derived from
//    the group-wide SM minimum) and the grid never exceeds what is resident, so a block only
//    waits for peers' blocks that are running. Strips finish at different times, so most of
//    the exchange runs while other blocks still stream weights.
//  * Call check: lane p of block 0 sends this call's descriptor (gemm_ar, dtype, M, N: what
//    sets the peers' offsets and the grid; K is each rank's own shard) to peer p once the epoch
//    is known, and checks peer p's after pushing its first strip, before it waits for any data
//    (symmetric.cuh send_desc / check_desc). A peer that called with another M, N or dtype, or
//    another op, fails the communicator with a mismatch: every wait gives up within 256 polls
//    and leaves NaN, instead of summing misplaced strips or waiting out the timeout. A strip
//    pushed before the check stays within this rank's slot of the peer's generation (M x N
//    fits the slot: checked by the launcher). The check is a call (check_desc<false>): inlined,
//    it raised the kernel's registers by up to 24 (ptxas -v), as a call by 2-4.
// world == 1 skips the exchange: a plain skinny GEMM (the no-communication baseline).
//
// Layouts: x [M, K] with row stride ldx; w, described by a 2-D tensor map (gemm_comm.cu), either
// [K, N] (kWeightNK = false) or [N, K] (kWeightNK = true: an nn.Linear weight used as
// weight.t()); out [M, N] contiguous. K, N and the row strides are multiples of 8.
// Contract: w is not written by the kernel launched just before this one on the stream
// (it is prefetched before griddepcontrol.wait); weights of an inference model never are.
#pragma once
#include "fusedist/gemm/chunk_wait.cuh"  // wait_geq (counter_wait_kernel)
#include "fusedist/common/mma.cuh"  // also the TMA / mbarrier helpers
#include "fusedist/comm/symmetric.cuh"

namespace fusedist {

constexpr int kGemmArBN = 64;  // output columns per strip
constexpr int kGemmArBK = 64;  // K per pipeline stage (one 128-byte smem row of T)

// kWarps consumer warps: kWM along M (kMT m16 tiles each), kWK = kWarps / kWM splitting each
// stage's four k16 steps; plus one producer warp that only issues copies. Deep rings for small
// M: a memory-bound kernel needs bytes in flight.
// Shared memory (offsets from a 1024-byte aligned base):
//   [0, S * 8 KB)          weight ring: stage s = the 64 x 64 tile of w (TMA, 128-byte swizzle)
//   then S * kABytes       x ring: stage s = kMPad rows x 64 of x (TMA; rows >= M read as 0)
//   then kRedBytes         fp32 partials of the kWK K-split warps, [kWK][kMPad][64 + 4]
//   then 2 S mbarriers     full[s] "stage s landed", empty[s] "every consumer warp is done"
template <int kMT, int kWM, int kWarps>
struct GemmArTile {
  static constexpr int kConsumers = 32 * kWarps;
  static constexpr int kThreads = kConsumers + 32;  // + the producer warp
  static constexpr int kWK = kWarps / kWM;
  static_assert(kWK >= 1 && kWK <= 4, "a stage has four k16 steps");
  static constexpr int kMPad = 16 * kMT * kWM;
  static constexpr int kStages = kMPad <= 16 ? 16 : kMPad <= 32 ? 12 : kMPad <= 64 ? 8 : 6;
  static constexpr int kBBytes = kGemmArBK * 128;
  static constexpr int kABytes = kMPad * 128;
  static constexpr int kRedStride = kGemmArBN + 4;  // floats per partial row (bank stagger)
  static constexpr int kRedBytes = kWK * kMPad * kRedStride * 4;
  static constexpr int kAOffset = kStages * kBBytes;
  static constexpr int kRedOffset = kAOffset + kStages * kABytes;
  static constexpr int kBarOffset = kRedOffset + kRedBytes;
  static constexpr int kSmemBytes = kBarOffset + 2 * kStages * 8 + 1024;  // + base alignment
  static_assert(kSmemBytes <= 227 * 1024, "fits one SM's shared memory");
};

template <typename T, int kMT, int kWM, int kWarps, bool kWeightNK>
__global__ void __launch_bounds__(32 * kWarps + 32, 1)
    gemm_ar_kernel(const __grid_constant__ SymmView v,
                   const __grid_constant__ CUtensorMap wmap,
                   const __grid_constant__ CUtensorMap xmap, const T* __restrict__ bias, T* out,
                   int M, int N, int K) {
  using Cfg = GemmArTile<kMT, kWM, kWarps>;
  constexpr int S = Cfg::kStages;
  constexpr int kPer = ElemTraits<T>::kPerVec;  // 8
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  uint8_t* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const uint32_t base = smem_addr(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int strips = (N + kGemmArBN - 1) / kGemmArBN;
  const int KT = (K + kGemmArBK - 1) / kGemmArBK;
  const bool exchange = v.world > 1;

  auto b_stage = [&](int s) { return base + s * Cfg::kBBytes; };
  auto a_stage = [&](int s) { return base + Cfg::kAOffset + s * Cfg::kABytes; };
  auto full = [&](int s) { return base + Cfg::kBarOffset + s * 8; };
  auto empty = [&](int s) { return base + Cfg::kBarOffset + (S + s) * 8; };
  float* red = reinterpret_cast<float*>(smem + Cfg::kRedOffset);

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), kWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const bool producer = warp == kWarps;
  auto load_w = [&](uint32_t q, int kt, int n0) {  // arms full[s] for the w and x tiles
    const int s = int(q % S);
    mbar_arrive_expect_tx(full(s), Cfg::kBBytes + Cfg::kABytes);
    if constexpr (kWeightNK)
      tma_load_2d(b_stage(s), &wmap, kt * kGemmArBK, n0, full(s));
    else
      tma_load_2d(b_stage(s), &wmap, n0, kt * kGemmArBK, full(s));
  };
  auto load_x = [&](uint32_t q, int kt) {
    tma_load_2d(a_stage(int(q % S)), &xmap, kt * kGemmArBK, 0, full(int(q % S)));
  };
  // Weights never depend on the previous kernel: the first strip's first stages are requested
  // before griddepcontrol.wait (under PDL they overlap that kernel's tail).
  const int first_strip = blockIdx.x;
  const int pre = S < KT ? S : KT;
  if (producer && lane == 0)
    for (int kt = 0; kt < pre; ++kt) load_w(kt, kt, first_strip * kGemmArBN);
  pdl_wait();  // x, out and the epoch may belong to the previous kernel
  const uint32_t epoch = exchange ? begin_epoch(v.ctl, load_epoch(v.ctl)) : 0u;
  // What every rank must agree on; K is each rank's own shard (layout.h CallDesc).
  const auto desc = [&] {
    return gemm_desc(kOpGemmAr, ElemTraits<T>::kDType, kDescEngineFused, 0u, uint32_t(M),
                     uint32_t(N), 0u);
  };
  if (exchange) send_desc(v, epoch, desc());

  if (producer) {  // ---- producer warp: keep the ring full ------------------------------
    if (lane == 0) {
      uint32_t pos = 0;
      for (int strip = first_strip; strip < strips; strip += gridDim.x) {
        for (int kt = 0; kt < KT; ++kt) {
          const uint32_t q = pos + kt;
          if (strip != first_strip || kt >= pre) {
            // Wait until every consumer warp released the previous lap of this stage.
            if (q >= uint32_t(S)) mbar_wait(empty(int(q % S)), ((q / S) - 1u) & 1u);
            load_w(q, kt, strip * kGemmArBN);
          }
          load_x(q, kt);
        }
        pos += KT;
      }
    }
    return;  // the consumers finish the epoch (thread 0 is theirs)
  }

  // ---- consumer warps ---------------------------------------------------------------------
  const int wm = warp % kWM, wk = warp / kWM;
  uint32_t pos = 0;  // ring positions consumed: stage = pos % S, phase = (pos / S) & 1
  for (int strip = first_strip; strip < strips; strip += gridDim.x) {
    const int n0 = strip * kGemmArBN;
    float acc[kMT][8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;

    for (int kt = 0; kt < KT; ++kt) {
      const uint32_t q = pos + kt;
      const int st = int(q % S);
      mbar_wait(full(st), (q / S) & 1u);
      const uint32_t as = a_stage(st), bs = b_stage(st);
#pragma unroll
      for (int j = 0; j < 4 / Cfg::kWK; ++j) {
        const int kk = wk + j * Cfg::kWK;  // this warp's k16 step within the stage
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          ldmatrix_x4(a[mt], as + swz((wm * kMT + mt) * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
        for (int np = 0; np < 4; ++np) {  // pairs of n8 tiles
          uint32_t b[4];
          if constexpr (kWeightNK)
            ldmatrix_x4(b, bs + swz(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                    kk * 2 + ((lane >> 3) & 1)));
          else
            ldmatrix_x4_trans(b, bs + swz(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                          np * 2 + (lane >> 4)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma_16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
            mma_16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty(st));  // this warp is done reading stage st
    }
    pos += KT;
    pdl_trigger();  // the next kernel may get scheduled during our exchange

#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int row = (wm * kMT + mt) * 16 + (lane >> 2), col = nt * 8 + (lane & 3) * 2;
        float* p = red + (wk * Cfg::kMPad + row) * Cfg::kRedStride + col;
        *reinterpret_cast<float2*>(p) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<float2*>(p + 8 * Cfg::kRedStride) =
            make_float2(acc[mt][nt][2], acc[mt][nt][3]);
      }
    named_barrier_sync(1, Cfg::kConsumers);

    // Vector i of the strip: row i / 8, columns n0 + 8 (i % 8) ... + 7.
    auto strip_vec = [&](int i, float (&f)[kPer]) {
      const float* p = red + (i >> 3) * Cfg::kRedStride + (i & 7) * kPer;
#pragma unroll
      for (int e = 0; e < kPer; ++e) f[e] = p[e];
#pragma unroll
      for (int q = 1; q < Cfg::kWK; ++q)
#pragma unroll
        for (int e = 0; e < kPer; ++e) f[e] += p[q * Cfg::kMPad * Cfg::kRedStride + e];
    };
    auto finish = [&](int i, int64_t vi, float (&f)[kPer]) {
      if (bias != nullptr) {
        const int gn = n0 + (i & 7) * kPer;
#pragma unroll
        for (int e = 0; e < kPer; ++e) f[e] += ElemTraits<T>::to_float(bias[gn + e]);
      }
      reinterpret_cast<Vec16*>(out)[vi] = vec_from_floats<T>(f);
    };
    const int nvec = M * (kGemmArBN / kPer);
    if (!exchange) {
      for (int i = tid; i < nvec; i += Cfg::kConsumers) {
        if (n0 + (i & 7) * kPer >= N) continue;
        float f[kPer];
        strip_vec(i, f);
        finish(i, (int64_t(i >> 3) * N + n0) / kPer + (i & 7), f);
      }
    } else {
      for (int i = tid; i < nvec; i += Cfg::kConsumers) {
        if (n0 + (i & 7) * kPer >= N) continue;
        float f[kPer];
        strip_vec(i, f);
        const Vec16 part = sanitize(vec_from_floats<T>(f));
        const int64_t vi = (int64_t(i >> 3) * N + n0) / kPer + (i & 7);
#pragma unroll 1
        for (int p = 0; p < v.world; ++p)
          if (p != v.rank) st_volatile(slot_ptr(v, p, epoch, v.rank) + vi, part);
      }
      if (strip == first_strip) check_desc<false>(v, epoch, desc(), kOpGemmAr);  // block 0
      for (int i = tid; i < nvec; i += Cfg::kConsumers) {
        if (n0 + (i & 7) * kPer >= N) continue;
        float f[kPer];
        strip_vec(i, f);
        const Vec16 mine = sanitize(vec_from_floats<T>(f));
        const int64_t vi = (int64_t(i >> 3) * N + n0) / kPer + (i & 7);
        float sum[kPer];
#pragma unroll
        for (int e = 0; e < kPer; ++e) sum[e] = 0.f;
#pragma unroll 1
        for (int s = 0; s < v.world; ++s) {
          const Vec16 y = s == v.rank ? mine
                                      : receive(v, slot_ptr(v, v.rank, epoch, s), vi, s, epoch,
                                                kOpGemmAr);
          vec_accumulate<T>(sum, y);
        }
        finish(i, vi, sum);
      }
    }
    named_barrier_sync(1, Cfg::kConsumers);  // `red` is rewritten by the next strip
  }
  if (exchange) finish_epoch(v.ctl, v.err, v.timeout_ns, v.rank, epoch, kOpGemmAr);
}

// The comm stream's wait for a peer's piece (gemm_rs engine='fused'): until every tile of the
// piece signalled (*counter == expected), bounded; then the counter is cleared for the next
// call (no peer adds to it again before the call's closing barrier). One thread, on one of
// the SMs the GEMM leaves free.
__global__ void counter_wait_kernel(uint32_t* counter, uint32_t expected, Control* ctl,
                                    ErrorRecord* err, uint64_t timeout_ns, int rank, int peer) {
  if (threadIdx.x != 0) return;
  if (wait_geq(counter, expected, ctl, err, timeout_ns, rank, peer, kOpGemmRs))
    *reinterpret_cast<volatile uint32_t*>(counter) = 0u;
}

// gemm_ar engine='overlap', transport='copy_engine', the last step (ops/gemm_comm.py,
// _ar_copy_engine): once the compute stream finished the last chunk's GEMMs the SMs are idle,
// so they exchange that chunk themselves. Rank p's reduced rows [lo[p], lo[p + 1]) sit in p's
// staging (the same rows as in out); afterwards out holds every rank's. One kernel on the
// compute stream replaces barrier -> copy-engine pull -> barrier on the comm stream and the own
// rows' copy on a side stream, and their stream hops (benchmarks/NOTES.md).
//  1. Push: this rank's rows go to out and into every peer's staging at the same rows. Those
//     peer rows held the peer's partial of this rank's rows, which this rank pulled before its
//     last GEMM, so nobody reads them any more. Plain stores; each thread fences its own
//     (system scope) before the block's token.
//  2. Token: block b sends a token to slot `rank`, vector b, of every peer's current generation
//     (the one-shot protocol of signals.cuh: a self-signalling word the reader clears) and waits
//     for each peer's. Block b of every rank covers the same vector positions of each rank's
//     rows, so the peer's token says that its block b's share of the peer's rows landed here.
//  3. Copy: the peers' rows of this block's share, local staging -> out.
// Block 0 also exchanges the call's descriptor (the one its pipeline's call checks carry:
// gemm_ar, dtype, M, N, the copy-engine transport and its chunks) before the tokens, so a peer
// in another call fails the communicator with a mismatch instead of a timeout.
// No closing handshake: every peer write into this rank's staging landed before this kernel
// ends (it waited for them), and the pipeline's reads of peers' staging all ran on the comm
// stream, which both ranks joined before this kernel. On a timed-out token the peers' rows of
// out are set to NaN (all ones) instead.
struct RowSplit {
  int64_t lo[kMaxRanks + 1];  // rank p's rows are [lo[p], lo[p + 1])
};
constexpr int kStagingGatherThreads = 512;
constexpr int kStagingGatherUnroll = 4;

__device__ __forceinline__ Vec16 ld_cg(const Vec16* p) {  // L2, never a stale L1 line
  const int4 v = __ldcg(reinterpret_cast<const int4*>(p));
  return Vec16{{uint32_t(v.x), uint32_t(v.y), uint32_t(v.z), uint32_t(v.w)}};
}

__global__ void __launch_bounds__(kStagingGatherThreads)
    staging_gather_kernel(const __grid_constant__ SymmView v, uint64_t staging_offset,
                          const __grid_constant__ RowSplit split, int64_t row_vecs, Vec16* out,
                          const CallDesc desc) {
  constexpr int U = kStagingGatherUnroll;
  pdl_wait();
  const uint32_t epoch = begin_epoch(v.ctl, load_epoch(v.ctl));
  send_desc(v, epoch, desc);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  auto stage = [&](int p) { return reinterpret_cast<Vec16*>(v.base[p] + staging_offset); };

  {  // 1. push this rank's rows to out and to every peer's staging
    const Vec16* src = stage(v.rank);
    const int64_t end = split.lo[v.rank + 1] * row_vecs;
    int64_t i = split.lo[v.rank] * row_vecs + first;
    for (; i + (U - 1) * stride < end; i += U * stride) {  // U loads in flight per thread
      Vec16 t[U];
#pragma unroll
      for (int u = 0; u < U; ++u) t[u] = ld_cg(src + i + u * stride);
#pragma unroll 1
      for (int d = 1; d < v.world; ++d) {
        Vec16* dst = stage((v.rank + d) % v.world);
#pragma unroll
        for (int u = 0; u < U; ++u) dst[i + u * stride] = t[u];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) out[i + u * stride] = t[u];
    }
    for (; i < end; i += stride) {
      const Vec16 t = ld_cg(src + i);
      for (int d = 1; d < v.world; ++d) stage((v.rank + d) % v.world)[i] = t;
      out[i] = t;
    }
  }
  __threadfence_system();  // this thread's pushes are visible before its block's token
  check_desc(v, epoch, desc, kOpGemmAr);  // block 0, lane p: peer p's descriptor

  // 2. tokens: thread p meets rank p
  bool ok = true;
  const int p = int(threadIdx.x);
  __syncthreads();
  if (p < v.world && p != v.rank) {
    st_volatile(slot_ptr(v, p, epoch, v.rank) + blockIdx.x, Vec16{{1u, 1u, 1u, 1u}});
    Vec16* mine = slot_ptr(v, v.rank, epoch, p) + blockIdx.x;
    Vec16 token;
    ok = wait_vec(mine, token, v.ctl, v.err, v.timeout_ns, v.rank, p, epoch, kOpGemmAr);
    if (ok) *mine = empty_vec();
    __threadfence_system();  // acquire: the peer's rows are read after its token arrived
  }
  ok = __syncthreads_and(ok);

  // 3. the peers' rows, pushed into local staging by their block b, -> out
  const Vec16* mine = stage(v.rank);
#pragma unroll 1
  for (int d = 1; d < v.world; ++d) {
    const int q = (v.rank + d) % v.world;
    const int64_t end = split.lo[q + 1] * row_vecs;
    int64_t i = split.lo[q] * row_vecs + first;
    if (!ok) {
      for (; i < end; i += stride) out[i] = nan_vec();
      continue;
    }
    for (; i + (U - 1) * stride < end; i += U * stride) {
      Vec16 t[U];
#pragma unroll
      for (int u = 0; u < U; ++u) t[u] = ld_cg(mine + i + u * stride);
#pragma unroll
      for (int u = 0; u < U; ++u) out[i + u * stride] = t[u];
    }
    for (; i < end; i += stride) out[i] = ld_cg(mine + i);
  }
  finish_epoch(v.ctl, v.err, v.timeout_ns, v.rank, epoch, kOpGemmAr);
}

}  // namespace fusedist
