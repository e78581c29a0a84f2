// fusedist/gemm/gemv.cuh -- the decode GEMM at GEMV scale: out[M, N] = x[M, K] @ W[N, K]^T
// (* scale) (+ bias) for M <= 16, W in nn.Linear layout (row n = output column n's weights, K
// contiguous), bf16 or FP8 e4m3 (per-tensor, per-output-channel or 128 x 128 block scales),
// x and out bf16. At these M the product is bound by reading W once from HBM; the kernel is
// built to keep that stream at the memory's rate on every SM for every shape.
//
// Work. W is cut into units of kBN rows x kKUnit k, 32 KB each (bf16: 32 x 512; fp8, M <= 8:
// 64 x 512; fp8, M > 8: 32 x 1024); a strip is kBN rows of W, all K. Units are numbered
// strip-major (then K) and CTA c of the grid takes the c-th of G runs of consecutive units
// whose lengths differ by at most one (U / G or U / G + 1): every CTA streams the same number
// of bytes (+-1 unit) whatever N and K are (stream-K). A CTA's run covers whole strips, which
// it finishes itself, and at most two partial strips (its first and last). The grid is one
// wave (G <= resident CTAs), so no CTA ever waits for another.
//
// Streaming. 8 warps: 2 along N x 4 along K (each a quarter of the unit's k). A warp owns kG
// 16-row groups (bf16: 1; fp8: 2 for M <= 8, else 1); lane 4 g + t loads, per unit, kJ = 4 / kG
// 16-byte vectors from each of its rows g and g + 8 of each group: 8 loads (128 bytes) per
// thread per unit, with `ld.global.nc.L1::no_allocate` and an L2 evict-first policy (weights
// are used once; activations keep L2). Registers hold two units: unit u + 1 is requested
// before unit u is consumed, so 32-64 KB per CTA (64-128 KB per SM at two CTAs) stay in
// flight. The first unit is requested before griddepcontrol.wait: weights never depend on the
// previous kernel, so under PDL (launch.h) their loads overlap that kernel's tail, and this
// kernel lets the next one be scheduled at once (its CTAs take SMs as ours leave). x is read
// as 16-byte vectors through L1 with ordinary loads the compiler schedules ahead of the MMAs
// (the two N-warps of a K slice share them).
//
// The other pipeline (stages > 0, "ring"): the copy engine streams each unit's weight rows and
// x rows (cp.async.bulk, one copy per row) into a ring of `stages` units in shared memory,
// `stages` units ahead of the math; the math reads them from there. It is correct and tested,
// and slower than the register pipeline on H200 (benchmarks/NOTES.md): registers are the
// default.
//
// Math (tensor cores, "swap AB"). mma.m16n8k16 with A = 16 weight rows x 16 k and B = 16 k x 8
// rows of x (M <= 8: one MMA per k step; M <= 16: two). The order of k inside a k step is
// free as long as A and B agree: lane (g, t)'s A registers hold the k of its own 16-byte
// vectors, its B registers the same k of x row g (+ 8). FP8 weights are widened in registers:
// e4m3 byte -> bf16 bits (the sign in place; exponent and mantissa shifted into bf16's fields,
// which is the value times 2^-120, e4m3 subnormals as bf16 subnormals), as element pairs
// (0, 2) and (1, 3) of each 4-byte word, x's pairs permuted to match (__byte_perm) and
// multiplied by 2^48 (exact for |x| < 2^80); the fp32 sums, products times 2^-72, get their
// 2^72 back in the epilogue (or in each block's scale): no multiply per weight. Accumulation is fp32 throughout: inside the MMAs and across units in
// registers; block scales multiply each 128 x 128 block's fp32 sum (a warp's rows of a strip
// lie in one scale-block row, its k in whole blocks). NaN encodings of e4m3 (0x7f / 0xff) read as +-480.
//
// Ends of strips (deterministic). When a CTA's part of a strip ends, its four K-warps' sums
// meet in shared memory and are added in K order. A whole strip is then scaled (per-tensor /
// per-channel), biased in fp32 and rounded once to bf16 into out. A partial strip's fp32 sum
// [M][kBN] goes to workspace slot 2c (the CTA's first strip) or 2c + 1 (its last); the CTA
// fences and counts itself on the strip's counter, and the CTA that counts last adds every
// contributor's slot in CTA order -- the order of K, fixed by the grid, not by arrival --,
// finishes as above and puts the counter back to 0 for the next call. Results are bitwise
// identical run to run on one GPU model (the grid, and so the split points, follow its SM
// count). Counters are 0 before the first call; calls sharing a workspace run one at a time
// (stream order: the next kernel touches it only after griddepcontrol.wait).
//
// Contracts: W is not written by the kernel launched just before this one (it is read before
// griddepcontrol.wait); x, out and the workspace may be. x and W rows are 16-byte aligned with
// K % 8 == 0 (bf16 W) or K % 16 == 0 (fp8 W); out, bias and scale need their element
// alignment only. Rows n >= N, k >= K and x rows m >= M are read as zeros and never stored.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>

