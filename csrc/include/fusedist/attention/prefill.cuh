// fusedist/attention/prefill.cuh -- paged chunked-prefill attention for sm_90 (flash-attention 2
// style: tensor cores through mma.sync, or at head_dim 128 through wgmma, the sm_90a default),
// reading K/V straight from the pages.
//
// Sequence b's n_b = cu_seqlens_q[b + 1] - cu_seqlens_q[b] new tokens are the last n_b of its
// seq_lens[b] = L_b cached tokens: new token t attends causally to cached tokens
// [0, L_b - n_b + t].
//
// Layouts (docs/design/attention.md):
//   q            [tokens, q_heads, head_dim], token stride q_stride elements  bf16 / fp16
//   out          [tokens, q_heads, head_dim] contiguous, q's dtype
//   k/v_cache    [num_pages, page_size, kv_heads, head_dim]   q's dtype, or fp8 e4m3
//   k/v_scale    [num_pages, page_size, kv_heads] float32      fp8 only: value = fp8 * scale
//   block_table  int32 [batch, bt_stride], bt_cols columns used; seq_lens int32 [batch];
//   cu_seqlens_q int32 [batch + 1], rising from 0 (rows of out past cu_seqlens_q[batch] that the
//                last sequence's tiles cover are written with zeros: padded token buckets)
//   o_partial    float32 [num_splits, tokens, q_heads, head_dim]   (num_splits > 1 only)
//   lse_partial  float32 [num_splits, tokens, q_heads]   log2-domain LSE of a split's keys
//
// Protocol. Grid (q_tiles * num_splits, kv_heads, batch), 4 or 8 warps of 16 or 32 query rows.
// A CTA takes one kv head and a tile of R = 64 or 128 query rows packed GQA-style: row r is
// token tile_tokens * tile + r / group of q head kv_head * group + r % group (tile_tokens =
// R / group), so each K/V block is read once for every q head that shares it. The CTA walks
// its split's share of the 64-key blocks its rows can see (the causal bound of the tile's last
// token), double-buffered through cp.async with each key's page looked up on the way (any page
// size), zero-filled past the sequence. Per block: S = Q K^T (m16n8k16, fp32), the causal mask
// on the blocks that need it, an online softmax in the exp2 domain, O += P V (P straight from
// the S registers, V through ldmatrix.trans). With one split the CTA writes O / l; otherwise it
// writes O / l and the LSE of its keys, and prefill_merge_kernel combines the splits in split
// order. Lengths and tables are read on the device: one captured graph replays with new ones.
//
// FP8 KV: each block's e4m3 rows are converted to q's 16-bit type in shared memory (e4m3 is exact
// in bf16 and fp16), k_scale multiplies each key's scores and v_scale its probabilities (after
// the row sums, before P is rounded to 16 bits).
//
// Bad metadata (op_error.h): a length outside [0, bt_cols * page_size], a query span outside
// [0, L_b] or past `tokens` or longer than the grid's q_tiles * tile_tokens, or a page id outside
// [0, num_pages) is recorded in p.err; the affected rows are written NaN and pages read as page
// 0 instead. No access leaves the tensors.
#pragma once
#include "fusedist/attention/decode.cuh"
#include "fusedist/common/wgmma.cuh"

