// Launcher for the fused RoPE + paged-cache append (csrc/include/fusedist/attention/
// rope_append.cuh): validates, picks the (dtype, cache dtype, style) instantiation, launches.
#include <string>

#include "fusedist/attention/api.h"
#include "fusedist/attention/rope_append.cuh"
#include "fusedist/common/launch.h"

namespace fusedist {
namespace {

using attention::RopeAppendParams;
using attention::RopeStyle;

template <typename T, typename CT, RopeStyle S>
void launch(const RopeAppendParams& p, cudaStream_t stream) {
  const int64_t warps = p.tokens * (p.q_heads + 2 * p.kv_heads);
  const int64_t blocks = (warps + attention::kRopeWarpsPerBlock - 1) / attention::kRopeWarpsPerBlock;
  FUSEDIST_CHECK_ARG(blocks <= 0x7fffffff, "rope_append: too many tokens x heads for one grid");
  launch_kernel("rope_append_kernel", attention::rope_append_kernel<T, CT, S>,
                dim3(unsigned(blocks)), dim3(attention::kRopeWarpsPerBlock * 32), stream, p);
}

template <typename T, typename CT>
void by_style(const RopeAppendParams& p, int style, cudaStream_t s) {
  if (style == int(RopeStyle::kNeox)) launch<T, CT, RopeStyle::kNeox>(p, s);
  else launch<T, CT, RopeStyle::kGptj>(p, s);
}

template <typename T>
void by_cache(const RopeAppendParams& p, DType cache, int style, cudaStream_t s) {
  if (cache == DType::kFloat8E4M3) by_style<T, __nv_fp8_e4m3>(p, style, s);
  else by_style<T, T>(p, style, s);
}

bool aligned16(uintptr_t a) { return a % 16 == 0; }

}  // namespace

void rope_append(const RopeAppendArgs& a, uintptr_t stream) {
  const std::string w = "rope_append: ";
  FUSEDIST_CHECK_ARG(a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat16,
                     w + "q, k, v must be bfloat16 or float16, got " + dtype_name(a.dtype));
  FUSEDIST_CHECK_ARG(a.cache_dtype == a.dtype || a.cache_dtype == DType::kFloat8E4M3,
                     w + "the cache must have q's dtype or float8_e4m3fn, got " +
                         dtype_name(a.cache_dtype));
  FUSEDIST_CHECK_ARG(a.style == 0 || a.style == 1, w + "style must be 0 (neox) or 1 (gptj)");
  FUSEDIST_CHECK_ARG(a.head_dim > 0 && a.head_dim % 8 == 0 &&
                         a.head_dim <= attention::kRopeMaxHeadDim,
                     w + "head_dim must be a multiple of 8 up to 256, got " +
                         std::to_string(a.head_dim));
  FUSEDIST_CHECK_ARG(a.rot > 0 && a.rot % 16 == 0 && a.rot <= a.head_dim,
                     w + "rotary_dim must be a multiple of 16 up to head_dim, got " +
                         std::to_string(a.rot));
  FUSEDIST_CHECK_ARG(a.q_heads > 0 && a.kv_heads > 0 && a.max_position > 0 && a.tokens >= 0,
                     w + "q_heads, kv_heads and max_position must be positive, tokens >= 0");
  FUSEDIST_CHECK_ARG(a.q && a.k && a.v && a.positions && a.cos_sin && a.k_cache && a.v_cache &&
                         a.slot_mapping,
                     w + "q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping must be "
                         "non-null");
  const bool fp8 = a.cache_dtype == DType::kFloat8E4M3;
  FUSEDIST_CHECK_ARG(!fp8 || (a.k_scale && a.v_scale), w + "an fp8 cache needs k_scale, v_scale");
  FUSEDIST_CHECK_ARG(a.num_slots > 0, w + "num_slots (num_pages * page_size) must be > 0");
  FUSEDIST_CHECK_ARG(aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && aligned16(a.cos_sin) &&
                         aligned16(a.k_cache) && aligned16(a.v_cache),
                     w + "q, k, v, cos_sin, k_cache and v_cache must be 16-byte aligned");
  FUSEDIST_CHECK_ARG(a.q_stride % 8 == 0 && a.k_stride % 8 == 0 && a.v_stride % 8 == 0,
                     w + "token strides of q, k, v must be multiples of 8 elements");
  FUSEDIST_CHECK_ARG((a.q_norm == 0) == (a.k_norm == 0),
                     w + "q_norm and k_norm come together (both or neither)");
  if (a.q_norm) {
    FUSEDIST_CHECK_ARG(a.norm_dtype == DType::kFloat32 || a.norm_dtype == a.dtype,
                       w + "q_norm / k_norm must be float32 or q's dtype, got " +
                           dtype_name(a.norm_dtype));
    FUSEDIST_CHECK_ARG(a.norm_eps > 0.f, w + "norm_eps must be > 0");
    FUSEDIST_CHECK_ARG(aligned16(a.q_norm) && aligned16(a.k_norm),
                       w + "q_norm and k_norm must be 16-byte aligned");
  }
  if (a.tokens == 0) return;
  RopeAppendParams p{};
  p.q = reinterpret_cast<void*>(a.q);
  p.k = reinterpret_cast<void*>(a.k);
  p.v = reinterpret_cast<const void*>(a.v);
  p.positions = reinterpret_cast<const void*>(a.positions);
  p.cos_sin = reinterpret_cast<const float*>(a.cos_sin);
  p.k_cache = reinterpret_cast<void*>(a.k_cache);
  p.v_cache = reinterpret_cast<void*>(a.v_cache);
  p.k_scale = reinterpret_cast<float*>(a.k_scale);
  p.v_scale = reinterpret_cast<float*>(a.v_scale);
  p.slot_mapping = reinterpret_cast<const int64_t*>(a.slot_mapping);
  p.tokens = a.tokens;
  p.q_heads = a.q_heads, p.kv_heads = a.kv_heads, p.head_dim = a.head_dim, p.rot = a.rot;
  p.max_position = a.max_position;
  p.num_slots = a.num_slots;
  p.err = reinterpret_cast<OpErrorRecord*>(a.err);
  p.q_stride = a.q_stride, p.k_stride = a.k_stride, p.v_stride = a.v_stride;
  p.positions_int64 = a.positions_int64;
  p.q_norm = reinterpret_cast<const void*>(a.q_norm);
  p.k_norm = reinterpret_cast<const void*>(a.k_norm);
  p.norm_eps = a.norm_eps;
  p.norm_w_fp32 = a.norm_dtype == DType::kFloat32;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (a.dtype == DType::kBFloat16) by_cache<__nv_bfloat16>(p, a.cache_dtype, a.style, s);
  else by_cache<__half>(p, a.cache_dtype, a.style, s);
}

}  // namespace fusedist