#include "fusedist/common/mma.cuh"      // mma_16816
#include "fusedist/common/signals.cuh"  // pdl_wait / pdl_trigger

namespace fusedist {
namespace gemvk {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMinBlocks = 2;   // __launch_bounds__: <= 128 registers, two CTAs per SM
constexpr int kWarpsN = 2;      // warps along N
constexpr int kWarpsK = kWarps / kWarpsN;  // warps along K
constexpr int kScaleBlock = 128;
constexpr int kMaxM = 16;

// Geometry of one instantiation (weights: bf16 or e4m3; x rows padded to kMp = 8 or 16).
// Per unit a lane loads kJ vectors from each of its 2 kG rows: 8 loads, 128 bytes. FP8
// with kMp = 8 takes two 16-row groups x 128 k per warp; with kMp = 16 (twice the B
// registers and accumulators) one group x 256 k, so that it fits 128 registers.
template <bool kFp8, int kMp>
struct Cfg {
  static constexpr int kWBytes = kFp8 ? 1 : 2;                 // bytes per weight
  static constexpr int kElems = 16 / kWBytes;                  // weights per 16-byte vector
  static constexpr int kG = kFp8 && kMp == 8 ? 2 : 1;          // 16-row groups per warp
  static constexpr int kJ = 4 / kG;                            // vectors per row per unit per lane
  static constexpr int kKWarp = kJ * 4 * kElems;               // k per warp per unit
  static constexpr int kKUnit = kWarpsK * kKWarp;              // k per unit: 512 or 1024
  static constexpr int kWarpRows = 16 * kG;
  static constexpr int kBN = kWarpsN * kWarpRows;              // rows per strip: 32 or 64
  static constexpr int kSteps = kElems / 4;                    // MMA k steps per vector
  static constexpr int kJBlock = kScaleBlock / (4 * kElems);   // vectors j per 128-k block
  static constexpr int kRedStride = kBN + 4;                   // shared sums: no bank conflicts
  static_assert(kKWarp % kScaleBlock == 0 && kJ % kJBlock == 0, "whole scale blocks per warp");
  static_assert(kScaleBlock % kBN == 0, "a strip lies in one scale-block row");
  static_assert(kJ * 4 * kG == 16, "every lane loads 8 vectors per unit");
};

struct Params {
  const __nv_bfloat16* x;    // [m, ldx] (kXFp8 kernels: e4m3 bytes)
  const float* x_scale;      // kXFp8 kernels: [m], multiplies row m of x
  const uint8_t* w;          // [n, ldw_bytes]: bf16 or e4m3
  const float* scale;        // epilogue: scale[n * scale_ld]; block: [n / 128][scale_ld]
  const __nv_bfloat16* bias; // [n] or null
  __nv_bfloat16* out;        // [m, ldo]
  float* partial;            // [2 grid][m][kBN]
  int* counters;             // [strips], zero between calls
  int64_t ldx, ldw_bytes, ldo, scale_ld;
  int m, n, k;
  int kunits;                // units per strip: ceil(k / kKUnit)
  int units;                 // strips * kunits
  int epi_scale;             // 1: the epilogue multiplies by scale[n * scale_ld]
  int stages;                // kRing kernels: units in the shared-memory ring (<= kMaxStages)
};

constexpr int kMaxStages = 6;
// The shared-memory ring (kRing kernels): a stage holds one unit, kBN rows of kKUnit weights,
// each row padded by 64 bytes so that the 16-byte reads of 8 lanes (two rows x 64 bytes) hit
// 32 distinct banks.
// After the weights, the stage holds the unit's k of the kMp rows of x (bf16; rows >= m are
// not copied and read as zeros), padded the same way.
template <bool kFp8, int kMp>
struct Ring {
  using C = Cfg<kFp8, kMp>;
  static constexpr int kRowBytes = C::kKUnit * C::kWBytes;
  static constexpr int kPitch = kRowBytes + 64;
  static constexpr int kXPitch = C::kKUnit * 2 + 64;
  static constexpr int kXOffset = C::kBN * kPitch;
  static constexpr int kStageBytes = kXOffset + kMp * kXPitch;
};

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// One 16-byte vector of weights: read-only for the kernel's life, not kept in L1, first out
// of L2; L2 fetches the surrounding 256 bytes (the lane's next vectors of the same row).
__device__ __forceinline__ uint4 ld_weights(const uint8_t* p, uint64_t pol) {
  uint4 v;
  asm volatile(
      "ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(pol));
  return v;
}

// One row segment of a unit, global -> shared by the copy engine (cp.async.bulk), completing
// `bytes` (a multiple of 16) on the stage's mbarrier; weights first out of L2.
__device__ __forceinline__ void bulk_copy_weights(uint32_t dst, const uint8_t* src,
                                                  uint32_t bytes, uint32_t bar, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(pol)
      : "memory");
}

// One row of x's k of a unit, global -> shared, completing on the stage's mbarrier (x stays in L2).
__device__ __forceinline__ void bulk_copy_x(uint32_t dst, const __nv_bfloat16* src, uint32_t bytes,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// One 16-byte vector of x: an ordinary (coherent) load, which the compiler may schedule ahead
// of the MMAs, but never above pdl_wait (its asm clobbers memory).
__device__ __forceinline__ uint4 ld_x(const __nv_bfloat16* p) {
  return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ uint4 ld_x(const uint8_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}

template <int i>
__device__ __forceinline__ uint32_t word(const uint4& v) {
  static_assert(i >= 0 && i < 4, "a vector has four words");
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Bytes 1 and 3 of q (e4m3) as bf16x2, byte 1 in the low half: the sign stays at bit 15 of
// its half, exponent and mantissa move down by 4 into bf16's fields: the value times 2^-120
// (a bf16 subnormal for e4m3 subnormals), restored by the scaling of x and of the sums below.
__device__ __forceinline__ uint32_t e4m3_odd_bf16x2(uint32_t q) {
  return (q & 0x80008000u) | ((q & 0x7f007f00u) >> 4);
}
// The 2^120 the widening leaves out: x's B registers carry 2^kXShift (exact while |x| <
// 2^(128 - kXShift)) and every fp32 sum 2^kSumShift more (kXShift - 120: products stay fp32
// normals down to |w x| = 2^(kSumShift - 126)); the epilogue or the block scale puts it back.
constexpr uint32_t kXShiftBf16x2 = 0x57805780u;  // 2^48 in both halves
constexpr float kSumRestore = 4722366482869645213696.f;  // 2^72
// Bytes 0 and 2 of q as bf16x2, byte 0 in the low half.
__device__ __forceinline__ uint32_t e4m3_even_bf16x2(uint32_t q) {
  return e4m3_odd_bf16x2(q << 8);
}

// Words 0..3 of the 16-byte vector as A registers of k step s: bf16 vectors hold two k steps
// (words 2s, 2s + 1), fp8 vectors four (word s, widened into two pairs).
template <bool kFp8, int s>
__device__ __forceinline__ void a_regs(const uint4& lo_row, const uint4& hi_row, uint32_t (&a)[4]) {
  if constexpr (kFp8) {
    const uint32_t q0 = word<s>(lo_row), q1 = word<s>(hi_row);
    a[0] = e4m3_even_bf16x2(q0);  // row g,     elements 4s, 4s + 2
    a[1] = e4m3_even_bf16x2(q1);  // row g + 8
    a[2] = e4m3_odd_bf16x2(q0);   // row g,     elements 4s + 1, 4s + 3
    a[3] = e4m3_odd_bf16x2(q1);   // row g + 8
  } else {
    a[0] = word<2 * s>(lo_row);      // row g,     elements 4s, 4s + 1
    a[1] = word<2 * s>(hi_row);      // row g + 8
    a[2] = word<2 * s + 1>(lo_row);  // row g,     elements 4s + 2, 4s + 3
    a[3] = word<2 * s + 1>(hi_row);  // row g + 8
  }
}

// B registers of k step s from x's 16-byte vector xv holding the same k as the lane's
// weights: for bf16 the vector's k steps 0, 1 (words 2s, 2s + 1); for fp8 the half vector of
// steps 2q, 2q + 1 (elements 4s .. 4s + 3 = words 2 (s % 2), 2 (s % 2) + 1), pairs permuted to
// (4s, 4s + 2), (4s + 1, 4s + 3) as the widened weights are.
template <bool kFp8, int s>
__device__ __forceinline__ void b_regs(const uint4& xv, uint32_t& b0, uint32_t& b1) {
  if constexpr (kFp8) {
    const uint32_t lo = word<2 * (s % 2)>(xv), hi = word<2 * (s % 2) + 1>(xv);
    b0 = bf16x2_mul(__byte_perm(lo, hi, 0x5410), kXShiftBf16x2);
    b1 = bf16x2_mul(__byte_perm(lo, hi, 0x7632), kXShiftBf16x2);
  } else {
    b0 = word<2 * s>(xv);
    b1 = word<2 * s + 1>(xv);
  }
}

// kXFp8 (W8A8): x is e4m3 with a float32 scale per row and e4m3 weights feed the FP8 MMA
// (m16n8k32) as they are: no widening, half the x bytes, half the MMA instructions per weight byte,
// so x rows padded to 32 or 64 fit the same weight stream (one CTA of 8 warps per SM: up to 255
// registers for the 32 or 64 rows' accumulators; two units, 64 KB, in flight). Lane (g, t)'s
// 16-byte weight vector of rows g / g + 8 is two k32 steps (words 0-1, 2-3), x row 8 mh + g's
// vector at the same k gives the B registers (words 2s, 2s + 1): A and B agree on k as above.
// The MMA's own accumulation is not relied on past 128 k: each 128 k's sum is added into the
// fp32 accumulators (as block scales are), and the epilogue multiplies by x_scale[m].
template <bool kFp8, int kMp, bool kBlock, bool kRing, bool kXFp8 = false>
__global__ void __launch_bounds__(kThreads, kXFp8 ? 1 : kMinBlocks)
    gemv_kernel(const __grid_constant__ Params p) {
  using C = Cfg<kFp8, kMp>;
  constexpr int kE = C::kElems, kJ = C::kJ, kG = C::kG, kBN = C::kBN, kRS = C::kRedStride;
  constexpr int kMH = kMp / 8;  // MMAs per k step (8 rows of x each)
  constexpr int kPer = kMp * kBN / kThreads;  // strip elements per thread at a flush
  constexpr bool kPromote = kBlock || kXFp8;  // per-128-k sums added into acc
  static_assert(kMp == 8 || kMp == 16 || (kXFp8 && (kMp == 32 || kMp == 64)),
                "x rows are padded to 8 or 16 (32 or 64 with e4m3 x)");
  static_assert(!kXFp8 || (kFp8 && !kBlock && !kRing && kMp >= 32),
                "e4m3 x: e4m3 weights with tensor / channel scales, the register pipeline");
  static_assert(kPer >= 1 && kMp * kBN % kThreads == 0, "a flush gives every thread elements");
  __shared__ float red[kWarpsK][kMp][kRS];  // the K-warps' sums at a flush
  __shared__ int s_last;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % kWarpsN, wk = warp / kWarpsN;
  const int KU = p.kunits, U = p.units, G = int(gridDim.x);
  // CTA c takes units [start(c), start(c + 1)): the first U % G CTAs one more than U / G.
  const int base = U / G, extra = U % G;
  auto start = [&](int cc) { return cc * base + min(cc, extra); };
  auto cta_of = [&](int u) {  // the CTA whose range holds unit u
    const int long_units = extra * (base + 1);
    return u < long_units ? u / (base + 1) : extra + (u - long_units) / base;
  };
  const int c = int(blockIdx.x);
  const int u0 = start(c), u1 = start(c + 1);
  const int first_strip = u0 / KU;
  const int row0 = wn * C::kWarpRows + g;    // this lane's first row in a strip
  const int kwarp = wk * C::kKWarp + t * kE;  // this lane's first k in a unit
  const uint64_t pol = evict_first_policy();

  // ---- weight loads: unit (ld_strip, ld_ku) into r, then advance --------------------------
  int ld_strip = first_strip, ld_ku = u0 - first_strip * KU;
  auto load = [&](uint4 (&r)[kG][2][kJ]) {
    const int k0 = ld_ku * C::kKUnit + kwarp;
#pragma unroll
    for (int gi = 0; gi < kG; ++gi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = ld_strip * kBN + row0 + 16 * gi + 8 * h;
        const uint8_t* rp = p.w + int64_t(n) * p.ldw_bytes + int64_t(k0) * C::kWBytes;
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          r[gi][h][j] = make_uint4(0u, 0u, 0u, 0u);
          if (n < p.n && k0 + 4 * j * kE < p.k)
            r[gi][h][j] = ld_weights(rp + 4 * j * kE * C::kWBytes, pol);
        }
      }
    if (++ld_ku == KU) ld_ku = 0, ++ld_strip;
  };

  float acc[kG][kMH][4];
  auto zero = [](float (&a)[kG][kMH][4]) {
#pragma unroll
    for (int gi = 0; gi < kG; ++gi)
#pragma unroll
      for (int mh = 0; mh < kMH; ++mh)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[gi][mh][e] = 0.f;
  };
  zero(acc);

  // ---- one unit: x vectors through L1, MMAs into acc (block scales: via blk) --------------
  // xs: the x stage of the unit in shared memory (kRing), or 0: x from global memory.
  auto compute = [&](const uint4 (&r)[kG][2][kJ], int strip, int ku, uint32_t xs) {
    float blk[kG][kMH][4];
    float (&dst)[kG][kMH][4] = kPromote ? blk : acc;
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      if constexpr (kPromote)
        if (j % C::kJBlock == 0) zero(blk);
      const int k = ku * C::kKUnit + kwarp + 4 * j * kE;
      if constexpr (kXFp8) {
        // x rows 8 mh + g at the k of this lane's vector j: 16 e4m3, two k32 steps (A: words
        // 0-1 and 2-3 of rows g, g + 8), one x vector live at a time.
        const uint8_t* xb = reinterpret_cast<const uint8_t*>(p.x);
        const uint4 &lo = r[0][0][j], &hi = r[0][1][j];
        const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
        const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
        for (int mh = 0; mh < kMH; ++mh) {
          const int m = 8 * mh + g;
          uint4 xv = make_uint4(0u, 0u, 0u, 0u);
          if (m < p.m && k < p.k) xv = ld_x(xb + int64_t(m) * p.ldx + k);
          mma_16832_e4m3(dst[0][mh], a0, xv.x, xv.y);
          mma_16832_e4m3(dst[0][mh], a1, xv.z, xv.w);
        }
      } else {
        // x rows g (+ 8) at the k of this lane's vector j, one 16-byte vector (8 k, two k steps)
        // at a time: bf16 one per vector j, fp8 two.
#pragma unroll
        for (int q = 0; q < kE / 8; ++q) {
          uint4 xv[kMH];
#pragma unroll
          for (int mh = 0; mh < kMH; ++mh) {
            const int m = 8 * mh + g;
            xv[mh] = make_uint4(0u, 0u, 0u, 0u);
            if (m < p.m && k < p.k) {
              if constexpr (kRing)
                xv[mh] = lds128(xs + m * Ring<kFp8, kMp>::kXPitch +
                                (k + 8 * q - ku * C::kKUnit) * 2);
              else
                xv[mh] = ld_x(p.x + int64_t(m) * p.ldx + k + 8 * q);
            }
          }
          auto kstep = [&](auto s_const) {
            constexpr int s = decltype(s_const)::value;
            if constexpr (s < C::kSteps) {
              uint32_t b0[kMH], b1[kMH];
#pragma unroll
              for (int mh = 0; mh < kMH; ++mh) b_regs<kFp8, s>(xv[mh], b0[mh], b1[mh]);
#pragma unroll
              for (int gi = 0; gi < kG; ++gi) {
                uint32_t a[4];
                a_regs<kFp8, s>(r[gi][0][j], r[gi][1][j], a);
#pragma unroll
                for (int mh = 0; mh < kMH; ++mh)
                  mma_16816<__nv_bfloat16>(dst[gi][mh], a, b0[mh], b1[mh]);
              }
            }
          };
          if (q == 0) {
            kstep(std::integral_constant<int, 0>{});
            kstep(std::integral_constant<int, 1>{});
          } else {
            kstep(std::integral_constant<int, 2>{});
            kstep(std::integral_constant<int, 3>{});
          }
        }
      }
      if constexpr (kPromote) {
        if (j % C::kJBlock == C::kJBlock - 1) {
          // This warp's rows of the strip and these 128 k lie in one scale block (kBlock);
          // e4m3 x: the 128 k's sum goes into acc as it is.
          float sc = 1.f;
          if constexpr (kBlock) {
            const int nb = strip * kBN;
            const int kc = (ku * C::kKUnit + wk * C::kKWarp) / kScaleBlock + j / C::kJBlock;
            sc = nb < p.n && kc * kScaleBlock < p.k
                     ? p.scale[int64_t(nb / kScaleBlock) * p.scale_ld + kc] * kSumRestore
                     : 0.f;
          }
#pragma unroll
          for (int gi = 0; gi < kG; ++gi)
#pragma unroll
            for (int mh = 0; mh < kMH; ++mh)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[gi][mh][e] = fmaf(sc, blk[gi][mh][e], acc[gi][mh][e]);
        }
      }
    }
  };

  // Contributors of strip s: CTAs cta_of(s KU) .. cta_of((s + 1) KU - 1); slot 0 of a CTA holds
  // its first strip, slot 1 its last.
  auto slot_of = [&](int cc, int strip) { return 2 * cc + (start(cc) / KU == strip ? 0 : 1); };
  auto finish = [&](float v, int m, int n) {  // fp32 sum -> scaled, biased, rounded once
    if constexpr (kXFp8) v *= p.x_scale[m];
    if constexpr (kFp8 && !kXFp8 && !kBlock) v *= kSumRestore;  // widened weights' 2^-72
    if (p.epi_scale) v *= p.scale[int64_t(n) * p.scale_ld];
    if (p.bias != nullptr) v += __bfloat162float(p.bias[n]);
    return __float2bfloat16_rn(v);
  };

  // ---- the end of this CTA's part of a strip ----------------------------------------------
  auto flush = [&](int strip, bool whole) {
    // C fragment e of (group gi, half mh): row nl = row0 + 16 gi + 8 (e >> 1) of the strip
    // (output column), column m = 8 mh + 2 t + (e & 1) of x (output row).
    __syncthreads();  // the previous flush has read `red`
#pragma unroll
    for (int gi = 0; gi < kG; ++gi)
#pragma unroll
      for (int mh = 0; mh < kMH; ++mh)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          red[wk][8 * mh + 2 * t + (e & 1)][row0 + 16 * gi + 8 * (e >> 1)] = acc[gi][mh][e];
    zero(acc);
    __syncthreads();
    float sum[kPer];  // element idx = tid + i kThreads: m = idx / kBN, nl = idx % kBN
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * kThreads, m = idx / kBN, nl = idx % kBN;
      float v = red[0][m][nl];
#pragma unroll
      for (int w = 1; w < kWarpsK; ++w) v += red[w][m][nl];  // K order
      sum[i] = v;
    }
    if (whole) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int idx = tid + i * kThreads, m = idx / kBN, n = strip * kBN + idx % kBN;
        if (m < p.m && n < p.n) p.out[int64_t(m) * p.ldo + n] = finish(sum[i], m, n);
      }
      return;
    }
    float* part = p.partial + int64_t(slot_of(c, strip)) * p.m * kBN;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * kThreads, m = idx / kBN;
      if (m < p.m) part[idx] = sum[i];  // [m][kBN]: idx itself
    }
    __threadfence();  // this thread's partial is visible device-wide before the count
    __syncthreads();
    const int cf = cta_of(strip * KU), cl = cta_of((strip + 1) * KU - 1);
    if (tid == 0) {
      const int prev = atomicAdd(p.counters + strip, 1);
      s_last = prev == cl - cf;
      if (s_last) p.counters[strip] = 0;  // every contributor has counted: ready for next call
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // The last to count: every contributor's partial in CTA (= K) order, kBatch CTAs' loads
    // in flight at a time, then scale, bias, one rounding.
#pragma unroll
    for (int i = 0; i < kPer; ++i) sum[i] = 0.f;
    constexpr int kBatch = kPer >= 4 ? 2 : 4;
#pragma unroll 1
    for (int c0 = cf; c0 <= cl; c0 += kBatch) {
      float v[kBatch][kPer];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int cc = c0 + b;
        const float* src = p.partial + int64_t(slot_of(cc <= cl ? cc : cl, strip)) * p.m * kBN;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int idx = tid + i * kThreads, m = idx / kBN;
          v[b][i] = cc <= cl && m < p.m ? __ldcg(src + idx) : 0.f;
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
#pragma unroll
        for (int i = 0; i < kPer; ++i) sum[i] += v[b][i];
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * kThreads, m = idx / kBN, n = strip * kBN + idx % kBN;
      if (m < p.m && n < p.n) p.out[int64_t(m) * p.ldo + n] = finish(sum[i], m, n);
    }
  };

