// fusedist/attention/decode.cuh -- paged split-KV decode attention (flash-decoding) for sm_90.
//
// One new query token per sequence attends to the seq_lens[b] tokens of its paged KV cache.
//
// Layouts (docs/design/attention.md):
//   q, out       [batch, q_heads, head_dim]                      bf16 / fp16, contiguous
//   k/v_cache    [num_pages, page_size, kv_heads, head_dim]      bf16 / fp16 / fp8 e4m3
//   k/v_scale    [num_pages, page_size, kv_heads] float32        fp8 only: value = fp8 * scale
//   block_table  int32 [batch, bt_stride], bt_cols <= bt_stride columns used: page ids in
//                [0, num_pages); entries past ceil(len / page_size) unread
//   seq_lens     int32 [batch] in [0, bt_cols * page_size]; a length of 0 gives zeros
//   o_partial    float32 [batch, q_heads, num_splits, head_dim]  (num_splits > 1 only)
//   lse_partial  float32 [batch, q_heads, num_splits]            log2-domain LSE of a split
//   counters     int32 [batch, kv_heads * q_tiles]: zero between calls; written only by the
//                CTAs of one (sequence, head tile), and put back to zero by the last of them
//
// Protocol. Grid (num_splits, kv_heads * q_tiles, batch), 128 threads. CTA (s, h, b) takes the
// s-th of num_splits equal runs of 16-token slabs of sequence b (a slab never crosses a page:
// page_size is a multiple of 16), for the <= 8 query heads of tile h that share one kv head
// (GQA packing: the K/V tiles are read once for all of them). Lengths are read on the device,
// so one captured graph replays with new lengths and block tables. Each warp streams its own
// slabs (slab i of the CTA goes to warp i % 4) through a private ring of kStages cp.async
// buffers (zero-filled past the sequence end, so unused cache memory never enters the sums).
// The MMAs (m16n8k16, fp32 accumulation) put the 16 tokens of a slab on the M side and the
// 8 heads on N: S^T = K q^T (K through ldmatrix), an online softmax per head in the exp2
// domain, then O^T += V^T P^T (V through ldmatrix.trans, P^T transposed in registers by
// movmatrix). The four warps merge their (m, l, O) in shared memory. With one split the CTA
// writes the output. Otherwise the splits of a (sequence, head tile) are merged in split
// order, in one of two ways. Cluster merge (p.cluster, 2 .. kDecodeMaxClusterSplits splits:
// the grid's splits of a tile are one thread-block cluster): each CTA leaves its normalised O
// and LSE in its own shared memory, and after a cluster barrier every CTA computes the split
// weights and writes its share of the tile's output from all CTAs' shared memory (no global
// round trip). Workspace merge: each CTA writes its normalised O and LSE to the workspace,
// and the last CTA of the tile to arrive (a device-scope counter) merges all splits. Every
// sum runs in a fixed order, so results are bitwise identical run to run and graph replay
// equals eager.
//
// Bad metadata (op_error.h): a length outside [0, bt_cols * page_size] reads nothing, a page id
// outside [0, num_pages) reads page 0 instead; either is recorded in p.err and poisons the
// row's output with NaN (a bad split writes NaN partials; the merge poisons the row when any
// split's LSE is NaN). No access ever leaves the tensors.
//
// FP8 KV: each warp converts its slab to fp16 in shared memory (e4m3 -> fp16 is exact), the
// MMAs run in fp16 (q converted to fp16: |q| must stay below 65504), k_scale multiplies the
// scores and v_scale the probabilities of each token (p * v_scale is rounded to fp16: scales
// below ~1e-4 lose precision to fp16 subnormals).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "fusedist/common/cluster.cuh"
#include "fusedist/common/mma.cuh"
#include "fusedist/common/op_error.h"
#include "fusedist/common/signals.cuh"

