// fusedist/gemm_comm.cuh -- decode-sized GEMM + all-reduce in one kernel (gemm_ar, M <= 128).
//
// out[M, N] = sum over ranks r of x_r[M, K] @ w_r[K, N] (+ bias): the row-parallel linear of a
// decode step. With M this small the GEMM is bound by reading w once from HBM, so the kernel
// streams w at full bandwidth and hides the all-reduce behind the stream:
//  * Block b owns the 64-column strips t = b, b + grid, ... of the output. It streams strip t
//    of w through a kStages-deep ring of 64 x 64 tiles loaded by the copy engine (TMA, one
//    thread issues, an mbarrier per stage says "landed"; per-thread cp.async topped out near
//    3.1 TB/s), the x tile rides along by cp.async from L2, and the warps multiply on tensor
//    cores (mma.sync m16n8k16, fp32 accumulators), splitting K (small M) or M (larger M); a
//    shared-memory pass sums the K-split partials.
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
// world == 1 skips the exchange: a plain skinny GEMM (the no-communication baseline).
//
// Layouts: x [M, K] with row stride ldx; w, described by a 2-D tensor map (gemm_comm.cu), either
// [K, N] (kWeightNK = false) or [N, K] (kWeightNK = true: an nn.Linear weight used as
// weight.t()); out [M, N] contiguous. K, N and the row strides are multiples of 8.
// Contract: w is not written by the kernel launched just before this one on the stream
// (it is prefetched before griddepcontrol.wait); weights of an inference model never are.
#pragma once
#include "fusedist/mma.cuh"
#include "fusedist/symmetric.cuh"