  // ---- the stream ---------------------------------------------------------------------------
  int strip = ld_strip, ku = ld_ku;  // the unit being consumed
  int seg_ku = ku;  // where this CTA's part of the current strip began
  auto step = [&](const uint4 (&r)[kG][2][kJ], int u, uint32_t xs) {
    compute(r, strip, ku, xs);
    const bool strip_end = ku == KU - 1;
    if (strip_end || u == u1 - 1) {
      flush(strip, seg_ku == 0 && strip_end);
      seg_ku = 0;
    }
    if (strip_end) ku = 0, ++strip;
    else ++ku;
  };
  if constexpr (!kRing) {
    uint4 ra[kG][2][kJ], rb[kG][2][kJ];
    load(ra);    // the first unit's weights: before the wait (PDL)
    pdl_wait();  // x, out and the workspace may belong to the previous kernel
    pdl_trigger();
    for (int u = u0; u < u1; u += 2) {  // unit u + 1 is requested before unit u is consumed
      if (u + 1 < u1) load(rb);
      step(ra, u, 0u);
      if (u + 1 >= u1) break;
      if (u + 2 < u1) load(ra);
      step(rb, u + 1, 0u);
    }
  } else {
    // The ring: warp 0 hands unit i to the copy engine into stage i % S (one bulk copy per
    // weight row and per x row, completing on the stage's mbarrier) S units ahead of its use;
    // every warp waits for the stage, reads its weight vectors into registers and its x
    // vectors next to the MMAs (shared memory: no L2 round trip in the math), and after a
    // block barrier (the stage is free) warp 0 refills it with unit i + S.
    using R = Ring<kFp8, kMp>;
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ __align__(8) uint64_t bars[kMaxStages];
    const int S = p.stages, nu = u1 - u0;
    const uint32_t ring0 = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
    const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(bars));
    if (tid == 0) {
      for (int i = 0; i < S; ++i) mbar_init(bar0 + 8 * i, 1);
      mbar_init_fence();
    }
    __syncthreads();
    // Unit ld_i into stage ld_i % S: its weights (issue_w, which also arms the stage's
    // barrier for the weights and x) and its k of x (issue_x; x may be written by the previous
    // kernel, so the prologue's x copies wait for pdl_wait).
    auto unit_bytes = [&](int ku_) {
      return uint32_t(min(C::kKUnit, p.k - ku_ * C::kKUnit));  // elements along k
    };
    int ld_i = 0, lx_i = 0, lx_ku = ld_ku;
    auto issue_w = [&]() {  // warp 0
      const int slot = ld_i % S;
      const uint32_t bar = bar0 + 8 * slot, dst = ring0 + slot * R::kStageBytes;
      const int k0 = ld_ku * C::kKUnit, n0 = ld_strip * kBN;
      const uint32_t kel = unit_bytes(ld_ku), bytes = kel * C::kWBytes;
      const int rows = min(kBN, p.n - n0);
      if (lane == 0) mbar_arrive_expect_tx(bar, uint32_t(rows) * bytes + uint32_t(p.m) * kel * 2u);
      __syncwarp();
      for (int r = lane; r < rows; r += 32)
        bulk_copy_weights(dst + r * R::kPitch,
                          p.w + int64_t(n0 + r) * p.ldw_bytes + int64_t(k0) * C::kWBytes, bytes,
                          bar, pol);
      if (++ld_ku == KU) ld_ku = 0, ++ld_strip;
      ++ld_i;
    };
    auto issue_x = [&]() {  // warp 0, after issue_w of the same unit
      const int slot = lx_i % S;
      const uint32_t bar = bar0 + 8 * slot, dst = ring0 + slot * R::kStageBytes + R::kXOffset;
      const int k0 = lx_ku * C::kKUnit;
      const uint32_t bytes = unit_bytes(lx_ku) * 2u;
      for (int m = lane; m < p.m; m += 32)
        bulk_copy_x(dst + m * R::kXPitch, p.x + int64_t(m) * p.ldx + k0, bytes, bar);
      if (++lx_ku == KU) lx_ku = 0;
      ++lx_i;
    };
    const int pro = S < nu ? S : nu;
    if (warp == 0)
      for (int i = 0; i < pro; ++i) issue_w();  // weights before the wait (PDL), as above
    pdl_wait();
    pdl_trigger();
    if (warp == 0)
      for (int i = 0; i < pro; ++i) issue_x();
    uint4 r[kG][2][kJ];
    for (int i = 0; i < nu; ++i) {
      const int slot = i % S;
      mbar_wait(bar0 + 8 * slot, uint32_t(i / S) & 1u);
      const uint32_t base = ring0 + slot * R::kStageBytes;
      const int k0 = ku * C::kKUnit + kwarp;
#pragma unroll
      for (int gi = 0; gi < kG; ++gi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int rl = row0 + 16 * gi + 8 * h;
          const bool row_ok = strip * kBN + rl < p.n;
#pragma unroll
          for (int j = 0; j < kJ; ++j) {
            r[gi][h][j] = make_uint4(0u, 0u, 0u, 0u);  // rows >= n, k >= k: zeros
            if (row_ok && k0 + 4 * j * kE < p.k)
              r[gi][h][j] = lds128(base + rl * R::kPitch + (kwarp + 4 * j * kE) * C::kWBytes);
          }
        }
      step(r, u0 + i, base + R::kXOffset);  // x from the stage
      __syncthreads();  // stage `slot` (weights and x) is read by every warp: refill it
      if (warp == 0 && i + S < nu) {
        issue_w();
        issue_x();
      }
    }
  }
}

}  // namespace gemvk
}  // namespace fusedist