namespace fusedist {
namespace attention {

#ifndef FUSEDIST_DECODE_WARPS
#define FUSEDIST_DECODE_WARPS 4
#endif
constexpr int kDecodeThreads = 32 * FUSEDIST_DECODE_WARPS;

constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeSlab = 16;        // tokens per slab (one MMA k-step of P V)
constexpr int kDecodeTileHeads = 8;    // query heads per CTA (the MMA's 8 columns)
constexpr int kDecodeMaxSplits = 128;  // the merge keeps [16][splits] weights in shared memory
constexpr int kDecodeMaxClusterSplits = 16;  // the cluster merge: one (non-portable) cluster

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
  int bt_cols, num_pages;  // the valid block-table columns and page ids
  float scale_log2;        // softmax scale * log2(e)
  OpErrorRecord* err;      // bad metadata is recorded here (null: not recorded)
  int cluster;             // 1: launched with clusters of num_splits CTAs (the cluster merge)
};

// Chunk c of row r of a 16-bit slab (rows of D / 8 >= 8 chunks) sits at c ^ h(r), h(r) =
// (r & 1) << 2 | (r >> 1) & 3: the K fragment loads (rows 2k, 2k + 1, chunks 4 blk .. 4 blk + 3
// per quarter warp) and the V ldmatrix (8 consecutive rows, one chunk) are both conflict-free.
__device__ __forceinline__ int slab_swz(int r, int c) {
  return c ^ (((r & 1) << 2) | ((r >> 1) & 3));
}

// kStagesReq: the cp.async ring depth per warp (0: the default below). An FP8 cache also has a
// 2-stage instantiation: 66 KB of shared memory per CTA at head_dim 128 instead of 83 KB, so
// 3 CTAs fit an SM instead of 2 (more warps in flight for a per-warp latency-bound slab loop).
// kDirectReq (FP8 only): the MMA fragments come from the e4m3 stage itself through ldmatrix
// and are converted in registers (no fp16 copy of the slab in shared memory: 51 KB per CTA at
// head_dim 128). K's fragments then hold 4 consecutive dims per lane, so the S^T MMA's k order
// is permuted (q's fragments follow the same permutation); V^T's rows come out as dims
// 2g / 2g + 1 of each 16 (byte permutes of the transposed load), so O^T's rows are permuted
// the same way and the merge writes them back in order.
template <int D, typename QT, typename KVT, int kStagesReq = 0, bool kDirectReq = false>
struct DecodeTraits {
  static constexpr bool kFp8 = std::is_same<KVT, __nv_fp8_e4m3>::value;
  static constexpr bool kDirect = kDirectReq;
  static_assert(!kDirectReq || kFp8, "the direct fragment path is for FP8 caches");
  // The MMA's input type: q's type, or fp16 when the cache is fp8.
  using MT = typename std::conditional<kFp8, __half, QT>::type;
  static constexpr int kRowBytes = D * int(sizeof(KVT));  // one cache row (token, head)
  static constexpr int kRow16 = D * 2;                     // one 16-bit row
  static constexpr int kSlabBytes = kDecodeSlab * kRowBytes;
  // No L2 prefetch hint: measured 4-5% faster than L2::256B at batch 64 (benchmarks/NOTES.md).
#ifdef FUSEDIST_DECODE_PREFETCH
  static constexpr int kPrefetch = FUSEDIST_DECODE_PREFETCH;
#else
  static constexpr int kPrefetch = 0;
#endif
  // Byte offset of 16-byte chunk c of row r: in a stage's raw rows (fp8 rows unswizzled when
  // the conversion reads them row-contiguously; swizzled for the direct path's ldmatrix: the 8
  // rows one 8x8 load reads land in 8 distinct 16-byte bank groups), and in a 16-bit slab.
  __device__ static int fp8_swz(int r, int c) {
    return D == 64 ? c ^ ((r >> 1) & 3) : ((c & ~7) | ((c ^ r) & 7));
  }
  __device__ static int stage_off(int r, int c) {
    return r * kRowBytes + (kDirect ? fp8_swz(r, c) : (kFp8 ? c : slab_swz(r, c))) * 16;
  }
  __device__ static int c16_off(int r, int c) { return r * kRow16 + slab_swz(r, c) * 16; }
  static constexpr int kStageBytes = 2 * kSlabBytes + (kFp8 ? 2 * kDecodeSlab * 4 : 0);
#ifdef FUSEDIST_DECODE_STAGES
  static constexpr int kStages = kStagesReq > 0 ? kStagesReq : FUSEDIST_DECODE_STAGES;
#else
  static constexpr int kStages = kStagesReq > 0 ? kStagesReq : (D >= 256 ? 3 : (D >= 128 ? 3 : 4));
#endif
  static constexpr int kConvBytes = kFp8 && !kDirect ? 2 * kDecodeSlab * kRow16 : 0;
  static constexpr int kWarpBytes = kStages * kStageBytes + kConvBytes;
  static constexpr int kMergeBytes =
      kDecodeWarps * kDecodeTileHeads * (D + 2) * 4;  // per-warp O rows + (m, l)
  static constexpr int kSplitBytes = kDecodeTileHeads * (kDecodeMaxSplits + 1) * 4;
  // the cluster merge: this split's normalised O [8][D] and LSE [8], read by the cluster
  static constexpr int kPartBytes = kDecodeTileHeads * (D + 1) * 4;
  static constexpr int kMergeAll = kMergeBytes + kSplitBytes + kPartBytes;
  static constexpr int kSmemBytes =
      kDecodeWarps * kWarpBytes > kMergeAll ? kDecodeWarps * kWarpBytes : kMergeAll;
  static_assert((kMergeBytes + kSplitBytes) % 16 == 0, "the cluster part is float4-aligned");
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
};

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

// 2^x in one MUFU.EX2 (ex2.approx.ftz: max 2 ulp, results below 2^-126 flush to 0); exp2f
// without fast math adds a denormal-range fixup around it. For softmax terms, where a term
// below 2^-126 of the row maximum is 0 to fp32 sums anyway.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two e4m3 bytes (low 16 bits of w, or high) -> fp16x2 (sm_89+: one cvt.rn.f16x2.e4m3x2).
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint16_t w) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// Transpose an 8x8 b16 matrix held in the accumulator layout (lane 4 r + c: row r, columns
// 2c, 2c + 1) across the warp.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// 16-byte cp.async (.cg: L2 only) with an L2 prefetch size: 256 fetches the aligned 256 bytes
// around the chunk, 128 the 128, 0 gives no hint (the default: every byte of a slab's rows is
// requested anyway, and a cache row of 128 bytes sits next to another head's row).
template <int kPrefetch>
__device__ __forceinline__ void cp_async16_l2(uint32_t dst, const void* src, uint32_t src_bytes) {
  if (kPrefetch == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
  else if (kPrefetch == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
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

template <int D, typename QT, typename KVT, int kStagesReq = 0, bool kDirectReq = false>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Tr = DecodeTraits<D, QT, KVT, kStagesReq, kDirectReq>;
  constexpr bool kDirect = Tr::kDirect;
  using MT = typename Tr::MT;
  constexpr bool kFp8 = Tr::kFp8;
  constexpr int kStages = Tr::kStages;
  constexpr int kKs = D / 16;    // MMA k-steps of S = K q^T, and m-tiles of O^T = V^T P^T
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

  pdl_wait();  // q, the cache and the workspace may belong to the previous kernel
  const int raw_len = __ldg(p.seq_lens + b);
  const int max_len = p.bt_cols * p.page_size;
  bool bad = raw_len < 0 || raw_len > max_len;  // block-uniform
  if (bad && threadIdx.x == 0)
    record_op_error(p.err, kOpErrDecode, kOpErrSeqLen, b, -1, raw_len, max_len);
  const int len = bad ? 0 : raw_len;  // a bad length reads nothing
  const int nslab = (len + kDecodeSlab - 1) / kDecodeSlab;
  const int per_split = (nslab + p.num_splits - 1) / p.num_splits;
  const int s_begin = min(split * per_split, nslab);
  const int s_end = min(s_begin + per_split, nslab);
  // This warp's slabs: s_begin + warp + i * kDecodeWarps, i < n_mine.
  const int n_mine = s_end - s_begin > warp
                         ? (s_end - s_begin - warp + kDecodeWarps - 1) / kDecodeWarps
                         : 0;

  // ---- q as the MMA's B operand (n = 8 heads): b0 = q[g][16 ks + 2 q4 ..], b1 = .. + 8 ----
  uint32_t qf[kKs][2];
  {
    const QT* qb = static_cast<const QT*>(p.q) + (int64_t(b) * p.q_heads + head0) * D;
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(qb + int64_t(g) * D);
#pragma unroll
    for (int ks = 0; ks < kKs; ++ks)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        // direct FP8 path: the permuted k order (dims 4 q4, 4 q4 + 1 | 4 q4 + 2, 4 q4 + 3)
        const int word = kDirect ? ks * 8 + 2 * q4 + hi : ks * 8 + hi * 4 + q4;
        uint32_t w = g < rows ? __ldg(qr + word) : 0u;
        if (!std::is_same<MT, QT>::value) {
          const float2 f = unpack2<QT>(w);
          w = pack2<MT>(f.x, f.y);
        }
        qf[ks][hi] = w;
      }
  }

  unsigned char* wbase = smem + warp * Tr::kWarpBytes;

  const int* bt = p.block_table + int64_t(b) * p.bt_stride;
  const int64_t tok_stride = int64_t(p.kv_heads) * D;  // elements between tokens of one page
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);

  // Page id of this warp's i-th slab (0 when none; a page id outside the cache reads page 0,
  // is recorded, and marks the row bad). Warp-uniform: every lane loads the same entry.
  auto page_of = [&](int i) -> int {
    if (i >= n_mine) return 0;
    const int tok0 = (s_begin + warp + i * kDecodeWarps) * kDecodeSlab;
    const int col = tok0 / p.page_size;
    const int page = __ldg(bt + col);
    if (static_cast<unsigned>(page) < static_cast<unsigned>(p.num_pages)) return page;
    bad = true;
    if (lane == 0) record_op_error(p.err, kOpErrDecode, kOpErrPage, b, col, page, p.num_pages);
    return 0;
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
      {
        const uint32_t kdst = smem_addr(st), vdst = smem_addr(st + Tr::kSlabBytes);
        constexpr int kChunksRow = Tr::kRowBytes / 16;
        constexpr int kPerLane = kDecodeSlab * kChunksRow / 32;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          const int c = lane + 32 * j;
          const int r = c / kChunksRow, cc = c % kChunksRow;
          const bool ok = tok0 + r < len;
          const int64_t off = (row0 + r * tok_stride) * int64_t(sizeof(KVT)) + cc * 16;
          const uint32_t so = uint32_t(Tr::stage_off(r, cc));
          cp_async16_l2<Tr::kPrefetch>(kdst + so, ok ? kc + off : kc, ok ? 16 : 0);
          cp_async16_l2<Tr::kPrefetch>(vdst + so, ok ? vc + off : vc, ok ? 16 : 0);
        }
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

  // O^T [D x 8 heads]: o[mt] = rows (dims) 16 mt + g, + 8; columns (heads) 2 q4, 2 q4 + 1
  float o[kKs][4];
#pragma unroll
  for (int n = 0; n < kKs; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // heads 2 q4, 2 q4 + 1

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
    if (kFp8 && !kDirect) {  // e4m3 slab -> fp16 slab (swizzled 16-bit layout), warp-local
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
          const uint4 w = *reinterpret_cast<const uint4*>(src + Tr::stage_off(r, cc));
          const uint32_t in[4] = {w.x, w.y, w.z, w.w};
          uint32_t h[8];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            h[2 * e] = fp8x2_to_half2(uint16_t(in[e] & 0xffff));
            h[2 * e + 1] = fp8x2_to_half2(uint16_t(in[e] >> 16));
          }
          *reinterpret_cast<uint4*>(dst + Tr::c16_off(r, 2 * cc)) =
              make_uint4(h[0], h[1], h[2], h[3]);
          *reinterpret_cast<uint4*>(dst + Tr::c16_off(r, 2 * cc + 1)) =
              make_uint4(h[4], h[5], h[6], h[7]);
        }
      }
      __syncwarp();
      kb = conv;
      vb = conv + kDecodeSlab * Tr::kRow16;
    }
    const int tok0 = (s_begin + warp + i * kDecodeWarps) * kDecodeSlab;

    // ---- S^T = K q^T: 16 tokens (MMA rows) x 8 heads, K through ldmatrix ----
    // ldmatrix lane address: 8x8 matrix mi = lane / 8 holds rows (mi & 1) * 8 + lane % 8 and
    // chunk 2 ks + (mi >> 1) for K (a0..a3); for V^T rows (mi >> 1) * 8 + lane % 8, chunk
    // 2 mt + (mi & 1) (the transposed load gives a0..a3 of V^T).
    const int mi = lane >> 3, ri = lane & 7;
    float s[4];
    {
      const int r = (mi & 1) * 8 + ri;
      const uint32_t kbase = smem_addr(kb);
      float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};  // two short chains
      uint32_t a[kKs][4];  // every fragment load in flight before the first MMA
      if (kDirect) {
        // one x4 load: k-steps 2 pp (matrices 0, 1: tokens 0-7, 8-15) and 2 pp + 1 (2, 3); each
        // 32-bit word holds dims 4 q4 .. 4 q4 + 3 of its token: a0 / a1 the low pair, a2 / a3
        // the high pair
#pragma unroll
        for (int pp = 0; pp < kKs / 2; ++pp) {
          uint32_t w[4];
          ldmatrix_x4(w, kbase + Tr::stage_off(r, 2 * pp + (mi >> 1)));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            a[2 * pp + h][0] = fp8x2_to_half2(uint16_t(w[2 * h] & 0xffff));
            a[2 * pp + h][2] = fp8x2_to_half2(uint16_t(w[2 * h] >> 16));
            a[2 * pp + h][1] = fp8x2_to_half2(uint16_t(w[2 * h + 1] & 0xffff));
            a[2 * pp + h][3] = fp8x2_to_half2(uint16_t(w[2 * h + 1] >> 16));
          }
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < kKs; ++ks)
          ldmatrix_x4(a[ks], kbase + Tr::c16_off(r, 2 * ks + (mi >> 1)));
      }
