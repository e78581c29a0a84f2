// Host launchers for the symmetric all-reduce kernels: capacity checks, dtype dispatch,
// grid sizing from values identical on every rank, launch and error check.
#include "fusedist/comm/allreduce_oneshot.cuh"
#include "fusedist/comm/allreduce_twoshot.cuh"
#include "fusedist/comm/api.h"
#include "fusedist/common/launch.h"

namespace fusedist {

namespace {
constexpr int kThreads = 512;

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid from the vector count, the group-wide minimum SM count and the kernel's occupancy only,
// so every rank picks the same grid and block b of every rank covers the same vectors. The
// grid never exceeds what is resident at once: a block waits only for the same block of its
// peers, and all of them are running.
int grid_for(int64_t vectors, int max_blocks, int per_sm) {
  return int(std::max<int64_t>(
      1, std::min<int64_t>(div_up(vectors, kThreads), int64_t(max_blocks) * per_sm)));
}

template <typename T>
void launch(const SymmComm& c, uintptr_t in, uintptr_t out, int64_t n, AllReduceAlgo algo,
            cudaStream_t s) {
  constexpr int kPer = ElemTraits<T>::kPerVec;
  const int64_t nvec = div_up(n, kPer);
  if (algo == AllReduceAlgo::kOneShot) {
    const auto kernel = reinterpret_cast<const void*>(allreduce_oneshot_kernel<T>);
    const int grid = grid_for(nvec, c.max_blocks, blocks_per_sm(kernel, kThreads, 0));
    launch_kernel("allreduce_oneshot_kernel", allreduce_oneshot_kernel<T>, grid, kThreads, s,
                  c.view, reinterpret_cast<const T*>(in), reinterpret_cast<T*>(out), n);
  } else {
    const int64_t chunk = div_up(nvec, c.view.world);
    const auto kernel = reinterpret_cast<const void*>(allreduce_twoshot_kernel<T>);
    const int grid = grid_for(div_up(chunk, kTwoShotUnroll), c.max_blocks,
                              blocks_per_sm(kernel, kThreads, 0));
    launch_kernel("allreduce_twoshot_kernel", allreduce_twoshot_kernel<T>, grid, kThreads, s,
                  c.view, reinterpret_cast<const T*>(in), reinterpret_cast<T*>(out), n);
  }
}
}  // namespace

int64_t allreduce_max_numel(const SymmComm& c, DType dtype, AllReduceAlgo algo) {
  const int64_t per = 16 / dtype_size(dtype);
  const int64_t slot_vecs = int64_t(c.view.slot_bytes / 16);
  if (algo == AllReduceAlgo::kOneShot) return slot_vecs * per;
  const int64_t gather_vecs =
      int64_t((c.view.gen_bytes - c.view.world * c.view.slot_bytes - kDescBytes) / 16);
  return std::min(gather_vecs, slot_vecs * c.view.world) * per;
}

void allreduce(const SymmComm& c, uintptr_t in, uintptr_t out, int64_t numel, DType dtype,
               AllReduceAlgo algo, uintptr_t stream) {
  FUSEDIST_CHECK_ARG(numel >= 0, "all_reduce: numel must be >= 0");
  if (numel == 0) return;
  FUSEDIST_CHECK_ARG(in % 16 == 0 && out % 16 == 0,
                     "all_reduce: input and output must be 16-byte aligned");
  const int64_t cap = allreduce_max_numel(c, dtype, algo);
  FUSEDIST_CHECK_ARG(numel <= cap, "all_reduce: " + std::to_string(numel) +
                                       " elements exceed this communicator's capacity of " +
                                       std::to_string(cap) + " for the chosen algorithm");
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: launch<float>(c, in, out, numel, algo, s); break;
    case DType::kFloat16: launch<__half>(c, in, out, numel, algo, s); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(c, in, out, numel, algo, s); break;
    default:
      throw std::invalid_argument(std::string("all_reduce: unsupported dtype ") +
                                  dtype_name(dtype) + "; use float32, float16 or bfloat16");
  }
}

}  // namespace fusedist
