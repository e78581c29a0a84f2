// fusedist/attention/decode.cuh -- paged split-KV decode attention (flash-decoding) for sm_90.
//
// One new query token per sequence attends to the seq_lens[b] tokens of its paged KV cache.
//
// Layouts (docs/design/attention.md):
//   q, out       [batch, q_heads, head_dim]                      bf16 / fp16, contiguous
//   k/v_cache    [num_pages, page_size, kv_heads, head_dim]      bf16 / fp16 / fp8 e4m3
//   k/v_scale    [num_pages, page_size, kv_heads] float32        fp8 only: value = fp8 * scale
//   block_table  int32 [batch, bt_stride]: page ids; entries past ceil(len / page_size) unread
//   seq_lens     int32 [batch]; a length <= 0 gives an output of zeros
//   o_partial    float32 [batch, q_heads, num_splits, head_dim]  (num_splits > 1 only)
//   lse_partial  float32 [batch, q_heads, num_splits]            log2-domain LSE of a split
//   counters     int32 [batch, kv_heads * q_tiles]: zero between calls; written only by the
//                CTAs of one (sequence, head tile), and put back to zero by the last of them
//
// Protocol. Grid (num_splits, kv_heads * q_tiles, batch), 128 threads. CTA (s, h, b) takes the
// s-th of num_splits equal runs of 16-token slabs of sequence b (a slab never crosses a page:
// page_size is a multiple of 16), for the <= 16 query heads of tile h that share one kv head
// (GQA packing: the K/V tiles are read once for all of them). Lengths are read on the device,
// so one captured graph replays with new lengths and block tables. Each warp streams its own
// slabs (slab i of the CTA goes to warp i % 4) through a private ring of kStages cp.async
// buffers (zero-filled past the sequence end, so unused cache memory never enters the sums);
// S = Q K^T and O += P V run on m16n8k16 tensor-core MMAs with fp32 accumulation, query heads
// as the 16 MMA rows, with an online softmax in the exp2 domain. The four warps merge their
// (m, l, O) in shared memory. With one split the CTA writes the output; otherwise it writes
// its normalised O and LSE to the workspace, and the last CTA of the (sequence, head tile) to
// arrive (a device-scope counter) merges all splits in split order. Every sum runs in a fixed
// order, so results are bitwise identical run to run and graph replay equals eager.
//
// FP8 KV: each warp converts its slab to fp16 in shared memory (e4m3 -> fp16 is exact), the
// MMAs run in fp16 (q converted to fp16: |q| must stay below 65504), k_scale multiplies the
// scores and v_scale the probabilities of each token.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "fusedist/mma.cuh"

namespace fusedist {
namespace attention {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeSlab = 16;        // tokens per slab (one MMA k-step of P V)
constexpr int kDecodeTileHeads = 16;   // query heads per CTA (the MMA's 16 rows)
constexpr int kDecodeMaxSplits = 128;  // the merge keeps [16][splits] weights in shared memory

struct DecodeParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const float* k_scale;
  const float* v_scale;
  const int* block_table;
  const int* seq_lens;
  void* out;
  float* o_partial;
  float* lse_partial;
  int* counters;
  int batch, q_heads, kv_heads, group, q_tiles, page_size, bt_stride, num_splits;
  float scale_log2;  // softmax scale * log2(e)
};

template <int D, typename QT, typename KVT>
struct DecodeTraits {
  static constexpr bool kFp8 = std::is_same<KVT, __nv_fp8_e4m3>::value;
  // The MMA's input type: q's type, or fp16 when the cache is fp8.
  using MT = typename std::conditional<kFp8, __half, QT>::type;
  static constexpr int kRowBytes = D * int(sizeof(KVT));  // one cache row (token, head)
  static constexpr int kRow16 = D * 2;                     // one 16-bit row in shared memory
  static constexpr int kSlabBytes = kDecodeSlab * kRowBytes;
  static constexpr int kStageBytes = 2 * kSlabBytes + (kFp8 ? 2 * kDecodeSlab * 4 : 0);
  static constexpr int kStages = D >= 256 ? 3 : (D >= 128 ? 3 : 4);
  static constexpr int kConvBytes = kFp8 ? 2 * kDecodeSlab * kRow16 : 0;
  static constexpr int kWarpBytes = kStages * kStageBytes + kConvBytes;
  static constexpr int kMergeBytes =
      kDecodeWarps * kDecodeTileHeads * (D + 2) * 4;  // per-warp O rows + (m, l)
  static constexpr int kSplitBytes = kDecodeTileHeads * (kDecodeMaxSplits + 1) * 4;
  static constexpr int kSmemBytes =
      (kDecodeWarps * kWarpBytes > kMergeBytes + kSplitBytes ? kDecodeWarps * kWarpBytes
                                                             : kMergeBytes + kSplitBytes);
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
};

// Chunk c of row r of a 16-bit slab (rows of D / 8 >= 8 chunks) sits at c ^ h(r), h(r) =
// (r & 1) << 2 | (r >> 1) & 3: the K fragment loads (rows 2k, 2k + 1, chunks 4 blk .. 4 blk + 3
// per quarter warp) and the V ldmatrix (8 consecutive rows, one chunk) are both conflict-free.
__device__ __forceinline__ int slab_swz(int r, int c) {
  return c ^ (((r & 1) << 2) | ((r >> 1) & 3));
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t w);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t w) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t w) {
  return __half22float2(*reinterpret_cast<__half2*>(&w));
}