namespace fusedist {

constexpr int kGemmArBN = 64;  // output columns per strip
constexpr int kGemmArBK = 64;  // K per pipeline stage (one 128-byte smem row of T)

// kWarps warps: kWM along M (kMT m16 tiles each), kWK = kWarps / kWM splitting each stage's
// four k16 steps. Deep rings for small M: a memory-bound kernel needs bytes in flight.
// Shared memory (offsets from a 1024-byte aligned base):
//   [0, S * 8 KB)          weight ring: stage s = the 64 x 64 tile of w, TMA-swizzled
//   then S * kABytes       x ring: stage s = kMPad rows x 64 (rows >= M stay zero)
//   then kRedBytes         fp32 partials of the kWK K-split warps, [kWK][kMPad][64 + 4]
//   then S mbarriers       "weight stage s landed"
template <int kMT, int kWM, int kWarps>
struct GemmArTile {
  static constexpr int kThreads = 32 * kWarps;
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
  static constexpr int kSmemBytes = kBarOffset + kStages * 8 + 1024;  // + base alignment
  static_assert(kSmemBytes <= 227 * 1024, "fits one SM's shared memory");
};

template <typename T, int kMT, int kWM, int kWarps, bool kWeightNK>
__global__ void __launch_bounds__(32 * kWarps, 1)
    gemm_ar_kernel(const __grid_constant__ SymmView v,
                   const __grid_constant__ CUtensorMap wmap, const T* __restrict__ x,
                   int64_t ldx, const T* __restrict__ bias, T* out, int M, int N, int K) {
  using Cfg = GemmArTile<kMT, kWM, kWarps>;
  constexpr int S = Cfg::kStages;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kPer = ElemTraits<T>::kPerVec;  // 8
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  uint8_t* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const uint32_t base = smem_addr(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % kWM, wk = warp / kWM;
  const int strips = (N + kGemmArBN - 1) / kGemmArBN;
  const int KT = (K + kGemmArBK - 1) / kGemmArBK;
  const bool exchange = v.world > 1;

  auto b_stage = [&](int s) { return base + s * Cfg::kBBytes; };
  auto a_stage = [&](int s) { return base + Cfg::kAOffset + s * Cfg::kABytes; };
  auto bar = [&](int s) { return base + Cfg::kBarOffset + s * 8; };
  float* red = reinterpret_cast<float*>(smem + Cfg::kRedOffset);

  if (tid == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bar(s), 1);
    mbar_init_fence();
  }
  // x rows M..kMPad-1 are never loaded: zero them once in every stage.
  for (int c = tid; c < (Cfg::kMPad - M) * 8 * S; c += kThreads) {
    const int s = c / ((Cfg::kMPad - M) * 8), r = c % ((Cfg::kMPad - M) * 8);
    *reinterpret_cast<uint4*>(smem + Cfg::kAOffset + s * Cfg::kABytes + (M + (r >> 3)) * 128 +
                              ((r & 7) << 4)) = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();

  // Weight tile kt of strip n0 into ring position q (one thread issues; TMA zero-fills past
  // the edges of w, so K and N tails need no special case).
  auto load_b = [&](uint32_t q, int kt, int n0) {
    const int s = int(q % S);
    mbar_arrive_expect_tx(bar(s), Cfg::kBBytes);
    if constexpr (kWeightNK)
      tma_load_2d(b_stage(s), &wmap, kt * kGemmArBK, n0, bar(s));
    else
      tma_load_2d(b_stage(s), &wmap, n0, kt * kGemmArBK, bar(s));
  };
  auto load_a = [&](uint32_t q, int kt) {
    const int k0 = kt * kGemmArBK;
    const uint32_t dst = a_stage(int(q % S));
    for (int c = tid; c < M * 8; c += kThreads) {
      const int row = c >> 3, ch = c & 7, gk = k0 + ch * 8;
      const bool ok = gk < K;
      cp_async16(dst + swz(row, ch), ok ? x + row * ldx + gk : x, ok ? 16u : 0u);
    }
  };

  uint32_t epoch = 0;
  uint32_t pos = 0;  // ring positions consumed so far: stage = pos % S, phase = (pos / S) & 1
  bool first = true;
  for (int strip = blockIdx.x; strip < strips; strip += gridDim.x) {
    const int n0 = strip * kGemmArBN;
    if (tid == 0)
      for (int s = 0; s < S - 1 && s < KT; ++s) load_b(pos + s, s, n0);
    if (first) {  // x and the epoch may be written by the previous kernel; w never is
      pdl_wait();
      if (exchange) epoch = begin_epoch(v.ctl, load_epoch(v.ctl));
      first = false;
    }
    for (int s = 0; s < S - 1 && s < KT; ++s) load_a(pos + s, s);
    cp_async_commit();

    float acc[kMT][8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;

    for (int kt = 0; kt < KT; ++kt) {
      const uint32_t q = pos + kt;
      // x stage kt: at kt = 0 the prologue's group; later, all but the S - 2 groups
      // committed after it. Weight stage kt: its barrier's phase for this lap of the ring.
      if (kt == 0)
        cp_async_wait<0>();
      else
        cp_async_wait<S - 2>();
      mbar_wait(bar(int(q % S)), (q / S) & 1u);
      __syncthreads();  // ...for every thread, and ring position q - 1 is free to refill
      const int nk = kt + S - 1;
      if (nk < KT) {
        load_a(pos + nk, nk);
        if (tid == 0) load_b(pos + nk, nk, n0);
      }
      cp_async_commit();

      const uint32_t as = a_stage(int(q % S)), bs = b_stage(int(q % S));
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
    }
    pos += KT;
    cp_async_wait<0>();
    pdl_trigger();  // the next kernel may start its weight prefetch during our exchange

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
    __syncthreads();

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
      for (int i = tid; i < nvec; i += kThreads) {
        if (n0 + (i & 7) * kPer >= N) continue;
        float f[kPer];
        strip_vec(i, f);
        finish(i, (int64_t(i >> 3) * N + n0) / kPer + (i & 7), f);
      }
    } else {
      for (int i = tid; i < nvec; i += kThreads) {
        if (n0 + (i & 7) * kPer >= N) continue;
        float f[kPer];
        strip_vec(i, f);
        const Vec16 part = sanitize(vec_from_floats<T>(f));
        const int64_t vi = (int64_t(i >> 3) * N + n0) / kPer + (i & 7);
#pragma unroll 1
        for (int p = 0; p < v.world; ++p)
          if (p != v.rank) st_volatile(slot_ptr(v, p, epoch, v.rank) + vi, part);
      }
      for (int i = tid; i < nvec; i += kThreads) {
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
    __syncthreads();  // `red` is rewritten by the next strip
  }
  if (exchange) finish_epoch(v.ctl, v.err, v.timeout_ns, v.rank, epoch, kOpGemmAr);
}

}  // namespace fusedist
