// fusedist/common/common.h -- host+device basics shared by every tier: dtype codes, limits and the
// CUDA error check that turns a failed call into an exception naming the call site.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fusedist {

// The interface version of fusedist._C: bumped whenever an argument struct, a constant or a
// signature changes in a way an older build would misread. fusedist/_ext.py ABI_VERSION must
// equal it (a stale extension is one error naming both versions).
constexpr int kAbiVersion = 2;

// Largest world size a symmetric communicator supports on one NVLink domain.
constexpr int kMaxRanks = 8;

// Element type codes shared with fusedist/_dtypes.py. Keep in sync.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3 };

// Payload formats of the FP8 collectives' codec (comm/fp8_codec.cuh); exported to Python as
// fusedist._C.FP8_FORMAT_E4M3 / FP8_FORMAT_E3M4. A plain enum: kernels take it as a template int.
enum Fp8Format : int { kFp8E4M3 = 0, kFp8E3M4 = 1 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

inline int dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
  }
  return 0;
}

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  throw std::runtime_error(std::string("fusedist: CUDA error at ") + file + ":" +
                           std::to_string(line) + " in " + what + ": " +
                           cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace fusedist

// Check a CUDA runtime call; on failure throw with the call text and site.
#define FUSEDIST_CUDA_CHECK(call)                                                \
  do {                                                                           \
    cudaError_t fusedist_err_ = (call);                                          \
    if (fusedist_err_ != cudaSuccess)                                            \
      ::fusedist::throw_cuda_error(fusedist_err_, #call, __FILE__, __LINE__);    \
  } while (0)

// Check the last launch (configuration errors surface here, not at the <<<>>>).
#define FUSEDIST_LAUNCH_CHECK(kernel_name)                                       \
  do {                                                                           \
    cudaError_t fusedist_err_ = cudaGetLastError();                              \
    if (fusedist_err_ != cudaSuccess)                                            \
      ::fusedist::throw_cuda_error(fusedist_err_, "launch of " kernel_name,      \
                                   __FILE__, __LINE__);                          \
  } while (0)

#define FUSEDIST_CHECK_ARG(cond, msg)                                            \
  do {                                                                           \
    if (!(cond)) throw std::invalid_argument(std::string("fusedist: ") + (msg)); \
  } while (0)