namespace fusedist {
namespace attention {

constexpr int kPrefillKeys = 64;   // keys per block
// Query rows per CTA: 16 per m-tile, 1 or 2 m-tiles per warp, 4 or 8 warps. 64 rows (4 warps x
// 1) is the default; 128 rows as 8 warps x 1 (each K/V block loaded once for twice the rows) or
// as 4 warps x 2 (flash-attention 2's shape: each K/V fragment loaded from shared memory once
// for two m-tiles, half the shared-memory traffic per MMA), for prompts long enough to fill the
// GPU with tiles of 128.
constexpr int kPrefillMaxSplits = 64;

struct PrefillParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const float* k_scale;
  const float* v_scale;
  const int* block_table;
  const int* seq_lens;
  const int* cu_seqlens_q;
  void* out;
  float* o_partial;
  float* lse_partial;
  int64_t q_stride;  // elements between tokens of q
  int tokens, batch, q_heads, kv_heads, group, tile_tokens, q_tiles, num_splits;
  int page_size, bt_stride, bt_cols, num_pages;
  int page_shift;  // log2(page_size) when it is a power of two, else -1 (divisions)
  float scale_log2;
  OpErrorRecord* err;
};

template <int D, typename QT, typename KVT, int kWarpsT = 4, int kMTT = 1, bool kWgT = false>
struct PrefillTraits {
  static constexpr int kWarps = kWarpsT;
  // kWg: the two GEMMs on Hopper's warpgroup MMA (wgmma): each group of 4 warps takes 64 query
  // rows, S = Q K^T with Q and K read by the tensor cores from shared memory, O += P V with P
  // from registers and V from shared memory; tiles in wgmma's 128-byte-swizzled layout.
  static constexpr bool kWg = kWgT;
  static_assert(!kWg || kMTT == 1, "wgmma tiles: one m16 tile per warp (64 rows a warpgroup)");
  static constexpr int kMT = kMTT;                // m16 tiles (16 query rows) per warp
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16 * kMT * kWarps;
  static_assert((kWarps == 4 || kWarps == 8) && (kMT == 1 || kMT == 2), "4 or 8 warps, 1 or 2 m-tiles");
  static constexpr bool kFp8 = std::is_same<KVT, __nv_fp8_e4m3>::value;
  static constexpr int kRow16 = D * 2;                     // bytes of a 16-bit row
  static constexpr int kRawRow = D * int(sizeof(KVT));     // bytes of a cache row
  static constexpr int kQBytes = kRows * kRow16;
  static constexpr int kBlock16 = kPrefillKeys * kRow16;   // one 16-bit K or V block
  static constexpr int kRawBlock = kPrefillKeys * kRawRow; // one raw K or V block
  // stage: K block, V block (raw), then for fp8 the 64 k and 64 v scales
  static constexpr int kStageBytes = 2 * kRawBlock + (kFp8 ? 2 * kPrefillKeys * 4 : 0);
  static constexpr int kConvBytes = kFp8 ? 2 * kBlock16 : 0;
  // the FP8 conversion buffer is what wgmma reads there: 1024-byte aligned like the tiles
  static constexpr int kConvOffset = (kQBytes + 2 * kStageBytes + 1023) / 1024 * 1024;
  static constexpr int kSmemBytes =
      kWg ? kConvOffset + kConvBytes + 1024 : kQBytes + 2 * kStageBytes + kConvBytes;
  static_assert(!kWg || (kQBytes % 1024 == 0 && (kFp8 || kStageBytes % 1024 == 0)),
                "wgmma tiles start on 1024-byte boundaries");
  // q in registers up to head_dim 128 with one m-tile per warp; at 256, or with two m-tiles,
  // the O accumulators alone hold 128 registers: q is re-read from shared memory per k-step
  static constexpr bool kQRegs = !kWg && D <= 128 && kMT == 1;
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  // Byte offset of 16-byte chunk c of row r of a 16-bit tile of kTileRows rows: c ^ (r & 7)
  // within each group of eight chunks, so the eight rows an ldmatrix reads hit eight bank
  // groups. mma.sync kernels keep a row's chunks together (r * kRow16); wgmma kernels store
  // the 64-element slices of all rows one after another (wgmma.cuh's K-major tile).
  template <int kTileRows>
  __device__ static int tile_off(int r, int c) {
    if constexpr (kWg) return (c >> 3) * (kTileRows * 128) + r * 128 + (((c ^ r) & 7) << 4);
    else return r * kRow16 + (((c & ~7) | ((c ^ r) & 7)) << 4);
  }
  __device__ static int q_off(int r, int c) { return tile_off<kRows>(r, c); }
  __device__ static int kv_off(int r, int c) { return tile_off<kPrefillKeys>(r, c); }
  // A raw stage row: swizzled like a 16-bit tile when the cache is 16-bit (the MMAs read the
  // stage directly), plain for fp8 (the conversion reads it row by row).
  __device__ static int raw_off(int r, int c) { return kFp8 ? r * kRawRow + c * 16 : kv_off(r, c); }
};

// wgmma kernels of 8 warps fit 128 registers: two CTAs (four warpgroups) per SM.
template <int D, typename QT, typename KVT, int kWarps, int kMT, bool kWg = false>
__global__ void __launch_bounds__(32 * kWarps, kWg && kWarps == 8 ? 2 : 1)
    paged_prefill_kernel(const __grid_constant__ PrefillParams p) {
  using Tr = PrefillTraits<D, QT, KVT, kWarps, kMT, kWg>;
  constexpr int kPrefillRows = Tr::kRows, kPrefillThreads = Tr::kThreads;
  constexpr int kWarpRows = 16 * kMT;
  constexpr bool kFp8 = Tr::kFp8;
  constexpr int kKs = D / 16;              // k-steps of S = Q K^T
  constexpr int kDn = D / 8;               // n-tiles of O
  constexpr int kRawChunks = Tr::kRawRow / 16;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // wgmma's swizzled tiles need 1024-byte alignment (kSmemBytes has the room for it)
  unsigned char* smem =
      kWg ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw;
  unsigned char* sq = smem;
  unsigned char* stages = smem + Tr::kQBytes;
  unsigned char* conv = kWg ? smem + Tr::kConvOffset : stages + 2 * Tr::kStageBytes;

  const int tile = blockIdx.x / p.num_splits, split = blockIdx.x % p.num_splits;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const int G = p.group, TT = p.tile_tokens;

  pdl_wait();  // q, the cache and the tables may belong to the previous kernel
  const int L_raw = __ldg(p.seq_lens + b);
  const int c0 = __ldg(p.cu_seqlens_q + b), c1 = __ldg(p.cu_seqlens_q + b + 1);
  const int max_len = p.bt_cols * p.page_size;
  bool bad = false;
  if (L_raw < 0 || L_raw > max_len) {
    bad = true;
    if (threadIdx.x == 0) record_op_error(p.err, kOpErrPrefill, kOpErrSeqLen, b, -1, L_raw, max_len);
  }
  const bool span_ok = c0 >= 0 && c1 >= c0 && c1 <= p.tokens;
  const int n = span_ok ? c1 - c0 : 0;
  const int L = bad ? 0 : L_raw;
  if (span_ok && !bad && (n > L || n > p.q_tiles * TT)) {
    bad = true;
    if (threadIdx.x == 0)
      record_op_error(p.err, kOpErrPrefill, kOpErrQuerySpan, b, -1, n, min(L, p.q_tiles * TT));
  }
  if (!span_ok) {  // rows unknown: nothing can be written for this sequence
    if (threadIdx.x == 0 && blockIdx.x == 0 && kvh == 0)
      record_op_error(p.err, kOpErrPrefill, kOpErrQuerySpan, b, -1, c1 - c0, p.tokens);
    return;
  }
  const int t0 = tile * TT;  // first token of the tile (in the sequence)
  const bool last_seq = b == p.batch - 1;
  // Rows past the sequence: padding of the last sequence's bucket gets zeros, others nothing.
  const int row_end = last_seq ? min(t0 + TT, p.tokens - c0) : min(t0 + TT, n);
  if (t0 >= row_end) return;
  // Keys the tile can see: [0, L - n + min(t0 + TT, n)); this split's share of their blocks.
  const int kv_hi = t0 < n ? L - n + min(t0 + TT, n) : 0;
  const int nblk = (kv_hi + kPrefillKeys - 1) / kPrefillKeys;
  const int per = (nblk + p.num_splits - 1) / p.num_splits;
  const int kb0 = min(split * per, nblk), kb1 = min(kb0 + per, nblk);
  const int first_masked = (L - n + t0) / kPrefillKeys;  // blocks from here may need the mask

  const int64_t tok_stride = int64_t(p.kv_heads) * D;  // elements between tokens of a page
  const int* bt = p.block_table + int64_t(b) * p.bt_stride;
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);

