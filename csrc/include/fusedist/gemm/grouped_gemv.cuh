// fusedist/gemm/grouped_gemv.cuh -- the grouped decode GEMV behind fusedist.ops.moe.grouped_gemm
// at a few rows per expert: out[r, :] = x_row(r) @ dequant(w[e]).t() for the rows r of every
// expert e, reading only the routed experts' weights, at the memory's rate. It is the decode
// GEMV of gemv.cuh over a list of experts and reuses its geometry (Cfg), its weight stream
// (ld_weights under an L2 evict-first policy), its register layout for the MMAs (a_regs /
// b_regs: e4m3 widened to bf16 in registers, x scaled by 2^48) and its fp32 accumulation; see
// there for those. What differs is the work list, which only the device knows.
//
// Work. A task is (expert e, strip s, chunk c): kBN rows s kBN .. of w[e] (output columns)
// times rows 8c .. 8c + 7 of e's segment of the layout (out rows offsets[e] + 8c + i, i <
// min(8, counts[e] - 8c)), all of K: kunits units of kBN x kKUnit weights, as gemv's strips.
// Tasks are numbered expert-major, then strip, then chunk (so an expert with more than 8 rows
// reads each weight unit twice in a row, the second time from L2). After griddepcontrol.wait
// (the routing comes from the kernels just before) every CTA reads counts and offsets into
// shared memory and takes an exclusive prefix of the experts' task counts (strips x
// ceil(counts / 8)); the U = tasks x kunits units of the call are then cut into G runs of
// consecutive units whose lengths differ by at most one, CTA c taking run c, exactly as
// gemv's stream-K over strips. The grid G is fixed on the host (resident CTAs, at most the worst case's units: all
// pairs on distinct experts); a CTA whose run is empty -- the routing has fewer units than
// the worst case -- exits at once. Everything a CTA computes depends on the routing only
// through counts and offsets, so the same routing gives the same bits (run to run, and in a
// CUDA graph replayed with new routings).
//
// Ends of tasks (deterministic): as gemv's ends of strips. A CTA's part of a task ends in a
// flush: the four K-warps' sums meet in shared memory and are added in K order; a whole task
// is scaled and rounded into out; a partial one goes to workspace slot 2c (the CTA's first
// task) or 2c + 1 (its last), the CTA counts itself on the task's counter, and the CTA that
// counts last adds every contributor's slot in CTA (= K) order, finishes the task and puts
// the counter back to 0. counters holds one int per task of the worst case, zero between calls.
//
// Rows. x_row(r) = x[r] or, with gather, x[src_index[r] / top_k] (the decode path reads the
// token-order activation: no permute pass). A row whose src_index is negative or past x's rows,
// and rows past an expert's count, read as zeros and are never stored; an expert whose segment
// is not inside [0, rows) has no tasks. So no layout makes the kernel touch memory outside
// x, w, out and the scales. The first weight unit cannot be requested before the wait (which
// expert it belongs to comes from the routing); the next kernel is released right after it.
//
// Contracts as gemv's: x rows and w 16-byte aligned with K % 8 == 0 (bf16 w) or K % 16 == 0
// (e4m3 w); x bf16; the weight scales multiply the e4m3 values: scale[e] (per expert),
// scale[e][n] (per channel) or scale[e][n / 128][k / 128] (blocks).
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

#include "fusedist/gemm/gemv.cuh"