// Two e4m3 bytes (low 16 bits of w, or high) -> fp16x2 (sm_89+: one cvt.rn.f16x2.e4m3x2).
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint16_t w) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

template <typename OT>
__device__ __forceinline__ OT from_f32(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

template <int D, typename QT, typename KVT>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Tr = DecodeTraits<D, QT, KVT>;
  using MT = typename Tr::MT;
  constexpr bool kFp8 = Tr::kFp8;
  constexpr int kStages = Tr::kStages;
  constexpr int kBlk = D / 32;   // 32-dim blocks of q / K (two MMA k-steps each)
  constexpr int kNt = D / 8;     // n-tiles of O
  extern __shared__ __align__(128) unsigned char smem[];

  const int split = blockIdx.x;
  const int tile_id = blockIdx.y;  // kv_head * q_tiles + q_tile
  const int b = blockIdx.z;
  const int kvh = tile_id / p.q_tiles;
  const int qt = tile_id - kvh * p.q_tiles;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const int head0 = kvh * p.group + qt * kDecodeTileHeads;  // first q head of this tile
  const int rows = min(kDecodeTileHeads, p.group - qt * kDecodeTileHeads);

  const int len = max(__ldg(p.seq_lens + b), 0);
  const int nslab = (len + kDecodeSlab - 1) / kDecodeSlab;
  const int per_split = (nslab + p.num_splits - 1) / p.num_splits;
  const int s_begin = min(split * per_split, nslab);
  const int s_end = min(s_begin + per_split, nslab);
  // This warp's slabs: s_begin + warp + i * kDecodeWarps, i < n_mine.
  const int n_mine = s_end - s_begin > warp
                         ? (s_end - s_begin - warp + kDecodeWarps - 1) / kDecodeWarps
                         : 0;

  // ---- q fragments (dims permuted identically in q and K: the MMA sums over all of them) ----
  // k-step 2 blk + js, lane (g, q4): a0/a2 = row g dims 32 blk + 8 q4 + 4 js + {0,1}/{2,3},
  // a1/a3 = the same for row g + 8.
  uint32_t qa[2 * kBlk][4];
  {
    const QT* qb = static_cast<const QT*>(p.q) + (int64_t(b) * p.q_heads + head0) * D;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = g + 8 * half;
#pragma unroll
      for (int blk = 0; blk < kBlk; ++blk) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (row < rows)
          v = __ldg(reinterpret_cast<const uint4*>(qb + int64_t(row) * D + blk * 32 + q4 * 8));
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
        if (!std::is_same<MT, QT>::value) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float2 f = unpack2<QT>(w[i]);
            w[i] = pack2<MT>(f.x, f.y);
          }
        }
        qa[2 * blk][half] = w[0];
        qa[2 * blk][2 + half] = w[1];
        qa[2 * blk + 1][half] = w[2];
        qa[2 * blk + 1][2 + half] = w[3];
      }
    }
  }

  unsigned char* wbase = smem + warp * Tr::kWarpBytes;
  const int* bt = p.block_table + int64_t(b) * p.bt_stride;
  const int64_t tok_stride = int64_t(p.kv_heads) * D;  // elements between tokens of one page
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);

  auto page_of = [&](int i) -> int {  // page id of this warp's i-th slab (0 when none)
    if (i >= n_mine) return 0;
    const int tok0 = (s_begin + warp + i * kDecodeWarps) * kDecodeSlab;
    return __ldg(bt + tok0 / p.page_size);
  };
  int next_page = page_of(0);

  // Issue the copies of this warp's slab i into stage i % kStages; always one commit group.
  auto issue = [&](int i) {
    const int page = next_page;
    next_page = page_of(i + 1);  // one slab ahead: its latency hides behind this slab's copies
    if (i < n_mine) {
      const int tok0 = (s_begin + warp + i * kDecodeWarps) * kDecodeSlab;
      const int64_t row0 = (int64_t(page) * p.page_size + tok0 % p.page_size) * tok_stride +
                           int64_t(kvh) * D;  // element offset of (tok0, kvh)
      unsigned char* st = wbase + (i % kStages) * Tr::kStageBytes;
      const uint32_t kdst = smem_addr(st), vdst = smem_addr(st + Tr::kSlabBytes);
      constexpr int kChunksRow = Tr::kRowBytes / 16;
      constexpr int kPerLane = kDecodeSlab * kChunksRow / 32;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int c = lane + 32 * j;
        const int r = c / kChunksRow, cc = c % kChunksRow;
        const bool ok = tok0 + r < len;
        const int64_t off = (row0 + r * tok_stride) * int64_t(sizeof(KVT)) + cc * 16;
        const uint32_t so = uint32_t(r * Tr::kRowBytes + (kFp8 ? cc : slab_swz(r, cc)) * 16);
        cp_async16(kdst + so, ok ? kc + off : kc, ok ? 16 : 0);
        cp_async16(vdst + so, ok ? vc + off : vc, ok ? 16 : 0);
      }
      if (kFp8) {
        const int r = lane & 15;
        const bool ok = tok0 + r < len;
        const float* sc = lane < 16 ? p.k_scale : p.v_scale;
        const int64_t off = (int64_t(page) * p.page_size + tok0 % p.page_size + r) * p.kv_heads + kvh;
        cp_async4(smem_addr(st + 2 * Tr::kSlabBytes + lane * 4), ok ? sc + off : sc, ok ? 4 : 0);
      }
    }
    cp_async_commit();
  };

  float o[kNt][4];
