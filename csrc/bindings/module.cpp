// fusedist._C: declarations only. Each area registers itself; logic lives in csrc/ops.
#include <pybind11/pybind11.h>

#include "fusedist/common/common.h"

// Set by CMakeLists.txt: the package version this build belongs to (fusedist/_version.py) and
// the architectures it was compiled for.
#ifndef FUSEDIST_VERSION
#define FUSEDIST_VERSION "unknown"
#endif
#ifndef FUSEDIST_CUDA_ARCHS_STR
#define FUSEDIST_CUDA_ARCHS_STR ""
#endif

namespace py = pybind11;

void register_symmetric(py::module_& m);
void register_allreduce(py::module_& m);
void register_gemm_comm(py::module_& m);
void register_gemm(py::module_& m);
void register_attention(py::module_& m);
void register_rope(py::module_& m);
void register_layers(py::module_& m);
void register_fp8_codec(py::module_& m);
void register_ep(py::module_& m);
void register_moe_gemm(py::module_& m);
void register_moe(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusedist CUDA kernels (raw pointers + cudaStream_t; no torch inside)";
  // The capability table's inputs (fusedist/_ext.py): which fusedist this is and what it runs on.
  m.attr("VERSION") = FUSEDIST_VERSION;
  m.attr("ABI_VERSION") = fusedist::kAbiVersion;
  m.attr("CUDA_ARCHS") = FUSEDIST_CUDA_ARCHS_STR;
  m.attr("CUDA_RUNTIME") = CUDART_VERSION;
  register_symmetric(m);
  register_allreduce(m);
  register_gemm_comm(m);
  register_gemm(m);
  register_attention(m);
  register_rope(m);
  register_layers(m);
  register_fp8_codec(m);
  register_ep(m);
  register_moe_gemm(m);
  register_moe(m);
}