  // ---- Q tile -> shared memory (rows past the sequence zero) ----
  {
    constexpr int kChunks = D * 2 / 16;
    const QT* qbase = static_cast<const QT*>(p.q);
    for (int c = threadIdx.x; c < kPrefillRows * kChunks; c += kPrefillThreads) {
      const int r = c / kChunks, cc = c % kChunks;
      const int t = t0 + r / G;
      const bool ok = r < TT * G && t < n;
      const QT* src = qbase + (int64_t(c0) + (ok ? t : 0)) * p.q_stride +
                      int64_t(kvh * G + r % G) * D + cc * 8;
      cp_async16_l2<0>(smem_addr(sq + Tr::q_off(r, cc)), ok ? src : qbase, ok ? 16 : 0);
    }
    cp_async_commit();
  }

  // Issue the copies of key block kb into stage s (one commit group, possibly empty).
  auto issue = [&](int kb, int s) {
    if (kb < kb1) {
      unsigned char* st = stages + s * Tr::kStageBytes;
      const uint32_t kdst = smem_addr(st), vdst = smem_addr(st + Tr::kRawBlock);
      for (int c = threadIdx.x; c < kPrefillKeys * kRawChunks; c += kPrefillThreads) {
        const int r = c / kRawChunks, cc = c % kRawChunks;
        const int key = kb * kPrefillKeys + r;
        const bool ok = key < kv_hi;
        int page = 0, in_page = 0;
        if (ok) {
          int col;
          if (p.page_shift >= 0) {
            col = key >> p.page_shift, in_page = key & (p.page_size - 1);
          } else {
            col = key / p.page_size, in_page = key % p.page_size;
          }
          page = __ldg(bt + col);
          if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.num_pages)) {
            if (cc == 0) record_op_error(p.err, kOpErrPrefill, kOpErrPage, b, col, page, p.num_pages);
            bad = true;
            page = 0;
          }
        }
        const int64_t off =
            ((int64_t(page) * p.page_size + in_page) * tok_stride + int64_t(kvh) * D) *
                int64_t(sizeof(KVT)) + cc * 16;
        const uint32_t so = uint32_t(Tr::raw_off(r, cc));
        cp_async16_l2<0>(kdst + so, ok ? kc + off : kc, ok ? 16 : 0);
        cp_async16_l2<0>(vdst + so, ok ? vc + off : vc, ok ? 16 : 0);
      }
      if (kFp8 && threadIdx.x < 2 * kPrefillKeys) {  // 64 k scales, then 64 v scales
        const int r = threadIdx.x & 63;
        const int key = kb * kPrefillKeys + r;
        const bool ok = key < kv_hi;
        int page = ok ? __ldg(bt + key / p.page_size) : 0;
        if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.num_pages)) page = 0;
        const float* sc = threadIdx.x < 64 ? p.k_scale : p.v_scale;
        const int64_t off = (int64_t(page) * p.page_size + key % p.page_size) * p.kv_heads + kvh;
        cp_async4(smem_addr(st + 2 * Tr::kRawBlock + threadIdx.x * 4), ok ? sc + off : sc,
                  ok ? 4 : 0);
      }
    }
    cp_async_commit();
  };

  issue(kb0, 0);

  // This warp's rows: m-tile mt holds rows kWarpRows * warp + 16 mt + (g, g + 8); the causal
  // limit (last key index a row may see) of each.
  int lim[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * kWarpRows + 16 * mt + g + 8 * h;
      const int t = t0 + r / G;
      lim[mt][h] = (r < TT * G && t < n) ? L - n + t : -1;
    }

  float o[kMT][kDn][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int j = 0; j < kDn; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
  float m_run[kMT][2], l_run[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
    m_run[mt][0] = m_run[mt][1] = -INFINITY, l_run[mt][0] = l_run[mt][1] = 0.f;

  uint32_t qf[Tr::kQRegs ? kKs : 1][4];
  const uint32_t sq_addr = smem_addr(sq);
  const int qrow = warp * kWarpRows + (lane & 15);   // + 16 mt
  if (Tr::kQRegs) {
    cp_async_wait<1>();  // the Q group (the first block's may still fly)
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < (Tr::kQRegs ? kKs : 1); ++ks)
      ldmatrix_x4(qf[ks], sq_addr + Tr::q_off(qrow, 2 * ks + (lane >> 4)));
  }

  for (int kb = kb0; kb < kb1; ++kb) {
    const int s = (kb - kb0) & 1;
    issue(kb + 1, s ^ 1);
    cp_async_wait<1>();
    if constexpr (kWg) wgmma::fence_proxy_async();  // this thread's copies, for the tensor cores
    __syncthreads();
    unsigned char* st = stages + s * Tr::kStageBytes;
    const unsigned char* kbuf = st;
    const unsigned char* vbuf = st + Tr::kRawBlock;
    const float* ksc = reinterpret_cast<const float*>(st + 2 * Tr::kRawBlock);
    if (kFp8) {  // e4m3 -> q's 16-bit type (exact), swizzled
      for (int c = threadIdx.x; c < 2 * kPrefillKeys * kRawChunks; c += kPrefillThreads) {
        const int kv = c / (kPrefillKeys * kRawChunks), cr = c % (kPrefillKeys * kRawChunks);
        const int r = cr / kRawChunks, cc = cr % kRawChunks;
        const uint4 w = *reinterpret_cast<const uint4*>((kv ? vbuf : kbuf) + r * Tr::kRawRow + cc * 16);
        const uint32_t in[4] = {w.x, w.y, w.z, w.w};
        uint32_t h[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const uint32_t hh = fp8x2_to_half2(uint16_t(hf ? in[e] >> 16 : in[e] & 0xffff));
            if (std::is_same<QT, __half>::value) {
              h[2 * e + hf] = hh;
            } else {
              const float2 f = unpack2<__half>(hh);
              h[2 * e + hf] = pack2<QT>(f.x, f.y);
            }
          }
        }
        unsigned char* dst = conv + kv * Tr::kBlock16;
        *reinterpret_cast<uint4*>(dst + Tr::kv_off(r, 2 * cc)) = make_uint4(h[0], h[1], h[2], h[3]);
        *reinterpret_cast<uint4*>(dst + Tr::kv_off(r, 2 * cc + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
      }
      if constexpr (kWg) wgmma::fence_proxy_async();
      __syncthreads();
      kbuf = conv;
      vbuf = conv + Tr::kBlock16;
    }
    const uint32_t kaddr = smem_addr(kbuf), vaddr = smem_addr(vbuf);

    float sc[kMT][8][4];
    if constexpr (kWg) {
      // ---- S = Q K^T, the warpgroup's 64 rows x 64 keys: D / 16 wgmmas, Q and K in shared
      // memory (K-major, 128-byte swizzle: a k step is 32 bytes into a 64-wide slice) ----
      float (&s32)[32] = *reinterpret_cast<float(*)[32]>(&sc[0][0][0]);
      const uint32_t qwg = sq_addr + (warp >> 2) * 64 * 128;
      wgmma::fence();
#pragma unroll
      for (int ks = 0; ks < kKs; ++ks) {
        const uint32_t qa = qwg + (ks >> 2) * (Tr::kRows * 128) + (ks & 3) * 32;
        const uint32_t ka = kaddr + (ks >> 2) * (kPrefillKeys * 128) + (ks & 3) * 32;
        wgmma::mma_ss<64, QT>(s32, wgmma::desc_sw128(qa, 16, 1024), wgmma::desc_sw128(ka, 16, 1024),
                              ks > 0);
      }
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::fence_operands(s32);
    } else {
      // ---- S = Q K^T: kMT x 16 rows x 64 keys per warp; each K fragment feeds every m-tile ----
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < 8; ++j) sc[mt][j][0] = sc[mt][j][1] = sc[mt][j][2] = sc[mt][j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kKs; ++ks) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          if (Tr::kQRegs) {
            a[mt][0] = qf[Tr::kQRegs ? ks : 0][0], a[mt][1] = qf[Tr::kQRegs ? ks : 0][1];
            a[mt][2] = qf[Tr::kQRegs ? ks : 0][2], a[mt][3] = qf[Tr::kQRegs ? ks : 0][3];
          } else {
            ldmatrix_x4(a[mt], sq_addr + Tr::q_off(qrow + 16 * mt, 2 * ks + (lane >> 4)));
          }
        }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t bk[4];
          ldmatrix_x4(bk, kaddr + Tr::kv_off(16 * np + (lane & 7) + ((lane >> 4) << 3),
                                            2 * ks + ((lane >> 3) & 1)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma_16816<QT>(sc[mt][2 * np], a[mt], bk[0], bk[1]);
            mma_16816<QT>(sc[mt][2 * np + 1], a[mt], bk[2], bk[3]);
          }
        }
      }
    }
    // ---- scale, fp8 key scales, causal mask ----
    const bool need_mask = kb >= first_masked;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key_in = 8 * j + 2 * q4 + (e & 1);
          float f = p.scale_log2;
          if (kFp8) f *= ksc[key_in];
          float v = sc[mt][j][e] * f;
          if (need_mask && kb * kPrefillKeys + key_in > lim[mt][e >> 1]) v = -INFINITY;
          sc[mt][j][e] = v;
        }
    // ---- online softmax, rows g (e = 0, 1) and g + 8 (e = 2, 3) of each m-tile ----
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(sc[mt][j][2 * h], sc[mt][j][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mt][h], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2_ftz(m_run[mt][h] - m_use);
        m_run[mt][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          sc[mt][j][2 * h] = exp2_ftz(sc[mt][j][2 * h] - m_use);
          sc[mt][j][2 * h + 1] = exp2_ftz(sc[mt][j][2 * h + 1] - m_use);
          sum += sc[mt][j][2 * h] + sc[mt][j][2 * h + 1];
        }
        l_run[mt][h] = l_run[mt][h] * alpha + sum;
#pragma unroll
        for (int j = 0; j < kDn; ++j) o[mt][j][2 * h] *= alpha, o[mt][j][2 * h + 1] *= alpha;
      }
    if (kFp8) {
      const float* vsc = ksc + kPrefillKeys;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[mt][j][e] *= vsc[8 * j + 2 * q4 + (e & 1)];
    }
    if constexpr (kWg) {
      // ---- O += P V: P (this warp's 16 rows x 16 keys per step) from registers, V in shared
      // memory MN-major (rows = keys: 16 keys a step, 8 at a time SBO = 1024 apart; the D
      // slices LBO = 64 keys x 128 bytes apart) ----
      float (&o_all)[kDn * 4] = *reinterpret_cast<float(*)[kDn * 4]>(&o[0][0][0]);
      uint32_t pa[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        pa[kk][0] = pack2<QT>(sc[0][2 * kk][0], sc[0][2 * kk][1]);
        pa[kk][1] = pack2<QT>(sc[0][2 * kk][2], sc[0][2 * kk][3]);
        pa[kk][2] = pack2<QT>(sc[0][2 * kk + 1][0], sc[0][2 * kk + 1][1]);
        pa[kk][3] = pack2<QT>(sc[0][2 * kk + 1][2], sc[0][2 * kk + 1][3]);
      }
      wgmma::fence_operands(o_all);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma::mma_rs_t<D, QT>(o_all, pa[kk],
                               wgmma::desc_sw128(vaddr + kk * 16 * 128, kPrefillKeys * 128, 1024), 1);
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::fence_operands(o_all);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) wgmma::fence_operand(pa[kk][i]);
    } else {
      // ---- O += P V: each V fragment feeds every m-tile ----
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          a[mt][0] = pack2<QT>(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
          a[mt][1] = pack2<QT>(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
          a[mt][2] = pack2<QT>(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
          a[mt][3] = pack2<QT>(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, vaddr + Tr::kv_off(16 * kk + (lane & 15), 2 * dn + (lane >> 4)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma_16816<QT>(o[mt][2 * dn], a[mt], bv[0], bv[1]);
            mma_16816<QT>(o[mt][2 * dn + 1], a[mt], bv[2], bv[3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with stage s before block kb + 2 refills it
  }
  cp_async_wait<0>();
  pdl_trigger();
  const bool cta_bad = __syncthreads_or(bad);

  // ---- epilogue: rows g, g + 8 of each of this warp's m-tiles ----
  const float kNaN = __int_as_float(0x7fffffff);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[mt][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int r = warp * kWarpRows + 16 * mt + g + 8 * h;
      const int t = t0 + r / G;
      if (r >= TT * G || t >= row_end) continue;
      const bool valid = t < n;   // else a padding row: zeros
      const int head = kvh * G + r % G;
      const int64_t row = (int64_t(c0) + t) * p.q_heads + head;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const bool poison = valid && cta_bad;
      if (p.num_splits == 1) {
        QT* dst = static_cast<QT*>(p.out) + row * D + 2 * q4;
#pragma unroll
        for (int j = 0; j < kDn; ++j) {
          float x = valid ? o[mt][j][2 * h] * inv : 0.f, y = valid ? o[mt][j][2 * h + 1] * inv : 0.f;
          if (poison) x = y = kNaN;
          *reinterpret_cast<uint32_t*>(dst + 8 * j) = pack2<QT>(x, y);
        }
      } else {
        float* dst = p.o_partial + (int64_t(split) * p.tokens * p.q_heads + row) * D + 2 * q4;
#pragma unroll
        for (int j = 0; j < kDn; ++j) {
          float x = valid ? o[mt][j][2 * h] * inv : 0.f, y = valid ? o[mt][j][2 * h + 1] * inv : 0.f;
          if (poison) x = y = kNaN;
          *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(x, y);
        }
        if (q4 == 0)
          p.lse_partial[int64_t(split) * p.tokens * p.q_heads + row] =
              poison ? kNaN : (valid && l > 0.f ? m_run[mt][h] + __log2f(l) : -INFINITY);
      }
    }
}

// Combines the splits of every (token, head) row: out = sum_s w_s O_s / sum_s w_s with
// w_s = 2^(lse_s - max lse), in split order (bitwise reproducible); a NaN LSE poisons the row, a
// row no split saw (every LSE -inf) gets zeros. One warp per row, each lane D / 32 columns.
template <int D, typename QT>
__global__ void __launch_bounds__(128) prefill_merge_kernel(const __grid_constant__ PrefillParams p) {
  pdl_wait();
  const int64_t rows = int64_t(p.tokens) * p.q_heads;
  const int64_t row = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int S = p.num_splits;
  const int64_t split_stride = rows;
  float M = -INFINITY;
  bool nan_lse = false;
  for (int s = 0; s < S; ++s) {
    const float v = p.lse_partial[s * split_stride + row];
    nan_lse |= isnan(v);
    M = fmaxf(M, v);
  }
  constexpr int kPer = D / 32;
  float acc[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) acc[e] = 0.f;
  float W = 0.f;
  if (M != -INFINITY && !nan_lse) {
    for (int s = 0; s < S; ++s) {
      const float w = exp2f(p.lse_partial[s * split_stride + row] - M);
      W += w;
      const float* src = p.o_partial + (s * split_stride + row) * D + lane * kPer;
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] += w * src[e];
    }
  }
  const float inv = W > 0.f ? 1.f / W : 0.f;
  QT* dst = static_cast<QT*>(p.out) + row * D + lane * kPer;
#pragma unroll
  for (int e = 0; e < kPer; e += 2) {
    float x = acc[e] * inv, y = acc[e + 1] * inv;
    if (nan_lse) x = y = __int_as_float(0x7fffffff);
    *reinterpret_cast<uint32_t*>(dst + e) = pack2<QT>(x, y);
  }
  pdl_trigger();
}

}  // namespace attention
}  // namespace fusedist