#pragma unroll
  for (int n = 0; n < kNt; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  for (int i = 0; i < n_mine; ++i) {
    __syncwarp();  // every lane is done reading the stage that slab i + kStages - 1 reuses
    issue(i + kStages - 1);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    unsigned char* st = wbase + (i % kStages) * Tr::kStageBytes;
    const unsigned char* kb = st;
    const unsigned char* vb = st + Tr::kSlabBytes;
    const float* ksc = reinterpret_cast<const float*>(st + 2 * Tr::kSlabBytes);
    if (kFp8) {  // e4m3 slab -> fp16 slab (swizzled 16-bit layout), warp-local
      unsigned char* conv = wbase + kStages * Tr::kStageBytes;
      constexpr int kChunks = kDecodeSlab * Tr::kRowBytes / 16;  // 16 fp8 each
#pragma unroll
      for (int kv = 0; kv < 2; ++kv) {
        const unsigned char* src = kv ? vb : kb;
        unsigned char* dst = conv + kv * kDecodeSlab * Tr::kRow16;
#pragma unroll
        for (int j = 0; j < kChunks / 32; ++j) {
          const int c = lane + 32 * j;
          const int r = c / (Tr::kRowBytes / 16), cc = c % (Tr::kRowBytes / 16);
          const uint4 w = *reinterpret_cast<const uint4*>(src + c * 16);
          const uint32_t in[4] = {w.x, w.y, w.z, w.w};
          uint32_t h[8];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            h[2 * e] = fp8x2_to_half2(uint16_t(in[e] & 0xffff));
            h[2 * e + 1] = fp8x2_to_half2(uint16_t(in[e] >> 16));
          }
          *reinterpret_cast<uint4*>(dst + r * Tr::kRow16 + slab_swz(r, 2 * cc) * 16) =
              make_uint4(h[0], h[1], h[2], h[3]);
          *reinterpret_cast<uint4*>(dst + r * Tr::kRow16 + slab_swz(r, 2 * cc + 1) * 16) =
              make_uint4(h[4], h[5], h[6], h[7]);
        }
      }
      __syncwarp();
      kb = conv;
      vb = conv + kDecodeSlab * Tr::kRow16;
    }
    const int tok0 = (s_begin + warp + i * kDecodeWarps) * kDecodeSlab;

    // ---- S = Q K^T: 16 heads x 16 tokens, two n-tiles of 8 tokens ----
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const int r = nt * 8 + g;
#pragma unroll
      for (int blk = 0; blk < kBlk; ++blk) {
        const uint4 kv =
            *reinterpret_cast<const uint4*>(kb + r * Tr::kRow16 + slab_swz(r, blk * 4 + q4) * 16);
        mma_16816<MT>(s[nt], qa[2 * blk], kv.x, kv.y);
        mma_16816<MT>(s[nt], qa[2 * blk + 1], kv.z, kv.w);
      }
    }
    // scale, per-token k scale, mask past the end; lane holds tokens nt*8 + 2 q4 + {0,1}
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = nt * 8 + 2 * q4 + e;
        float f = p.scale_log2;
        if (kFp8) f *= ksc[t];
        const bool ok = tok0 + t < len;
        s[nt][e] = ok ? s[nt][e] * f : -INFINITY;
        s[nt][2 + e] = ok ? s[nt][2 + e] * f : -INFINITY;
      }
    // ---- online softmax (rows g and g + 8) ----
    float pr[2][4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = fmaxf(fmaxf(s[0][2 * hf], s[0][2 * hf + 1]), fmaxf(s[1][2 * hf], s[1][2 * hf + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[hf], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_run[hf] - m_use);
      m_run[hf] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = exp2f(s[nt][2 * hf + e] - m_use);
          pr[nt][2 * hf + e] = v;
          sum += v;
        }
      l_run[hf] = l_run[hf] * alpha + sum;
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
        o[n][2 * hf] *= alpha;
        o[n][2 * hf + 1] *= alpha;
      }
    }
    if (kFp8) {
      const float* vsc = ksc + kDecodeSlab;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float f = vsc[nt * 8 + 2 * q4 + e];
          pr[nt][e] *= f;
          pr[nt][2 + e] *= f;
        }
    }
    uint32_t pa[4];
    pa[0] = pack2<MT>(pr[0][0], pr[0][1]);
    pa[1] = pack2<MT>(pr[0][2], pr[0][3]);
    pa[2] = pack2<MT>(pr[1][0], pr[1][1]);
    pa[3] = pack2<MT>(pr[1][2], pr[1][3]);
    // ---- O += P V: V [16 tokens][D] through ldmatrix.trans, two n-tiles per load ----
    {
      const int mi = lane >> 3, ri = lane & 7;
      const int r = (mi & 1) * 8 + ri;
      const uint32_t vrow = smem_addr(vb + r * Tr::kRow16);
#pragma unroll
      for (int db = 0; db < D / 16; ++db) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, vrow + slab_swz(r, 2 * db + (mi >> 1)) * 16);
        mma_16816<MT>(o[2 * db], pa, bv[0], bv[1]);
        mma_16816<MT>(o[2 * db + 1], pa, bv[2], bv[3]);
      }
    }
  }
  cp_async_wait<0>();

  // ---- merge the four warps ----
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    l_run[hf] += __shfl_xor_sync(0xffffffffu, l_run[hf], 1);
    l_run[hf] += __shfl_xor_sync(0xffffffffu, l_run[hf], 2);
  }
  __syncthreads();  // stage buffers are free
  float* sm_o = reinterpret_cast<float*>(smem);                        // [warps][16][D]
  float* sm_ml = sm_o + kDecodeWarps * kDecodeTileHeads * D;           // [warps][16][2]
  float* sm_w = sm_ml + kDecodeWarps * kDecodeTileHeads * 2;           // [16][splits + 1]
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = g + 8 * hf;
    if (row < rows) {
      float* dst = sm_o + (warp * kDecodeTileHeads + row) * D;
#pragma unroll
      for (int n = 0; n < kNt; ++n)
        *reinterpret_cast<float2*>(dst + n * 8 + 2 * q4) = make_float2(o[n][2 * hf], o[n][2 * hf + 1]);
      if (q4 == 0) {
        sm_ml[(warp * kDecodeTileHeads + row) * 2] = m_run[hf];
        sm_ml[(warp * kDecodeTileHeads + row) * 2 + 1] = l_run[hf];
      }
    }
  }
  __syncthreads();

  const bool direct = p.num_splits == 1;
  for (int idx = threadIdx.x; idx < rows * (D / 4); idx += kDecodeThreads) {
    const int row = idx / (D / 4), d = (idx % (D / 4)) * 4;
    float mw[kDecodeWarps], M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      mw[w] = sm_ml[(w * kDecodeTileHeads + row) * 2];
      M = fmaxf(M, mw[w]);
    }
    float L = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float f = exp2f(mw[w] - M);
        L += f * sm_ml[(w * kDecodeTileHeads + row) * 2 + 1];
        const float4 v = *reinterpret_cast<const float4*>(sm_o + (w * kDecodeTileHeads + row) * D + d);
        acc.x += f * v.x, acc.y += f * v.y, acc.z += f * v.z, acc.w += f * v.w;
      }
      const float inv = 1.f / L;
      acc.x *= inv, acc.y *= inv, acc.z *= inv, acc.w *= inv;
    }
    const int64_t qrow = int64_t(b) * p.q_heads + head0 + row;
    if (direct) {
      QT* out = static_cast<QT*>(p.out) + qrow * D + d;
      out[0] = from_f32<QT>(acc.x), out[1] = from_f32<QT>(acc.y);
      out[2] = from_f32<QT>(acc.z), out[3] = from_f32<QT>(acc.w);
    } else {
      *reinterpret_cast<float4*>(p.o_partial + (qrow * p.num_splits + split) * D + d) = acc;
      if (d == 0) p.lse_partial[qrow * p.num_splits + split] = M == -INFINITY ? -INFINITY : M + __log2f(L);
    }
  }
  if (direct) return;

  // ---- split merge by the last CTA of this (sequence, head tile) ----
  __shared__ int is_last;
  __threadfence();  // this CTA's partials are visible device-wide before it is counted
  __syncthreads();
  int* counter = p.counters + int64_t(b) * gridDim.y + tile_id;
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(counter, 1);
    is_last = prev == p.num_splits - 1;
    if (is_last) *counter = 0;  // ready for the next call (every CTA of this tile has counted)
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int S = p.num_splits;
  // weights: one warp per row, fixed lane-strided order then a fixed shuffle tree
  for (int row = warp; row < rows; row += kDecodeWarps) {
    const int64_t qrow = int64_t(b) * p.q_heads + head0 + row;
    float M = -INFINITY;
    for (int sI = lane; sI < S; sI += 32) {
      const float v = __ldcg(p.lse_partial + qrow * S + sI);
      sm_w[row * (kDecodeMaxSplits + 1) + sI] = v;
      M = fmaxf(M, v);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float W = 0.f;
    for (int sI = lane; sI < S; sI += 32) {
      const float v = sm_w[row * (kDecodeMaxSplits + 1) + sI];
      const float w = M == -INFINITY ? 0.f : exp2f(v - M);
      sm_w[row * (kDecodeMaxSplits + 1) + sI] = w;
      W += w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) W += __shfl_xor_sync(0xffffffffu, W, off);
    __syncwarp();
    const float inv = W > 0.f ? 1.f / W : 0.f;
    for (int sI = lane; sI < S; sI += 32) sm_w[row * (kDecodeMaxSplits + 1) + sI] *= inv;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < rows * (D / 4); idx += kDecodeThreads) {
    const int row = idx / (D / 4), d = (idx % (D / 4)) * 4;
    const int64_t qrow = int64_t(b) * p.q_heads + head0 + row;
    const float* src = p.o_partial + qrow * S * D + d;
    const float* w = sm_w + row * (kDecodeMaxSplits + 1);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int sI = 0; sI < S; ++sI) {
      const float ws = w[sI];
      const float4 v = __ldcg(reinterpret_cast<const float4*>(src + int64_t(sI) * D));
      if (ws != 0.f) acc.x += ws * v.x, acc.y += ws * v.y, acc.z += ws * v.z, acc.w += ws * v.w;
    }
    QT* out = static_cast<QT*>(p.out) + qrow * D + d;
    out[0] = from_f32<QT>(acc.x), out[1] = from_f32<QT>(acc.y);
    out[2] = from_f32<QT>(acc.z), out[3] = from_f32<QT>(acc.w);
  }
}

}  // namespace attention
}  // namespace fusedist
