// Launchers of the FP8 payload codec (csrc/include/fusedist/comm/fp8_codec.cuh): validate, pick
// the dtype, size the grid from the sizes only (identical on every rank), launch.
#include <algorithm>
#include <string>

#include "fusedist/comm/api.h"
#include "fusedist/comm/fp8_codec.cuh"
#include "fusedist/common/launch.h"

namespace fusedist {
namespace {

constexpr int64_t kMaxGrid = 65536;

void check_fmt(const std::string& w, int fmt) {
  FUSEDIST_CHECK_ARG(fmt == kFp8E4M3 || fmt == kFp8E3M4,
                     w + "fmt must be " + std::to_string(kFp8E4M3) + " (e4m3) or " +
                         std::to_string(kFp8E3M4) + " (e3m4), got " + std::to_string(fmt));
}

template <int kFmt>
void launch_encode(DType dtype, dim3 grid, dim3 block, cudaStream_t s,
                   const comm::Fp8EncodeParams& p) {
  switch (dtype) {
    case DType::kFloat32:
      launch_kernel("fp8_encode_kernel", comm::fp8_encode_kernel<float, kFmt>, grid, block, s, p);
      break;
    case DType::kFloat16:
      launch_kernel("fp8_encode_kernel", comm::fp8_encode_kernel<__half, kFmt>, grid, block, s,
                    p);
      break;
    default:
      launch_kernel("fp8_encode_kernel", comm::fp8_encode_kernel<__nv_bfloat16, kFmt>, grid,
                    block, s, p);
      break;
  }
}

}  // namespace

void fp8_encode(const Fp8EncodeArgs& a, uintptr_t stream) {
  const std::string w = "fp8_encode: ";
  FUSEDIST_CHECK_ARG(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat16 ||
                         a.dtype == DType::kBFloat16,
                     w + "dtype must be float32, float16 or bfloat16, got " + dtype_name(a.dtype));
  FUSEDIST_CHECK_ARG(a.block > 0, w + "block must be > 0, got " + std::to_string(a.block));
  check_fmt(w, a.fmt);
  FUSEDIST_CHECK_ARG(a.numel >= 0, w + "numel must be >= 0");
  if (a.numel == 0) return;
  FUSEDIST_CHECK_ARG(a.x && a.q && a.scales, w + "x, q and scales must be non-null");
  FUSEDIST_CHECK_ARG(a.scales % 4 == 0, w + "scales must be 4-byte aligned");
  comm::Fp8EncodeParams p{};
  p.x = reinterpret_cast<const void*>(a.x);
  p.q = reinterpret_cast<uint8_t*>(a.q);
  p.scales = reinterpret_cast<float*>(a.scales);
  p.numel = a.numel;
  p.block = a.block;
  p.nblocks = (a.numel + a.block - 1) / a.block;
  const dim3 grid(unsigned(std::min(p.nblocks, kMaxGrid)));
  const dim3 block(comm::kFp8CodecThreads);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (a.fmt == kFp8E3M4) {
    launch_encode<kFp8E3M4>(a.dtype, grid, block, s, p);
  } else {
    launch_encode<kFp8E4M3>(a.dtype, grid, block, s, p);
  }
}

void fp8_decode_sum(const Fp8DecodeSumArgs& a, uintptr_t stream) {
  const std::string w = "fp8_decode_sum: ";
  FUSEDIST_CHECK_ARG(a.block > 0, w + "block must be > 0, got " + std::to_string(a.block));
  FUSEDIST_CHECK_ARG(a.payloads >= 1, w + "payloads must be >= 1, got " +
                                          std::to_string(a.payloads));
  check_fmt(w, a.fmt);
  FUSEDIST_CHECK_ARG(a.numel >= 0, w + "numel must be >= 0");
  if (a.numel == 0) return;
  const int64_t nblocks = (a.numel + a.block - 1) / a.block;
  FUSEDIST_CHECK_ARG(a.payloads == 1 || (a.q_stride >= a.numel && a.scale_stride >= nblocks),
                     w + "payload strides must cover numel bytes and ceil(numel / block) scales");
  FUSEDIST_CHECK_ARG(a.q && a.scales && a.out, w + "q, scales and out must be non-null");
  FUSEDIST_CHECK_ARG(a.scales % 4 == 0 && a.out % 4 == 0,
                     w + "scales and out must be 4-byte aligned");
  comm::Fp8DecodeSumParams p{};
  p.q = reinterpret_cast<const uint8_t*>(a.q);
  p.scales = reinterpret_cast<const float*>(a.scales);
  p.out = reinterpret_cast<float*>(a.out);
  p.numel = a.numel;
  p.q_stride = a.q_stride;
  p.scale_stride = a.scale_stride;
  p.block = a.block;
  p.payloads = a.payloads;
  const int64_t ctas = (a.numel + comm::kFp8CodecThreads - 1) / comm::kFp8CodecThreads;
  const dim3 grid(unsigned(std::min(ctas, kMaxGrid)));
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (a.fmt == kFp8E3M4) {
    launch_kernel("fp8_decode_sum_kernel", comm::fp8_decode_sum_kernel<kFp8E3M4>, grid,
                  dim3(comm::kFp8CodecThreads), s, p);
  } else {
    launch_kernel("fp8_decode_sum_kernel", comm::fp8_decode_sum_kernel<kFp8E4M3>, grid,
                  dim3(comm::kFp8CodecThreads), s, p);
  }
}

}  // namespace fusedist