#pragma unroll
      for (int ks = 0; ks < kKs; ++ks)
        mma_16816<MT>((ks & 1) ? sb : sa, a[ks], qf[ks][0], qf[ks][1]);
#pragma unroll
      for (int e = 0; e < 4; ++e) s[e] = sa[e] + sb[e];
    }
    // s[0], s[1]: token g, heads 2 q4, 2 q4 + 1; s[2], s[3]: token g + 8
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int t = g + 8 * hi;
      float f = p.scale_log2;
      if (kFp8) f *= ksc[t];
      const bool ok = tok0 + t < len;
      s[2 * hi] = ok ? s[2 * hi] * f : -INFINITY;
      s[2 * hi + 1] = ok ? s[2 * hi + 1] * f : -INFINITY;
    }
    // ---- online softmax per head (column): reduce over the 8 lanes of one q4 ----
    float pr[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = fmaxf(s[e], s[2 + e]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m_run[e], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_run[e] - m_use);
      m_run[e] = m_new;
      pr[e] = exp2f(s[e] - m_use);
      pr[2 + e] = exp2f(s[2 + e] - m_use);
      l_run[e] = l_run[e] * alpha + pr[e] + pr[2 + e];
#pragma unroll
      for (int n = 0; n < kKs; ++n) {
        o[n][e] *= alpha;
        o[n][2 + e] *= alpha;
      }
    }
    if (kFp8) {
      const float* vsc = ksc + kDecodeSlab;
      const float f0 = vsc[g], f1 = vsc[g + 8];
      pr[0] *= f0, pr[1] *= f0, pr[2] *= f1, pr[3] *= f1;
    }
    // P^T [16 tokens x 8 heads] as the B operand of O^T += V^T P^T: transpose the two 8x8
    // halves of the accumulator layout in registers.
    const uint32_t b0 = movmatrix_trans(pack2<MT>(pr[0], pr[1]));
    const uint32_t b1 = movmatrix_trans(pack2<MT>(pr[2], pr[3]));
    if (kDirect) {
      // one transposed x4 load: m-tiles 2 pp (matrices 0, 1: tokens 0-7, 8-15) and 2 pp + 1;
      // a word holds bytes (t 2 q4: dims 2g, 2g + 1 | t 2 q4 + 1: dims 2g, 2g + 1) of its 16
      // dims: bytes 0, 2 are row g (dim 2g), bytes 1, 3 row g + 8 (dim 2g + 1) of O^T
      const int r = (mi & 1) * 8 + ri;
      const uint32_t vbase = smem_addr(vb);
#pragma unroll
      for (int pp = 0; pp < kKs / 2; ++pp) {
        uint32_t w[4];
        ldmatrix_x4_trans(w, vbase + Tr::stage_off(r, 2 * pp + (mi >> 1)));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t a[4];
          a[0] = fp8x2_to_half2(uint16_t(__byte_perm(w[2 * h], 0, 0x20)));
          a[1] = fp8x2_to_half2(uint16_t(__byte_perm(w[2 * h], 0, 0x31)));
          a[2] = fp8x2_to_half2(uint16_t(__byte_perm(w[2 * h + 1], 0, 0x20)));
          a[3] = fp8x2_to_half2(uint16_t(__byte_perm(w[2 * h + 1], 0, 0x31)));
          mma_16816<MT>(o[2 * pp + h], a, b0, b1);
        }
      }
    } else {
      const int r = (mi >> 1) * 8 + ri;
      const uint32_t vbase = smem_addr(vb);
      uint32_t a[kKs][4];
#pragma unroll
      for (int mt = 0; mt < kKs; ++mt)
        ldmatrix_x4_trans(a[mt], vbase + Tr::c16_off(r, 2 * mt + (mi & 1)));
#pragma unroll
      for (int mt = 0; mt < kKs; ++mt) mma_16816<MT>(o[mt], a[mt], b0, b1);
    }
  }
  cp_async_wait<0>();
  pdl_trigger();

  // ---- merge the warps ----
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], off);
  const bool cta_bad = __syncthreads_or(bad);  // stage buffers are free
  const float kNaN = __int_as_float(0x7fffffff);
  float* sm_o = reinterpret_cast<float*>(smem);                        // [warps][8][D]
  float* sm_ml = sm_o + kDecodeWarps * kDecodeTileHeads * D;           // [warps][8][2]
  float* sm_w = sm_ml + kDecodeWarps * kDecodeTileHeads * 2;           // [8][splits + 1]
  float* sm_part = sm_w + kDecodeTileHeads * (kDecodeMaxSplits + 1);   // [8][D] (cluster)
  float* sm_lse = sm_part + kDecodeTileHeads * D;                      // [8] (cluster)
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int row = 2 * q4 + e;
    if (row < rows) {
      float* dst = sm_o + (warp * kDecodeTileHeads + row) * D;
#pragma unroll
      for (int mt = 0; mt < kKs; ++mt) {  // O^T rows g, g + 8: dims g, g + 8 (direct: 2g, 2g + 1)
        dst[mt * 16 + (kDirect ? 2 * g : g)] = o[mt][e];
        dst[mt * 16 + (kDirect ? 2 * g + 1 : g + 8)] = o[mt][2 + e];
      }
      if (g == 0) {
        sm_ml[(warp * kDecodeTileHeads + row) * 2] = m_run[e];
        sm_ml[(warp * kDecodeTileHeads + row) * 2 + 1] = l_run[e];
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
    if (cta_bad) acc = make_float4(kNaN, kNaN, kNaN, kNaN), M = kNaN;
    const float lse = cta_bad ? kNaN : (M == -INFINITY ? -INFINITY : M + __log2f(L));
    if (direct) {
      QT* out = static_cast<QT*>(p.out) + qrow * D + d;
      out[0] = from_f32<QT>(acc.x), out[1] = from_f32<QT>(acc.y);
      out[2] = from_f32<QT>(acc.z), out[3] = from_f32<QT>(acc.w);
    } else if (p.cluster) {
      *reinterpret_cast<float4*>(sm_part + row * D + d) = acc;
      if (d == 0) sm_lse[row] = lse;
    } else {
      *reinterpret_cast<float4*>(p.o_partial + (qrow * p.num_splits + split) * D + d) = acc;
      if (d == 0) p.lse_partial[qrow * p.num_splits + split] = lse;
    }
  }
  if (direct) return;

  // ---- split merge inside the cluster (split = the CTA's rank) ----
  if (p.cluster) {
    const int S = p.num_splits;
    cluster_sync();  // every split's part and LSE are in its shared memory
    const uint32_t part0 = smem_addr(sm_part), lse0 = smem_addr(sm_lse);
    for (int i = threadIdx.x; i < rows * S; i += kDecodeThreads) {
      const int row = i / S, sI = i % S;
      sm_w[row * (kDecodeMaxSplits + 1) + sI] =
          ld_cluster_f32(cluster_map(lse0 + 4 * row, uint32_t(sI)));
    }
    __syncthreads();
    __shared__ int c_row_bad[kDecodeTileHeads];
    if (threadIdx.x < rows) {  // a row's weights, in split order
      float* w = sm_w + threadIdx.x * (kDecodeMaxSplits + 1);
      float M = -INFINITY;
      bool nan_lse = false;
      for (int sI = 0; sI < S; ++sI) M = fmaxf(M, w[sI]), nan_lse |= isnan(w[sI]);
      float W = 0.f;
      for (int sI = 0; sI < S; ++sI) {
        w[sI] = M == -INFINITY ? 0.f : exp2f(w[sI] - M);
        W += w[sI];
      }
      const float inv = W > 0.f ? 1.f / W : 0.f;
      for (int sI = 0; sI < S; ++sI) w[sI] *= inv;
      c_row_bad[threadIdx.x] = nan_lse;
    }
    __syncthreads();
    // this CTA's share of the tile's rows x D / 4 float4 outputs: items split, split + S, ...
    for (int idx = threadIdx.x * S + split; idx < rows * (D / 4); idx += kDecodeThreads * S) {
      const int row = idx / (D / 4), d = (idx % (D / 4)) * 4;
      const float* w = sm_w + row * (kDecodeMaxSplits + 1);
      float4 v[kDecodeMaxClusterSplits];
#pragma unroll
      for (int j = 0; j < kDecodeMaxClusterSplits; ++j)
        if (j < S) v[j] = ld_cluster_f32x4(cluster_map(part0 + 4 * (row * D + d), uint32_t(j)));
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < kDecodeMaxClusterSplits; ++j) {
        if (j < S) {
          const float ws = w[j];
          acc.x += ws * v[j].x, acc.y += ws * v[j].y, acc.z += ws * v[j].z, acc.w += ws * v[j].w;
        }
      }
      if (c_row_bad[row]) acc = make_float4(kNaN, kNaN, kNaN, kNaN);
      QT* out = static_cast<QT*>(p.out) + (int64_t(b) * p.q_heads + head0 + row) * D + d;
      out[0] = from_f32<QT>(acc.x), out[1] = from_f32<QT>(acc.y);
      out[2] = from_f32<QT>(acc.z), out[3] = from_f32<QT>(acc.w);
    }
    cluster_sync();  // the other CTAs are done reading this CTA's shared memory
    return;
  }

  // ---- split merge by the last CTA of this (sequence, head tile) ----
  __shared__ int is_last;
  __shared__ int row_bad[kDecodeTileHeads];  // a split of this row met bad metadata
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
    bool nan_lse = false;
    for (int sI = lane; sI < S; sI += 32) {
      const float v = __ldcg(p.lse_partial + qrow * S + sI);
      sm_w[row * (kDecodeMaxSplits + 1) + sI] = v;
      M = fmaxf(M, v);
      nan_lse |= isnan(v);
    }
    nan_lse = __any_sync(0xffffffffu, nan_lse);
    if (lane == 0) row_bad[row] = nan_lse;
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
    for (int s0 = 0; s0 < S; s0 += 16) {  // 16 loads in flight, then the sums in split order
      float4 v[16];
#pragma unroll
      for (int j = 0; j < 16; ++j)
        v[j] = s0 + j < S ? __ldcg(reinterpret_cast<const float4*>(src + int64_t(s0 + j) * D))
                          : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float ws = s0 + j < S ? w[s0 + j] : 0.f;
        acc.x += ws * v[j].x, acc.y += ws * v[j].y, acc.z += ws * v[j].z, acc.w += ws * v[j].w;
      }
    }
    if (row_bad[row]) acc = make_float4(kNaN, kNaN, kNaN, kNaN);
    QT* out = static_cast<QT*>(p.out) + qrow * D + d;
    out[0] = from_f32<QT>(acc.x), out[1] = from_f32<QT>(acc.y);
    out[2] = from_f32<QT>(acc.z), out[3] = from_f32<QT>(acc.w);
  }
}

}  // namespace attention
}  // namespace fusedist