namespace fusedist {
namespace gemvk {

constexpr int kTaskRows = 8;         // x rows per task: gemv's Cfg<*, 8>
constexpr int kMaxExperts = 1024;    // the task prefix lives in shared memory

struct GroupedParams {
  const __nv_bfloat16* x;     // [x_rows, ldx]
  const uint8_t* w;           // [experts][n][ldw_bytes]: bf16 or e4m3
  const float* scale;         // expert e's scales at scale + e * scale_expert_stride
  __nv_bfloat16* out;         // [rows, ldo]
  const int* counts;          // [experts]
  const int* offsets;         // [experts + 1]
  const int* src_index;       // [rows] (gather only)
  float* partial;             // [2 grid][kTaskRows][kBN]
  int* counters;              // [max_tasks], zero between calls
  int64_t ldx, ldw_bytes, ldo, w_expert_bytes;
  int64_t scale_expert_stride;  // floats between experts' scales
  int64_t scale_ld;           // within an expert: epilogue scale[n * scale_ld]; block rows apart
  int64_t rows, x_rows;
  int n, k, experts, top_k, gather;
  int kunits;                 // units per task: ceil(k / kKUnit)
  int strips;                 // strips per expert: ceil(n / kBN)
  int64_t max_tasks;          // counters' length: more tasks than this are not run
  int epi_scale;              // 1: the epilogue multiplies by the expert's scale[n * scale_ld]
};

template <bool kFp8, bool kBlock>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    grouped_gemv_kernel(const __grid_constant__ GroupedParams p) {
  using C = Cfg<kFp8, kTaskRows>;
  constexpr int kE = C::kElems, kJ = C::kJ, kG = C::kG, kBN = C::kBN, kRS = C::kRedStride;
  constexpr int kMp = kTaskRows;
  constexpr int kPer = kMp * kBN / kThreads;  // task elements per thread at a flush
  static_assert(kPer >= 1 && kMp * kBN % kThreads == 0, "a flush gives every thread elements");
  __shared__ float red[kWarpsK][kMp][kRS];      // the K-warps' sums at a flush
  __shared__ int first_task[kMaxExperts + 1];   // exclusive prefix of the experts' tasks
  __shared__ int e_rows[kMaxExperts];            // each expert's rows (0: none or invalid)
  __shared__ int e_first[kMaxExperts];           // ... and its first row
  __shared__ int s_last;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % kWarpsN, wk = warp / kWarpsN;
  const int E = p.experts;

  pdl_wait();  // counts, offsets, src_index and x come from the kernels before this one
  pdl_trigger();

  // ---- the work list: tasks per expert, their prefix, the call's units -----------------------
  // One read of counts and offsets (the routing) into shared memory; an expert whose segment
  // lies outside [0, rows) or whose count is negative has no rows.
  // Task counts are capped at max_tasks (the counters' length) and summed in 64 bits, so no
  // routing overflows the prefix; tasks past the cap are not run.
  const int64_t cap = p.max_tasks;
  for (int e = tid; e < E; e += kThreads) {
    const int cnt = p.counts[e];
    const int64_t off = p.offsets[e];
    const int rows = cnt > 0 && off >= 0 && off + cnt <= p.rows ? cnt : 0;
    e_rows[e] = rows;
    e_first[e] = rows ? int(off) : 0;
    const int64_t n = int64_t((rows + kTaskRows - 1) / kTaskRows) * p.strips;
    first_task[e + 1] = int(min(n, cap));
  }
  __syncthreads();
  if (warp == 0) {  // inclusive scan of first_task[1..E], 32 experts at a time, saturating
    int64_t carry = 0;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      int64_t v = e < E ? first_task[e + 1] : 0;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int64_t u = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += u;
      }
      if (e < E) first_task[e + 1] = int(min(carry + v, cap));
      carry = min(carry + __shfl_sync(0xffffffffu, v, 31), cap);
    }
    if (lane == 0) first_task[0] = 0;
  }
  __syncthreads();
  const int tasks = first_task[E];
  const int KU = p.kunits, U = tasks * KU, G = int(gridDim.x);
  // CTA c takes units [start(c), start(c + 1)): the first U % G CTAs one more than U / G.
  const int base = U / G, extra = U % G;
  auto start = [&](int cc) { return cc * base + min(cc, extra); };
  auto cta_of = [&](int u) {  // the CTA whose range holds unit u
    const int long_units = extra * (base + 1);
    return u < long_units ? u / (base + 1) : extra + (u - long_units) / base;
  };
  const int c = int(blockIdx.x);
  const int u0 = start(c), u1 = start(c + 1);
  if (u0 >= u1) return;  // fewer units than the worst case: nothing for this CTA

  // Task q -> expert (the last e with first_task[e] <= q: never an empty one), strip, chunk.
  struct Task {
    int e, strip, row0, m;  // m: valid rows (<= 8) from out row row0
  };
  auto task_of = [&](int q) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (first_task[mid] <= q) lo = mid;
      else hi = mid - 1;
    }
    Task tk;
    tk.e = lo;
    const int rows = e_rows[lo];  // > 0: the expert holds task q
    const int chunks = (rows + kTaskRows - 1) / kTaskRows;
    const int local = q - first_task[lo];
    tk.strip = local / chunks;
    const int chunk = local - tk.strip * chunks;
    tk.row0 = e_first[lo] + chunk * kTaskRows;
    tk.m = min(kTaskRows, rows - chunk * kTaskRows);
    return tk;
  };

  const int row0 = wn * C::kWarpRows + g;    // this lane's first row in a strip
  const int kwarp = wk * C::kKWarp + t * kE;  // this lane's first k in a unit
  const uint64_t pol = evict_first_policy();

  // ---- weight loads: unit (ld_task, ld_ku) into r, then advance -----------------------------
  int ld_task = u0 / KU, ld_ku = u0 - ld_task * KU;
  const uint8_t* ld_w = nullptr;  // the task's first weight row (row 0 of its strip)
  int ld_rows = 0;                // rows of the strip inside n
  auto ld_begin = [&]() {
    const Task tk = task_of(ld_task);
    ld_w = p.w + int64_t(tk.e) * p.w_expert_bytes + int64_t(tk.strip) * kBN * p.ldw_bytes;
    ld_rows = p.n - tk.strip * kBN;
  };
  ld_begin();
  auto load = [&](uint4 (&r)[kG][2][kJ]) {
    const int k0 = ld_ku * C::kKUnit + kwarp;
#pragma unroll
    for (int gi = 0; gi < kG; ++gi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int nl = row0 + 16 * gi + 8 * h;
        const uint8_t* rp = ld_w + int64_t(nl) * p.ldw_bytes + int64_t(k0) * C::kWBytes;
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          r[gi][h][j] = make_uint4(0u, 0u, 0u, 0u);
          if (nl < ld_rows && k0 + 4 * j * kE < p.k)
            r[gi][h][j] = ld_weights(rp + 4 * j * kE * C::kWBytes, pol);
        }
      }
    if (++ld_ku == KU) {
      ld_ku = 0;
      if (++ld_task < tasks) ld_begin();
    }
  };

  float acc[kG][4];
  auto zero = [](float (&a)[kG][4]) {
#pragma unroll
    for (int gi = 0; gi < kG; ++gi)
#pragma unroll
      for (int e = 0; e < 4; ++e) a[gi][e] = 0.f;
  };
  zero(acc);

  // ---- the task being consumed: its x row (this lane's row g), scales, out rows -------------
  int task = u0 / KU, ku = u0 - task * KU;
  Task ct;
  const __nv_bfloat16* xrow = nullptr;  // row g of the task's x rows, or null: zeros
  const float* escale = nullptr;        // the expert's scales
  auto begin_task = [&]() {
    ct = task_of(task);
    xrow = nullptr;
    if (g < ct.m) {
      int64_t r = ct.row0 + g;
      if (p.gather) {
        const int src = p.src_index[r];
        r = src >= 0 ? src / p.top_k : -1;
      }
      if (r >= 0 && r < p.x_rows) xrow = p.x + r * p.ldx;
    }
    escale = p.scale != nullptr ? p.scale + int64_t(ct.e) * p.scale_expert_stride : nullptr;
  };
  uint4 ra[kG][2][kJ], rb[kG][2][kJ];
  load(ra);      // the first unit's weights, before the task's x rows are looked up
  begin_task();

  // ---- one unit: x vectors through L1, MMAs into acc (block scales: via blk) ----------------
  auto compute = [&](const uint4 (&r)[kG][2][kJ]) {
    float blk[kG][4];
    float (&dst)[kG][4] = kBlock ? blk : acc;
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      if constexpr (kBlock)
        if (j % C::kJBlock == 0) zero(blk);
      const int k = ku * C::kKUnit + kwarp + 4 * j * kE;
      // x row g at the k of this lane's vector j, one 16-byte vector (8 k, two k steps) at a
      // time: bf16 one per vector j, fp8 two.
#pragma unroll
      for (int q = 0; q < kE / 8; ++q) {
        uint4 xv = make_uint4(0u, 0u, 0u, 0u);
        if (xrow != nullptr && k < p.k) xv = ld_x(xrow + k + 8 * q);
        auto kstep = [&](auto s_const) {
          constexpr int s = decltype(s_const)::value;
          if constexpr (s < C::kSteps) {
            uint32_t b0, b1;
            b_regs<kFp8, s>(xv, b0, b1);
#pragma unroll
            for (int gi = 0; gi < kG; ++gi) {
              uint32_t a[4];
              a_regs<kFp8, s>(r[gi][0][j], r[gi][1][j], a);
              mma_16816<__nv_bfloat16>(dst[gi], a, b0, b1);
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
      if constexpr (kBlock) {
        if (j % C::kJBlock == C::kJBlock - 1) {
          // This warp's rows of the strip and these 128 k lie in one scale block.
          const int nb = ct.strip * kBN;
          const int kc = (ku * C::kKUnit + wk * C::kKWarp) / kScaleBlock + j / C::kJBlock;
          const float sc = nb < p.n && kc * kScaleBlock < p.k
                               ? escale[int64_t(nb / kScaleBlock) * p.scale_ld + kc] *
                                     kSumRestore
                               : 0.f;
#pragma unroll
          for (int gi = 0; gi < kG; ++gi)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[gi][e] = fmaf(sc, blk[gi][e], acc[gi][e]);
        }
      }
    }
  };

  // Contributors of task q: CTAs cta_of(q KU) .. cta_of((q + 1) KU - 1); slot 0 of a CTA holds
  // its first task, slot 1 its last.
  auto slot_of = [&](int cc, int q) { return 2 * cc + (start(cc) / KU == q ? 0 : 1); };
  auto finish = [&](float v, int n) {  // fp32 sum -> scaled, rounded once
    if constexpr (kFp8 && !kBlock) v *= kSumRestore;  // widened weights' 2^-72
    if (p.epi_scale) v *= escale[int64_t(n) * p.scale_ld];
    return __float2bfloat16_rn(v);
  };
  auto store = [&](const float (&sum)[kPer]) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * kThreads, m = idx / kBN, n = ct.strip * kBN + idx % kBN;
      if (m < ct.m && n < p.n) p.out[int64_t(ct.row0 + m) * p.ldo + n] = finish(sum[i], n);
    }
  };

  // ---- the end of this CTA's part of a task -------------------------------------------------
  auto flush = [&](bool whole) {
    // C fragment e of group gi: row nl = row0 + 16 gi + 8 (e >> 1) of the strip (output
    // column), column m = 2 t + (e & 1) of x (output row).
    __syncthreads();  // the previous flush has read `red`
#pragma unroll
    for (int gi = 0; gi < kG; ++gi)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        red[wk][2 * t + (e & 1)][row0 + 16 * gi + 8 * (e >> 1)] = acc[gi][e];
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
      store(sum);
      return;
    }
    float* part = p.partial + int64_t(slot_of(c, task)) * kMp * kBN;
#pragma unroll
    for (int i = 0; i < kPer; ++i) part[tid + i * kThreads] = sum[i];  // [m][kBN]: idx
    __threadfence();  // this thread's partial is visible device-wide before the count
    __syncthreads();
    const int cf = cta_of(task * KU), cl = cta_of((task + 1) * KU - 1);
    if (tid == 0) {
      const int prev = atomicAdd(p.counters + task, 1);
      s_last = prev == cl - cf;
      if (s_last) p.counters[task] = 0;  // every contributor has counted: ready for next call
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // The last to count: every contributor's partial in CTA (= K) order, two CTAs' loads in
    // flight at a time, then scale and one rounding.
#pragma unroll
    for (int i = 0; i < kPer; ++i) sum[i] = 0.f;
    constexpr int kBatch = kPer >= 4 ? 2 : 4;
#pragma unroll 1
    for (int c0 = cf; c0 <= cl; c0 += kBatch) {
      float v[kBatch][kPer];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int cc = c0 + b;
        const float* src = p.partial + int64_t(slot_of(cc <= cl ? cc : cl, task)) * kMp * kBN;
#pragma unroll
        for (int i = 0; i < kPer; ++i) v[b][i] = cc <= cl ? __ldcg(src + tid + i * kThreads) : 0.f;
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
#pragma unroll
        for (int i = 0; i < kPer; ++i) sum[i] += v[b][i];
    }
    store(sum);
  };

  // ---- the stream ---------------------------------------------------------------------------
  int seg_ku = ku;  // where this CTA's part of the current task began
  auto step = [&](const uint4 (&r)[kG][2][kJ], int u) {
    compute(r);
    const bool task_end = ku == KU - 1;
    if (task_end || u == u1 - 1) {
      flush(seg_ku == 0 && task_end);
      seg_ku = 0;
    }
    if (task_end) {
      ku = 0;
      if (++task < tasks && u + 1 < u1) begin_task();
    } else {
      ++ku;
    }
  };
  for (int u = u0; u < u1; u += 2) {  // unit u + 1 is requested before unit u is consumed
    if (u + 1 < u1) load(rb);
    step(ra, u);
    if (u + 1 >= u1) break;
    if (u + 2 < u1) load(ra);
    step(rb, u + 1);
  }
}

}  // namespace gemvk
}  // namespace fusedist
